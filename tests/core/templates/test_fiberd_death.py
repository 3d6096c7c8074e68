"""Fibers never outlive fiberd: SIGKILL a real fiberd-like process, walk /proc, sweep cgroups."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_fiber.core.cgroups.manager import CgroupManager
from tests.core.processkit import REPO, cgroup_dirs, wait_marked


def _start_fiberd(tmp_path: Path, mark: str, root: Path | None):
    args = [sys.executable, "-m", "tests.core.templates.fiberdlikekit", str(tmp_path), mark]
    if root is not None:
        args.append(str(root))
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the fiberd-like process died before reporting its pids"
    return proc, json.loads(line)


def _kill_fiberd(tmp_path: Path, mark: str, root: Path | None) -> dict[str, list[object]]:
    proc, pids = _start_fiberd(tmp_path, mark, root)
    # template, its spare + call + exec + sh and its two sleeps (the shell starts them shortly)
    alive = set(wait_marked(mark, 7))
    assert {pids["template"], *pids["spares"], *pids["fibers"]} <= alive and len(alive) == 7
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert wait_marked(mark, 0) == []
    return pids


def test_sigkill_of_fiberd_leaves_no_template_or_fiber_uncarved(tmp_path: Path, mark: str):
    _kill_fiberd(tmp_path, mark, None)


@pytest.mark.machine_may_lack("a writable cgroup2 hierarchy")
def test_sigkill_of_fiberd_then_the_next_start_sweeps_its_cgroups(tmp_path: Path, mark: str,
                                                                  cgroup_root: Path):
    pids = _kill_fiberd(tmp_path, mark, cgroup_root)
    left = [p.name for p in cgroup_dirs(cgroup_root)]
    assert "grant-g" in left and set(pids["leaves"]) <= set(left)  # a dead fiberd cleans nothing up
    removed = asyncio.run(CgroupManager(cgroup_root).sweep())
    assert [p.name for p in removed] == ["grant-g"]
    assert cgroup_dirs(cgroup_root) == []
