"""Smoke test: bench/scale.py --quick runs both sweeps, stops cleanly and ends with its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "scale.py"


def test_bench_scale_quick_prints_its_figures_and_leaves_nothing(tmp_path: Path) -> None:
    png = tmp_path / "scale.png"
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--plot", str(png)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    points = figures["fibers"]["points"]
    assert [p["n"] for p in points] == [0, 20]
    assert points[-1]["running"] == 20 and points[-1]["listed"] == 20
    assert all(p["lost"] == 0 and 0 < p["p50_ms"] <= p["p99_ms"] for p in points)
    assert figures["fibers"]["stop"]["fibers"] == 20
    bound = figures["fibers"]["stop_bound"]
    if figures["fibers"]["cgroups"] == "carved":  # as root: the kernel's share of the stop
        assert bound["n"] == 20 and bound["hierarchies"] >= 1, bound
        assert bound["total_s"] > 0 and bound["stop_over_bound"] > 0
        for parent in map(Path, bound["parents"]):
            assert not list(parent.glob("slurm-fiber-bound.*"))
    else:
        assert "skipped" in bound
    assert [g["g"] for g in figures["grants"]] == [1, 2]
    assert all(g["per_grant_pss_mb"] > 0 for g in figures["grants"])
    assert figures["clean_stops"] is True
    assert figures["floor"]["pss_mb"] > 0 and figures["fiberd_pss_over_floor"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
