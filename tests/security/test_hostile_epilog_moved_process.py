"""Issue 38, low: a process leaves its job for the same user's other job on the node.

On the bare-host cluster (Slurm 22.05's cgroup/v1 plugins, which hand each step group
to the job user), sfalice holds job A and runs job B on the same node. B starts a
``sleep`` and moves it into a group it makes below A's step group (in every v1
hierarchy Slurm uses: the step group is hers), then ends.
Slurm sees nothing of it in B's groups. What the threat model promises (rule "the
epilog ends every process of the job"): B's epilog ends it all the same, because its
environment still names job B, while A runs on. What it does not promise, and says
why: the same process with the job's variables dropped from its environment stays in
A's limits until A ends (nothing root can read tells it from A's own).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.barehost.clusterkit import SlurmCluster
from tests.prolog.test_prolog_cluster import eventually
from tests.security.test_hostile_epilog_freezer import cgroup_mount, gone
from tests.security.userkit import JobUser

pytestmark = pytest.mark.slurm
NODE = "n1"

HOLD = """#!/bin/sh
touch "{work}/a-running"
i=0; while [ ! -f "{work}/release" ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done
"""

MOVE = """#!/bin/sh
sleep 300 &
pid=$!
for ctl in {controllers}; do
  g="{mount}/$ctl/slurm_$SLURMD_NODENAME/uid_$(id -u)/job_{holder}/step_batch/escape"
  mkdir "$g" && echo $pid > "$g/tasks"
done
in_a=$(grep -c "/job_{holder}/step_batch/escape$" /proc/$pid/cgroup)
echo $pid $in_a > "{work}/moved.tmp" && mv "{work}/moved.tmp" "{work}/moved"
"""


def test_hostile_epilog_moved_process_keeping_its_environment_dies_with_its_job(
        slurm_cluster: SlurmCluster, job_user: JobUser,
        job_dir: Callable[[JobUser], Path]) -> None:
    mount = cgroup_mount(slurm_cluster)
    controllers = sorted(p.name for p in mount.iterdir() if (p / f"slurm_{NODE}").is_dir())
    work = job_dir(job_user)
    holder = slurm_cluster.submit(HOLD.format(work=work), f"--nodelist={NODE}",
                                  workdir=work, user=job_user)
    pid = None
    try:
        eventually(lambda: (work / "a-running").exists(), f"job {holder} did not start")
        mover = slurm_cluster.submit(
            MOVE.format(work=work, mount=mount, holder=holder, controllers=" ".join(controllers)),
            f"--nodelist={NODE}", workdir=work, user=job_user)
        eventually(lambda: (work / "moved").exists(), f"job {mover} moved nothing")
        pid, in_holder = map(int, (work / "moved").read_text().split())
        assert in_holder == len(controllers), f"the sleep is in {in_holder} groups of A"
        slurm_cluster.wait_done(mover)
        eventually(lambda: gone(pid), f"pid {pid} of job {mover} outlived it in job {holder}")
        assert slurm_cluster.state(holder) == "RUNNING"
    finally:
        (work / "release").touch()
        slurm_cluster.wait_done(holder)
        if pid is not None and not gone(pid):
            os.kill(pid, 9)
