"""Smoke test: bench/fiberd_pss.py measures the floor and a standalone fiberd and ends with
its JSON (the --slurm mode needs a cluster: run it by hand, see the script)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fiberd_pss.py"


def test_bench_fiberd_pss_prints_fiberd_beside_the_floor() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--samples", "1", "--settle", "0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["where"] == "standalone"
    floor = figures["samples"][0]["floor"]
    assert (0 < floor["bare"]["pss_mb"] < floor["floor"]["pss_mb"]
            < floor["floor_with_ssl"]["pss_mb"] < floor["cryptography"]["pss_mb"])
    fiberd = figures["samples"][0]["fiberd"]
    assert fiberd["pss_mb"] > 0 and fiberd["uss_mb"] > 0
    summary = figures["summary"]
    assert 0 < summary["pss_over_floor_with_ssl"][0] < summary["pss_over_floor"][0]
