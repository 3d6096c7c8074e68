"""Smoke test: bench/confined_floor.py runs its cgroup2-only workloads (clone3 into the
leaf, spawn with moves, the moves alone) alternated, with tiny task counts, ends with its
JSON line and leaves no cgroup behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_fiber.core.cgroups.v1 import V1_LIMITED, V1Layout

BENCH = Path(__file__).resolve().parents[2] / "bench" / "confined_floor.py"


@pytest.mark.machine_may_lack("a writable cgroup v2 hierarchy (root or a delegated subtree)")
def test_bench_confined_floor_runs_clone3_into_the_leaf_beside_spawn_and_its_moves() -> None:
    bench = subprocess.Popen([sys.executable, str(BENCH), "-n", "3", "-j", "2", "--rounds", "2",
                              "--workloads", "W1,W1-fork,W1-clone3,moves"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = bench.communicate(timeout=120)
    figures = json.loads(stdout.strip().splitlines()[-1])
    if "unavailable" in figures:
        pytest.skip(figures["unavailable"])
    assert bench.returncode == 0, stderr
    assert figures["hierarchies"] == ["unified"]
    assert len(figures["rounds"]) == 2
    for figs in (*figures["rounds"], figures["median"]):
        assert set(figs) == {"W1", "W1-fork", "W1-clone3", "moves"}
        assert all(f["tasks_per_s"] > 0 for f in figs.values())
        assert set(figs["W1"]) == {"tasks_per_s", "cpu_per_task_ms", "move_wall_ms_per_task",
                                   "move_cpu_ms_per_task"}
    for bound in figures["W1_less_moves"]:
        assert bound["in_situ"]["tasks_per_s"] > 0
    leftovers = [d for d, _, _ in os.walk("/sys/fs/cgroup") if f"/sf-floor-{bench.pid}" in d]
    assert leftovers == []


@pytest.mark.machine_may_lack("cgroup v1 hierarchies a fiber gets a group in (a hybrid host)")
def test_bench_confined_floor_refuses_clone3_beside_the_v1_hierarchies() -> None:
    if not [c for c in V1_LIMITED if c in V1Layout.of_self().mounts]:
        pytest.skip("no cgroup v1 hierarchy mounted here")
    out = subprocess.run([sys.executable, str(BENCH), "-n", "1", "--v1",
                          "--workloads", "W1-clone3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert "cgroup2 hierarchy only" in figures["unavailable"]
