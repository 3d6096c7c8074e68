"""A real standalone fiberd for the Executor's and ``fiberctl map``'s tests: the
quickstart's throwaway site, one grant whose template preloads json and the test
functions (``tests.executor.fnkit``, importable there: the checkout is on the venv's path).
``stop_site`` checks that nothing of the site is left running."""

from __future__ import annotations

from pathlib import Path

from slurm_fiber.cli.throwaway import Site
from slurm_fiber.core.trust.grant import Limits

PRELOADS = ("json", "tests.executor.fnkit")


def started_site(root: Path, limits: Limits | None = None) -> Site:
    """A site under ``root`` whose fiberd runs and whose template is warm (blocks)."""
    site = Site.create(root, PRELOADS, limits=limits)
    site.start(cgroup_root="delegate")
    site.wait_warm(60, lambda _state, _s: None)
    return site


def stop_site(site: Site) -> None:
    site.stop()
    assert site.leftovers() == []
