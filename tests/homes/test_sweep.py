"""The start-up sweep's choices: which trees are a dead predecessor's, and readiness reset.

The cgroup side runs against a real fiberd in tests/security/test_predecessor_sweep.py;
here the choice of trees is checked on a plain directory tree (no cgroup is touched),
and the readiness reset on a real standalone home's ready file.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.homes.standalone import StandaloneHome
from slurm_fiber.homes.sweep import dead_trees, owner_alive, reset_readiness


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_only_fiberd_named_trees_of_dead_owners_are_chosen(tmp_path: Path) -> None:
    gone = dead_pid()
    assert not owner_alive(gone) and owner_alive(os.getpid())
    zombie = subprocess.Popen(["true"])
    try:
        while owner_alive(zombie.pid):  # exits, unreaped: a zombie counts as dead
            os.sched_yield()
        own = tmp_path / f"slurm-fiber.{os.getpid()}"
        for name in (own.name, f"slurm-fiber.{gone}", f"slurm-fiber.{zombie.pid}",
                     "slurm-fiber.1", f"other.{gone}", f"slurm-fiber.{gone}x", "slurm-fiber.0"):
            (tmp_path / name).mkdir()
        (tmp_path / f"slurm-fiber.{dead_pid()}").symlink_to(tmp_path / f"other.{gone}")
        chosen = dead_trees(tmp_path, own)
    finally:
        zombie.wait()
    expected = {(tmp_path / f"slurm-fiber.{gone}", gone),
                (tmp_path / f"slurm-fiber.{zombie.pid}", zombie.pid)}
    assert set(chosen) == expected  # pid 1 lives; the rest are not fiberd's names


def test_a_dead_tree_whose_fiberd_leaf_is_populated_is_left(tmp_path: Path) -> None:
    gone = dead_pid()
    tree = tmp_path / f"slurm-fiber.{gone}"
    (tree / "_fiberd").mkdir(parents=True)
    (tree / "_fiberd" / "cgroup.events").write_text("populated 1\nfrozen 0\n")
    assert dead_trees(tmp_path, tmp_path / "mine") == []  # a fiberd in another pid namespace


def test_reset_readiness_overwrites_a_predecessors_ready_file(tmp_path: Path,
                                                              clock: FakeClock) -> None:
    grants = tmp_path / "grants"
    grants.mkdir(mode=0o700)
    ready = tmp_path / "ready.json"
    ready.write_text(json.dumps({"ready": True, "warm": ["g1"], "time": 1.0}))
    home = StandaloneHome(str(grants), clock, ready_file=str(ready), notify_socket=None)
    assert asyncio.run(reset_readiness(home)) == "not ready: published"
    assert json.loads(ready.read_text())["ready"] is False


class _Stuck:
    """A home whose readiness publish never returns, or fails."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    async def publish_ready(self, grant_uid: str, ready: bool) -> None:
        if self.fail:
            raise OSError("read-only file system")
        await asyncio.Event().wait()


def test_reset_readiness_is_bounded_and_never_raises() -> None:
    stuck = asyncio.run(reset_readiness(_Stuck(False), within=0.01))  # type: ignore[arg-type]
    assert stuck.startswith("not ready: publish pending")
    failed = asyncio.run(reset_readiness(_Stuck(True)))  # type: ignore[arg-type]
    assert failed == "not ready: publish failed (read-only file system)"
