"""Smoke test: bench/tasks.py runs every system with a tiny task count, leaves one out
with a stated reason, measures the confined floor, draws its PNG and ends with its JSON
line. A peer this machine lacks (Dask, GNU parallel: ``./dev test`` installs both) leaves
its targets unmeasured; the test then checks the rest and ends as a stated skip naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "tasks.py"
SYSTEMS = {"subprocess", "pool", "forkserver", "parallel", "dask", "fiber", "fibermap"}


def test_bench_tasks_prints_every_system_the_targets_and_a_plot(tmp_path: Path) -> None:
    png = tmp_path / "tasks.png"
    out = subprocess.run([sys.executable, str(BENCH), "-n", "4", "--seq", "2", "--rounds", "1",
                          "--no-install",
                          "--skip", "pool", "--plot", str(png)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    systems = figures["systems"]
    assert set(systems) == SYSTEMS
    assert systems["pool"]["skipped"] == "skipped by --skip"
    for name, row in systems.items():
        if "skipped" in row:
            assert row["skipped"]  # a reason a person can act on
            continue
        for w in ("W1", "W2"):
            assert row[w]["tasks_per_s"] > 0
            if name not in ("parallel", "fibermap"):
                assert 0 < row[w]["p50_ms"] <= row[w]["p99_ms"]
    assert systems["fiber"]["fresh_process"] == "yes + cgroup"
    assert set(figures["targets"]) == {"w2_throughput_fiber_over_dask",
                                       "w2_seq_p50_executor_over_dask",
                                       "w1_seq_p50_exec_over_subprocess",
                                       "w1_throughput_map_over_parallel"}
    assert figures["targets"]["w1_seq_p50_exec_over_subprocess"]["value"] > 0
    host = figures["host"]
    assert host["cgroup_mode"] in {"hybrid", "unified", "legacy"}
    assert host["kernel"] == os.uname().release
    assert all(isinstance(o, str) and o for o in host["cgroup2_mounts"].values())
    assert figures["bound"]["pipeline_p50_ms"] > 0
    assert figures["bound"]["clone_call_over_pipeline"] > 0
    assert figures["bound"]["executor_w2_p50_over_clone_call"] > 0
    cpu = figures["cpu_per_task_ms"]  # clock ticks: a 4-task run may read 0 ms
    for key in ("fibermap/W1", "fibermap/W2"):
        assert set(cpu[key]) == {"fiberd", "template", "fibers", "helpers", "client", "total",
                                 "cpu_bound_per_s", "share_of_bound"}
        assert all(v >= 0 for v in cpu[key].values())
    if "skipped" not in systems["parallel"]:
        assert set(cpu["parallel/W1"]) == {"client", "total", "cpu_bound_per_s",
                                           "share_of_bound"}
    floor = figures["floor"]  # the confined floor, in the hierarchies the fibers joined
    assert floor["hierarchies"][:1] == (["unified"] if figures["cgroups"] == "carved" else [])
    for w in ("W1", "W1-fork", "W2"):
        assert floor[w]["tasks_per_s"] > 0 and floor[w]["cpu_per_task_ms"] >= 0
    missing = []
    for key, w, peer in (("w1_throughput_map_over_parallel", "W1", "parallel"),
                         ("w2_throughput_fiber_over_dask", "W2", "dask")):
        target = figures["targets"][key]
        assert target["floor_tasks_per_s"] == floor[w]["tasks_per_s"]
        if "skipped" in systems[peer]:
            assert target["needs_tasks_per_s"] is None
            missing.append(f"{peer} ({systems[peer]['skipped']})")
            continue
        assert target["needs_tasks_per_s"] > 0 and target["needs_cpu_per_task_ms"] > 0
    assert figures["left_running"] == []
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if missing:
        pytest.skip(f"peers not installed, their targets unmeasured: {', '.join(missing)}; "
                    "./dev test installs them")


def test_bench_tasks_measures_both_window_paths_in_one_run() -> None:
    """``--window-path fiberd,template``: main's map and the task-window map (a second
    fiberd with ``task_window = "template"``) in the same rounds, W1 and W2, with the CPU
    per task per process of each and the task-window rows' ratios; the Executor with
    windows against each fiberd (``executor_w``, ``fiber_tw``), W2."""
    out = subprocess.run([sys.executable, str(BENCH), "-n", "6", "--seq", "2", "--rounds", "2",
                          "--no-install", "--window-path", "fiberd,template",
                          "--skip", "subprocess,pool,forkserver,dask,fiber"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    systems = figures["systems"]
    for name in ("fibermap", "fibermap_tw"):
        for w in ("W1", "W2"):
            assert systems[name][w]["tasks_per_s"] > 0
    for name in ("executor_w", "fiber_tw"):
        assert systems[name]["W2"]["tasks_per_s"] > 0
        assert 0 < systems[name]["W2"]["p50_ms"] <= systems[name]["W2"]["p99_ms"]
        assert systems[name]["fresh_process"] == "yes + cgroup"
    for key in ("fibermap/W1", "fibermap_tw/W1", "fibermap/W2", "fibermap_tw/W2",
                "executor_w/W2", "fiber_tw/W2"):
        row = figures["cpu_per_task_ms"][key]
        assert {"fiberd", "template", "fibers", "client", "total"} <= set(row)
    assert {"w1_throughput_map_tw_over_parallel", "w1_throughput_map_tw_over_dask",
            "w1_throughput_map_tw_over_map", "w2_throughput_fiber_tw_over_dask",
            "w2_throughput_map_tw_over_dask", "w2_throughput_executor_w_over_dask",
            "w2_seq_p50_fiber_tw_over_dask",
            "w2_seq_p50_executor_w_over_dask"} <= set(figures["targets"])
    assert "CPU per task, fibermap_tw/W1" in out.stdout
    assert "CPU per task, fibermap_tw/W2" in out.stdout
    assert "w2_throughput_fiber_tw_over_dask: " in out.stdout
    assert "w2_throughput_map_tw_over_dask: " in out.stdout
