"""``slurm-fiber conform`` as the conform tests run it: the command, its report, the clauses.

``conform`` runs the installed ``slurm-fiber conform`` in a subprocess from the repo root
(``REPO`` on ``PYTHONPATH``, so a home under ``tests.`` can be named); ``outcomes`` reads a
``--json`` report as clause name to outcome. ``SLURM_CLAUSES`` is every clause, all of
which the Slurm home must pass, on the bare-host cluster and on each container release.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLI = Path(sys.executable).parent / "slurm-fiber"

SLURM_CLAUSES = ("preadmission.warms", "removal.releases", "removal.denies",
                 "redelivery.lifts", "misses.fresh", "misses.stale", "misses.never",
                 "readiness.flips", "devices.provisioned", "devices.released", "scope.loss")


def conform(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([str(CLI), "conform", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout, check=False)


def outcomes(report: dict[str, object]) -> dict[str, str]:
    clauses = report["clauses"]
    assert isinstance(clauses, list)
    return {c["clause"]: c["outcome"] for c in clauses}
