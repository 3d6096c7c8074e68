"""``slurm-fiber conform --home slurm`` against the real bare-host cluster.

The CLI runs in a subprocess with the cluster's environment (``bare-host
env``): the stage submits a real batch job holding one GPU, and fiberd runs
with that job's step environment, real templates and fibers, real
`scontrol`/`squeue`, the prolog's grantdir and GPU leases, and `scancel`.

Every clause runs (nothing is declared lacking) and passes. (The run once
found that a job's GPU could be claimed only once: a released claim freed
the lease with no grant left; NodeLeases.release now gives it back to the
job's pool.)
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from slurm_fiber.conform.slurm import dead_conf, parse_env0
from tests.conform.test_cli import CLI, REPO, outcomes
from tests.slurm import conftest as slurm_site
from tests.slurm.conftest import SlurmCluster

slurm_cluster = slurm_site.slurm_cluster  # the session's bare-host cluster (tests/slurm)

CLAUSES = ("preadmission.warms", "removal.releases", "removal.denies", "redelivery.lifts",
           "misses.fresh", "misses.stale", "misses.never", "readiness.flips",
           "devices.provisioned", "devices.released", "scope.loss")
LEASE_FINDING = "a free lease is not a grant"


def conform_on(cluster: SlurmCluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**cluster.env, "PYTHONPATH": str(REPO)}
    return subprocess.run([str(CLI), "conform", "--home", "slurm", "--json", *args],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
                          check=False)


def jobs_of_the_stage(cluster: SlurmCluster) -> str:
    return cluster.run("squeue", "-h", "-n", "slurm-fiber-conform", "-o", "%i %T").stdout.strip()


@pytest.mark.slurm
def test_every_clause_passes_on_the_real_cluster(slurm_cluster: SlurmCluster) -> None:
    began = time.monotonic()
    run = conform_on(slurm_cluster)
    took = time.monotonic() - began
    report = json.loads(run.stdout)
    assert outcomes(report) == dict.fromkeys(CLAUSES, "pass"), run.stdout + run.stderr[-3000:]
    assert run.returncode == 0
    assert LEASE_FINDING not in run.stderr  # every GPU claim after a release was granted
    assert "slurm home: scope lost: job" in run.stderr  # the home's poll saw the scancel
    assert "Traceback" not in run.stderr
    assert took < 120, f"conform --home slurm took {took:.1f} s"
    left = jobs_of_the_stage(slurm_cluster).splitlines()
    assert all(line.endswith("COMPLETING") for line in left), left  # cancelled on close


@pytest.mark.slurm
def test_a_jobs_first_gpu_claim_is_held_and_released(slurm_cluster: SlurmCluster) -> None:
    run = conform_on(slurm_cluster, "--clause", "devices.released")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert outcomes(json.loads(run.stdout)) == {"devices.released": "pass"}


def test_silence_moves_only_the_controller_port() -> None:
    conf = "ClusterName=c\nSlurmctldHost=localhost\nslurmctldport = 6817\nNodeName=n1\n"
    assert dead_conf(conf, 40001) == \
        "ClusterName=c\nSlurmctldHost=localhost\nSlurmctldPort=40001\nNodeName=n1\n"
    assert dead_conf("ClusterName=c\n", 40001) == "ClusterName=c\nSlurmctldPort=40001\n"


def test_the_step_environment_is_read_from_env_minus_0() -> None:
    data = b"SLURM_JOB_ID=7\0A=b=c\0EMPTY=\0junk\0\0"
    assert parse_env0(data) == {"SLURM_JOB_ID": "7", "A": "b=c", "EMPTY": ""}
