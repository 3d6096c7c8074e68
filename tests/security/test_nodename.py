"""A node name that is not one path component (``SLURMD_NODENAME=..``) never steers the root
hooks outside the node's own state: the prolog and the epilog refuse it in one line,
create nothing and remove nothing. (slurmd sets the variable; a job user cannot, but a
bad slurm.conf or a wrapper can, and the hooks run as root.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.hooks.hookkit import Site, job_env, run_hook
from tests.security.publicdirkit import public_dir
from tests.security.userkit import JobUser


@pytest.fixture
def site() -> Iterator[Site]:
    with public_dir() as scratch:
        yield Site(scratch / "site")


@pytest.mark.parametrize("node", ["..", ".", "n1\x1b[2J"])
def test_a_node_name_that_is_not_a_name_is_refused(site: Site, mallory: JobUser,
                                                   node: str) -> None:
    escaped = site.state_root / "jobs" / "31"  # where nodes/../jobs/31 lands
    env = job_env(site, 31, mallory.uid, mallory.gid, mallory.name, node=node, gpus="0")
    out = run_hook("prolog", env, timeout=30)
    assert out.returncode == 0 and "SLURMD_NODENAME=" in out.stderr
    assert "is not a node name" in out.stderr and len(out.stderr.splitlines()) == 1
    assert not escaped.exists() and not (site.state_root / "leases").exists()
    escaped.mkdir(parents=True)  # root's, unrelated to any job of that node
    out = run_hook("epilog", env, timeout=30)
    assert out.returncode == 0 and "is not a node name" in out.stderr
    assert escaped.is_dir()
