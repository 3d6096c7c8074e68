"""Issue 38, high: a job user froze a cgroup of their own job and drained the node.

On the bare-host cluster (Slurm's cgroup/v1 plugins, proctrack/cgroup), sfalice's
batch job makes a freezer group below its own step group (Slurm 22.05 hands the
step group to the job user), moves a ``sleep`` into it and freezes it. SIGKILL
from Slurm cannot end a frozen process, and before the fix neither could the
epilog's: it thawed only the job's own group, not the one the job froze, named
the survivor and exited 1, which drains the node. Now the epilog thaws every
freezer group of the job's tree after the kill: the process is gone, the job's
groups are removed and the node takes the next job.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.barehost.clusterkit import SlurmCluster
from tests.prolog.test_prolog_cluster import eventually
from tests.security.userkit import JobUser

pytestmark = pytest.mark.slurm
NODE = "n1"

FREEZE = """#!/bin/sh
step="{mount}/freezer/slurm_$SLURMD_NODENAME/uid_$(id -u)/job_$SLURM_JOB_ID/step_batch"
mkdir "$step/ice"
sleep 300 &
echo $! > "$step/ice/tasks"
echo FROZEN > "$step/ice/freezer.state"
echo $! > "{work}/frozen.tmp" && mv "{work}/frozen.tmp" "{work}/frozen"
"""


def cgroup_mount(cluster: SlurmCluster) -> Path:
    conf = (cluster.run_dir / "etc" / "cgroup.conf").read_text()
    if "CgroupPlugin=cgroup/v1" not in conf:
        pytest.skip("the cluster runs without Slurm's cgroup/v1 plugins (--slurm-cgroup none)")
    return Path(next(line.split("=", 1)[1] for line in conf.splitlines()
                     if line.startswith("CgroupMountpoint=")))


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] == b"Z"
    except FileNotFoundError:
        return True


def node_state(cluster: SlurmCluster) -> str:
    return cluster.run("sinfo", "-h", "-n", NODE, "-o", "%T").stdout.strip()


def test_hostile_epilog_freezer_a_frozen_group_never_drains_the_node(
        slurm_cluster: SlurmCluster, job_user: JobUser,
        job_dir: Callable[[JobUser], Path]) -> None:
    mount = cgroup_mount(slurm_cluster)
    work = job_dir(job_user)
    job = slurm_cluster.submit(FREEZE.format(mount=mount, work=work), f"--nodelist={NODE}",
                               workdir=work, user=job_user)
    eventually(lambda: (work / "frozen").exists(), f"job {job} froze nothing")
    pid = int((work / "frozen").read_text())
    group = mount / "freezer" / f"slurm_{NODE}" / f"uid_{job_user.uid}" / f"job_{job}"
    try:
        slurm_cluster.wait_done(job)
        eventually(lambda: gone(pid), f"the frozen pid {pid} of job {job} survived the epilog")
        eventually(lambda: not group.exists(), f"{group} is left")
        assert "drain" not in node_state(slurm_cluster), slurm_cluster.run(
            "sinfo", "-h", "-n", NODE, "-o", "%T %E").stdout
    finally:
        if not gone(pid):  # leave the cluster usable after a failure
            for ice in group.rglob("freezer.state"):
                ice.write_text("THAWED\n")
            os.kill(pid, 9)
        if "drain" in node_state(slurm_cluster):
            slurm_cluster.run("scontrol", "update", f"nodename={NODE}", "state=resume")
