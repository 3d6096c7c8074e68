"""Smoke test: bench/slurm.py, with tiny counts, times fiberctl, the API and srun steps inside
one allocation on the real cluster, and the hooks, and ends with its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.barehost.clusterkit import SlurmCluster

pytestmark = pytest.mark.slurm
BENCH = Path(__file__).resolve().parents[3] / "bench" / "slurm.py"


def test_bench_slurm_prints_its_figures(slurm_cluster: SlurmCluster) -> None:
    # Its job runs as root: bench/slurm.py times this checkout's development venv (under
    # /root), as the invoking user, not the site install.
    out = subprocess.run([sys.executable, str(BENCH), "-n", "2", "--gpu", "--hook-runs", "1"],
                         capture_output=True, text=True, timeout=240, env=slurm_cluster.env)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["bench"] == "slurm" and figures["job"] > 0 and figures["fiberd_ready_s"] > 0
    for way in ("fiberctl_run", "api_clone", "srun_step", "python_floor", "python_site"):
        assert figures[way]["n"] == 2
        assert 0 < figures[way]["p50_ms"] <= figures[way]["p99_ms"]
    ratio = figures["ratio_srun_over_fiberctl_p50"]
    assert ratio == round(figures["srun_step"]["p50_ms"] / figures["fiberctl_run"]["p50_ms"], 2)
    assert figures["meets_target"] == (ratio >= figures["target_ratio"])
    floor = figures["ratio_srun_over_python_floor_p50"]
    assert floor == round(figures["srun_step"]["p50_ms"] / figures["python_floor"]["p50_ms"], 2)
    assert {"prolog", "epilog"} <= set(figures["hooks"])
    assert all(figures["hooks"][hook]["p50_ms"] > 0 for hook in ("prolog", "epilog"))


def test_bench_slurm_says_why_without_a_cluster(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "SLURM_CONF": str(tmp_path / "no-such.conf")}
    out = subprocess.run([sys.executable, str(BENCH), "-n", "1"], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == f"bench/slurm.py: SLURM_CONF {env['SLURM_CONF']} is not a file\n"
