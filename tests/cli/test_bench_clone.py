"""Smoke tests: bench/clone.py and bench/cgroup_join.py run with tiny sample counts and end
with their JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "clone.py"


def test_bench_clone_prints_its_figures_and_a_plot(tmp_path: Path) -> None:
    png = tmp_path / "cdf.png"
    out = subprocess.run([sys.executable, str(BENCH), "-n", "4", "--cold-runs", "2",
                          "--rounds", "2", "--plot", str(png)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    paths = ("cold_start", "fork_floor", "forkserver", "pipeline", "clone_call", "clone_exec")
    for path in paths:
        assert figures[path]["n"] == (2 if path == "cold_start" else 4)
        assert 0 < figures[path]["p50_ms"] <= figures[path]["p99_ms"]
    assert figures["fork_floor"]["p50_ms"] < figures["cold_start"]["p50_ms"]
    for mode in ("call", "exec"):
        assert set(figures["targets"][mode]) == {"p50_over_floor", "floor_target_met",
                                                 "faster_than_cold", "cold_target_met"}
    assert figures["targets"]["pipeline_over_floor"] > 0
    assert figures["targets"]["clone_call_over_pipeline"] > 0
    for mode in ("call", "exec"):  # CPU per Clone by process, summed in total
        cpu = figures["targets"]["cpu_per_clone_ms"][mode]
        assert set(cpu) == {"fiberd", "template", "fibers", "helpers", "client", "total"}
        assert cpu["total"] == pytest.approx(sum(v for k, v in cpu.items() if k != "total"),
                                             abs=0.05)
    assert figures["left_running"] == []
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.machine_may_lack("a writable cgroup v2 hierarchy (root or a delegated subtree)")
def test_bench_cgroup_join_times_the_three_ways_and_leaves_no_cgroup() -> None:
    out = subprocess.run([sys.executable, str(BENCH.parent / "cgroup_join.py"), "-n", "3"],
                         capture_output=True, text=True, timeout=120)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    if "unavailable" in figures:
        pytest.skip(figures["unavailable"])
    assert out.returncode == 0, out.stderr
    for gap in ("gap_0ms", "gap_50ms"):
        assert set(figures[gap]) == {"fork_p50_ms", "fork_join_p50_ms", "clone3_into_p50_ms"}
        assert all(v > 0 for v in figures[gap].values())
    leftovers = [d for d, _, _ in os.walk("/sys/fs/cgroup") if "/sf-bench-" in d]
    assert leftovers == []
