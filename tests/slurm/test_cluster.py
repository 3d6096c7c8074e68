"""The bare-host cluster works: idle nodes, multi-node steps, fake GPUs, a clean `down`."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import BareHost, SlurmCluster


pytestmark = pytest.mark.slurm


def test_nodes_are_idle(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%N %T")
    states = dict(line.split() for line in out.stdout.splitlines())
    assert set(slurm_cluster.nodes) == {"n1", "n2"}
    assert all(states[n] in {"idle", "mixed", "allocated"} for n in slurm_cluster.nodes), states


def test_srun_on_both_nodes(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.srun("-N2", "hostname")
    assert out.returncode == 0 and len(out.stdout.split()) == 2, out.stderr
    names = slurm_cluster.srun("-N2", "printenv", "SLURMD_NODENAME")
    assert sorted(names.stdout.split()) == ["n1", "n2"]


def test_gpu_step_sees_its_gpu(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.srun("--gres=gpu:1", "printenv", "CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS")
    assert out.returncode == 0, out.stderr
    cuda, step = out.stdout.split()
    assert cuda == step and cuda in {"0", "1"}


def test_two_one_gpu_jobs_on_one_node_get_different_gpus(slurm_cluster: SlurmCluster,
                                                          tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    release = tmp_path / "release"
    script = (f"#!/bin/sh\nprintf %s \"$SLURM_JOB_GPUS\" > {tmp_path}/gpus-$SLURM_JOB_ID\n"
              f"i=0; while [ ! -f {release} ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done\n")
    jobs = [slurm_cluster.submit(script, "-w", "n1", "--gres=gpu:1", "-t", "2",
                                 workdir=tmp_path) for _ in range(2)]
    try:
        for job in jobs:
            slurm_cluster.wait_for(job, {"RUNNING"}, timeout=30)
        files = [tmp_path / f"gpus-{job}" for job in jobs]
        for _ in range(100):
            if all(f.exists() and f.read_text() for f in files):
                break
            subprocess.run(["sleep", "0.1"], check=True)
        gpus = [f.read_text() for f in files]
        assert sorted(gpus) == ["0", "1"], gpus
    finally:
        release.touch()
        for job in jobs:
            slurm_cluster.wait_done(job)


def test_up_down_lifecycle_leaves_no_daemon(tmp_path: Path, bare_host_script: BareHost) -> None:
    """A second, private cluster: idempotent up, status/env, and down by PID."""
    bare_host, exports = bare_host_script.run, bare_host_script.exports
    if os.geteuid() != 0:
        pytest.skip("bare-host up needs root")
    env = bare_host_script.private_env(tmp_path)
    up = bare_host("up", "--no-hooks", env=env)
    assert up.returncode == 0, up.stderr
    try:
        again = bare_host("up", "--no-hooks", env=env)
        assert again.returncode == 0 and "already up" in again.stdout
        status = json.loads(bare_host("status", "--json", env=env).stdout)
        assert status["up"] and status["nodes"] == {"n1": "idle", "n2": "idle"}
        pids = [d["pid"] for d in status["daemons"]]
        variables = exports(bare_host("env", env=env).stdout)
        assert variables["SLURM_CONF"] == str(tmp_path / "cluster" / "etc" / "slurm.conf")
        ping = subprocess.run(["scontrol", "ping"], env=os.environ | variables,
                              capture_output=True, text=True, timeout=30)
        assert "is UP" in ping.stdout
    finally:
        down = bare_host("down", env=env)
    assert down.returncode == 0, down.stderr
    for pid in pids:
        stat = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                              text=True).stdout.strip()
        assert stat in {"", "Z"} or stat.startswith("Z"), (pid, stat)
    assert bare_host("status", env=env).returncode == 3


def test_usage_errors_exit_2(bare_host_script: BareHost) -> None:
    out = subprocess.run([str(bare_host_script.path), "sideways"], capture_output=True, text=True)
    assert out.returncode == 2
