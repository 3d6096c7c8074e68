"""fiberd's memory budget (the one place memory is traded for code: bench/fiberd_pss.py): a
standalone fiberd with one warm grant stays within ``PSS_BUDGET_MB`` of proportional set
size, and the bench measures it beside the interpreter's floor (the --slurm mode needs a
cluster: run it by hand, see the script)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fiberd_pss.py"


def test_fiberd_stays_within_its_pss_budget_beside_the_floor() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--samples", "1", "--settle", "0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["where"] == "standalone"
    floor = figures["samples"][0]["floor"]
    assert (0 < floor["bare"]["pss_mb"] < floor["floor"]["pss_mb"]
            < floor["floor_with_ssl"]["pss_mb"])
    fiberd = figures["samples"][0]["fiberd"]
    assert fiberd["pss_mb"] > 0 and fiberd["uss_mb"] > 0
    [budget] = figures["summary"]["budget_pss_mb"]
    assert fiberd["pss_mb"] <= budget, f"fiberd's PSS {fiberd['pss_mb']} MB > {budget} MB"
    summary = figures["summary"]
    assert 0 < summary["pss_over_floor_with_ssl"][0] < summary["pss_over_floor"][0]
