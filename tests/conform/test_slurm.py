"""``slurm-fiber conform --home slurm`` against the real bare-host cluster.

The CLI runs in a subprocess with the cluster's environment (``bare-host
env``): the stage submits a real batch job holding one GPU, and fiberd runs
with that job's step environment, real templates and fibers, real
`scontrol`/`squeue`, the prolog's grantdir and GPU leases, and `scancel`.

The CLI is started as root, so it runs itself again as the stage's job user
(sfalice, through ``SLURM_FIBER_CONFORM_USER``): the job and fiberd run as
that user, never as root (root's fiberd refuses the job user's state dir).

Every clause runs (nothing is declared lacking) and passes. (The run once
found that a job's GPU could be claimed only once: a released claim freed
the lease with no grant left. Now the prolog claims each GPU for the whole
job in the root-only lease area, and ``devices.released`` reads what
fiberd's home holds.)
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from slurm_fiber.conform.issuer import ConformIssuer
from slurm_fiber.conform.slurm import (
    JOB_USER_ENV,
    SlurmStage,
    dead_conf,
    job_env,
    parse_env0,
    read_job_file,
)
from slurm_fiber.conform.slurm import job_user as stage_job_user
from slurm_fiber.conform.stage import StageCannot
from tests.barehost.clusterkit import SlurmCluster
from tests.conform.conformkit import CLI, REPO, SLURM_CLAUSES, outcomes
from tests.security.userkit import JobUser

# slurm_cluster (the session's bare-host cluster) and job_user (sfalice, the stage's job
# user) are tests/conftest.py's fixtures.

LEASE_FINDING = "a free lease is not a grant"


def conform_on(cluster: SlurmCluster, user: JobUser,
               *args: str) -> subprocess.CompletedProcess[str]:
    env = {**cluster.env, "PYTHONPATH": str(REPO), JOB_USER_ENV: user.name}
    return subprocess.run([str(CLI), "conform", "--home", "slurm", "--json", *args],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
                          check=False)


def stage_job(cluster: SlurmCluster) -> str:
    """`scontrol -o show job` of the stage's latest job (slurmctld keeps ended jobs a while)."""
    out = cluster.run("scontrol", "-o", "show", "job").stdout.splitlines()
    mine = [line for line in out if " JobName=slurm-fiber-conform " in line]
    assert mine, "slurmctld knows no job of the stage"
    return max(mine, key=lambda line: int(line.split()[0].removeprefix("JobId=")))


def jobs_of_the_stage(cluster: SlurmCluster) -> str:
    out = cluster.run("squeue", "-h", "-n", "slurm-fiber-conform", "-o", "%i %T %u")
    return out.stdout.strip()


@pytest.mark.slurm
def test_every_clause_passes_on_the_real_cluster(slurm_cluster: SlurmCluster,
                                                 job_user: JobUser) -> None:
    began = time.monotonic()
    run = conform_on(slurm_cluster, job_user)
    took = time.monotonic() - began
    report = json.loads(run.stdout)
    assert outcomes(report) == dict.fromkeys(SLURM_CLAUSES, "pass"), run.stdout + run.stderr[-3000:]
    assert run.returncode == 0
    assert LEASE_FINDING not in run.stderr  # every GPU claim after a release was granted
    # The scancel reaches fiberd through the home's poll (every 5 s, "slurm home: scope lost")
    # or, on a busy host, first through the epilog removing the job's grant files about a
    # second after it: scope.loss accepts either, so neither line is required here.
    shown = stage_job(slurm_cluster)
    assert f" UserId={job_user.name}({job_user.uid}) " in shown, shown
    assert "Traceback" not in run.stderr
    assert took < 120, f"conform --home slurm took {took:.1f} s"
    left = jobs_of_the_stage(slurm_cluster).splitlines()
    # cancelled on close, and it was the job user's
    assert all(line.endswith(f"COMPLETING {job_user.name}") for line in left), left


@pytest.mark.slurm
def test_a_jobs_first_gpu_claim_is_held_and_released(slurm_cluster: SlurmCluster,
                                                      job_user: JobUser) -> None:
    run = conform_on(slurm_cluster, job_user, "--clause", "devices.released")
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


def test_the_job_runs_as_the_named_user_and_never_as_root() -> None:
    assert stage_job_user({}, euid=1000) is None  # not root: submits as itself
    assert stage_job_user({JOB_USER_ENV: "root"}, euid=1000) is None
    default = stage_job_user({}, euid=0)
    assert default is not None and default.pw_name == "nobody"
    with pytest.raises(StageCannot, match="is root: jobs run as a job user"):
        stage_job_user({JOB_USER_ENV: "root"}, euid=0)
    with pytest.raises(StageCannot, match="no such account"):
        stage_job_user({JOB_USER_ENV: "sf-no-such-user"}, euid=0)


@pytest.mark.skipif(os.geteuid() != 0, reason="checks the stage run as root")
def test_the_stage_does_not_open_as_root(tmp_path: Path) -> None:
    """fiberd would run as root and refuse the job user's state dir: nothing is submitted."""
    stage = SlurmStage()
    issuer = ConformIssuer(tmp_path, "mark").issuer
    with pytest.raises(StageCannot, match="fiberd runs as the job's user, not root"):
        asyncio.run(stage.open(tmp_path / "stage", issuer))


def test_the_job_users_run_gets_a_plain_environment() -> None:
    env = job_env({"PATH": "/root/.pyenv/bin:/usr/bin", "HOME": "/root", "VIRTUAL_ENV": "/v",
                   "SLURM_CONF": "/c", "SLURM_FIBER_CONFIG": "/s"})
    assert env == {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                   "SLURM_CONF": "/c", "SLURM_FIBER_CONFIG": "/s"}


def test_a_job_file_is_read_only_when_regular_and_small(tmp_path: Path) -> None:
    (tmp_path / "step.env").write_bytes(b"A=1\0")
    assert read_job_file(tmp_path / "step.env", 100) == b"A=1\0"
    (tmp_path / "link").symlink_to(tmp_path / "step.env")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "big").write_bytes(b"x" * 101)
    for name in ("link", "fifo", "big"):
        with pytest.raises(OSError):
            read_job_file(tmp_path / name, 100)
