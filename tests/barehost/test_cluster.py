"""The bare-host cluster works: idle nodes, multi-node steps, fake GPUs, a clean `down`.

Steps and jobs run as job users (two jobs against each other as two users).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.barehost.importtimekit import imported

if TYPE_CHECKING:
    from tests.barehost.clusterkit import BareHost, SlurmCluster
    from tests.security.userkit import JobUser


pytestmark = pytest.mark.slurm


def test_nodes_are_idle(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N %T")
    states = dict(line.split() for line in out.stdout.splitlines())
    assert set(slurm_cluster.nodes) == {"n1", "n2"}
    assert all(states[n] in {"idle", "mixed", "allocated"} for n in slurm_cluster.nodes), states


def test_srun_on_both_nodes(slurm_cluster: SlurmCluster, job_user: JobUser) -> None:
    out = slurm_cluster.srun("-N2", "hostname", user=job_user)
    assert out.returncode == 0 and len(out.stdout.split()) == 2, out.stderr
    names = slurm_cluster.srun("-N2", "sh", "-c", 'echo "$SLURMD_NODENAME $(id -un)"',
                               user=job_user)
    assert sorted(names.stdout.splitlines()) == [f"n1 {job_user.name}", f"n2 {job_user.name}"]


def test_fiberctl_in_a_job_imports_only_what_one_run_needs(slurm_cluster: SlurmCluster,
                                                          job_user: JobUser) -> None:
    """The site venv's console script (pip >= 25.2: bare-host's SITE_PIP) and fiberctl's
    in-job path import no re, nor the enum, functools and collections it brings (about
    8 ms of every fiberctl a job starts). No fiberd runs in this step: with --no-wait (a
    job's fiberctl otherwise waits for its fiberd to listen) it ends with 69."""
    bin_dir = slurm_cluster.site_bin
    out = slurm_cluster.srun("-N1", str(bin_dir / "python"), "-X", "importtime",
                             str(bin_dir / "fiberctl"), "run", "--no-wait", "--", "true",
                             user=job_user)
    assert out.returncode == 69, out.stderr
    modules = imported(out.stderr)
    assert {"slurm_fiber.client.fiberctl", "slurm_fiber.client.siteroot"} <= modules
    assert not {m for m in modules if m.startswith("slurm_fiber.homes")}
    assert not {"re", "enum", "functools", "collections", "socket", "typing"} & modules


def test_gpu_step_sees_its_gpu(slurm_cluster: SlurmCluster, job_user: JobUser) -> None:
    out = slurm_cluster.srun("--gres=gpu:1", "printenv", "CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS",
                             user=job_user)
    assert out.returncode == 0, out.stderr
    cuda, step = out.stdout.split()
    assert cuda == step and cuda in {"0", "1"}


def test_two_one_gpu_jobs_on_one_node_get_different_gpus(
        slurm_cluster: SlurmCluster, job_user: JobUser, other_user: JobUser,
        job_dir: Callable[[JobUser], Path]) -> None:
    script = ("#!/bin/sh\nprintf %s \"$SLURM_JOB_GPUS\" > gpus-$SLURM_JOB_ID\n"
              "i=0; while [ ! -f release ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done\n")
    works = [job_dir(user) for user in (job_user, other_user)]
    jobs = [slurm_cluster.submit(script, "-w", "n1", "--gres=gpu:1", "-t", "2", workdir=work,
                                 user=user)
            for user, work in zip((job_user, other_user), works, strict=True)]
    try:
        for job in jobs:
            slurm_cluster.wait_for(job, {"RUNNING"}, timeout=30)
        files = [work / f"gpus-{job}" for work, job in zip(works, jobs, strict=True)]
        for _ in range(100):
            if all(f.exists() and f.read_text() for f in files):
                break
            subprocess.run(["sleep", "0.1"], check=True)
        gpus = [f.read_text() for f in files]
        assert sorted(gpus) == ["0", "1"], gpus
    finally:
        for work in works:
            (work / "release").touch()
        for job in jobs:
            slurm_cluster.wait_done(job)


def test_up_down_lifecycle_leaves_no_daemon(private_dir: Path,
                                            bare_host_script: BareHost) -> None:
    """A second, private cluster: idempotent up, status/env, and down by PID; Slurm's
    cgroup/v1 runs on bind mounts of groups of its own, which down removes."""
    bare_host, exports = bare_host_script.run, bare_host_script.exports
    if os.geteuid() != 0:
        pytest.skip("bare-host up needs root")
    env = bare_host_script.private_env(private_dir)
    up = bare_host("up", "--no-hooks", env=env)
    assert up.returncode == 0, up.stderr
    try:
        again = bare_host("up", "--no-hooks", env=env)
        assert again.returncode == 0 and "already up" in again.stdout
        status = json.loads(bare_host("status", "--json", env=env).stdout)
        assert status["up"] and status["nodes"] == {"n1": "idle", "n2": "idle"}
        pids = [d["pid"] for d in status["daemons"]]
        variables = exports(bare_host("env", env=env).stdout)
        assert variables["SLURM_CONF"] == str(private_dir / "cluster" / "etc" / "slurm.conf")
        ping = subprocess.run(["scontrol", "ping"], env=os.environ | variables,
                              capture_output=True, text=True, timeout=30)
        assert "is UP" in ping.stdout
        run_dir = private_dir / "cluster"
        assert "CgroupPlugin=cgroup/v1" in (run_dir / "etc" / "cgroup.conf").read_text()
        groups = json.loads((run_dir / "slurm-cgroups.json").read_text())
        assert sorted(groups) == ["devices", "freezer", "memory"], groups
        mounts = [run_dir / "cgroup" / controller for controller in groups]
        assert all(os.path.ismount(m) for m in mounts), mounts
        assert all(Path(g).is_dir() for g in groups.values()), groups
    finally:
        down = bare_host("down", env=env)
    assert down.returncode == 0, down.stderr
    for pid in pids:
        stat = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                              text=True).stdout.strip()
        assert stat in {"", "Z"} or stat.startswith("Z"), (pid, stat)
    assert bare_host("status", env=env).returncode == 3
    assert not any(os.path.ismount(m) for m in mounts), mounts
    assert not any(Path(g).exists() for g in groups.values()), groups


def test_usage_errors_exit_2(bare_host_script: BareHost) -> None:
    out = subprocess.run([str(bare_host_script.path), "sideways"], capture_output=True, text=True)
    assert out.returncode == 2
