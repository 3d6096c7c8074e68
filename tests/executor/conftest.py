"""A real standalone fiberd (the quickstart's throwaway site) for the Executor's and
``fiberctl map``'s tests: one grant whose template preloads json and this package's
test functions (``tests.executor.fns``), started once per module, stopped after it with
a check that nothing of it is left running."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.cli.throwaway import Site
from slurm_fiber.core.grant import Limits

PRELOADS = ("json", "tests.executor.fns")


def started_site(root: Path, limits: Limits | None = None) -> Site:
    site = Site.create(root, PRELOADS, limits=limits)
    site.start(cgroup_root="delegate")
    site.wait_warm(60, lambda _state, _s: None)
    return site


def stop_site(site: Site) -> None:
    site.stop()
    assert site.leftovers() == []


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    s = started_site(tmp_path_factory.mktemp("site"))
    yield s
    stop_site(s)
