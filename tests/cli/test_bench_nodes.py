"""Smoke test: bench/nodes.py, with tiny counts, runs its four maps in one 2-node job on the
real cluster as a job user and ends with its JSON line (its figures are not checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.barehost.clusterkit import SlurmCluster
    from tests.security.userkit import JobUser

pytestmark = pytest.mark.slurm
BENCH = Path(__file__).resolve().parents[2] / "bench" / "nodes.py"


def test_bench_nodes_prints_the_four_ways(slurm_cluster: SlurmCluster,
                                          job_user: JobUser) -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--tasks", "4", "--long", "0.3",
                          "--short", "0.1", "--user", job_user.name], capture_output=True,
                         text=True, timeout=300, env=slurm_cluster.env)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["bench"] == "nodes" and figures["job"] > 0
    for way in ("spool_rr", "spool_dynamic", "relay_rr", "relay_dynamic"):
        (run,) = figures[way]["runs"]
        assert run["makespan_s"] > 0
        assert sorted(s for seqs in run["tasks_by_node"].values() for s in seqs) == [1, 2, 3, 4]
    for way in ("spool_rr", "relay_rr"):  # round robin: odd tasks on n1, even ones on n2
        assert figures[way]["runs"][0]["tasks_by_node"] == {"n1": [1, 3], "n2": [2, 4]}
    assert "makespan, 4 tasks" in out.stderr
