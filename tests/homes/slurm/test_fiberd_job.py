"""A job's own fiberd on the real cluster: `srun --overlap fiberd-run &`, then fiberctl.

Each job is a batch script as a job author writes it (fiberjobkit.job_script);
the test reads what it recorded in the work dir. Every way a job ends (its
script exits, scancel, its time limit, fiberd SIGKILLed with a fiber
running) must leave no process, cgroup, grant file, lease or state dir of
the job, and keep its audit log. Jobs run as a job user (sfalice) with the
cluster's site install; two jobs against each other run as two users
(sfalice, sfmallory), each in a work dir of its own. The waits are for the
cluster to act, polled every 0.1 s.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from slurm_fiber.client.fiberctl import EXIT_FINAL_MISS
from slurm_fiber.homes.slurm.paths import job_paths
from slurm_fiber.homes.slurm.siteconfig import SiteConfig, load_site_config
from tests.barehost.fiberjobkit import (
    FIBERCTL,
    KILL_FIBERD,
    alive,
    audit_events,
    ended,
    fiberd_pid,
    job_script,
    leftovers,
    settle,
    wait_file,
)

if TYPE_CHECKING:
    from tests.barehost.clusterkit import SlurmCluster
    from tests.security.userkit import JobUser

    WorkDir = Callable[[JobUser], Path]

pytestmark = pytest.mark.slurm
RUNS = 20

GPU_JOB = f"""printf %s "$SLURM_JOB_GPUS" > "gpus-$id"
for n in $(seq 1 {RUNS}); do
  {FIBERCTL} run -- sh -c 'echo "run $1 gpu=$CUDA_VISIBLE_DEVICES"; exit $(($1 % 4))' sh $n
  echo "rc $?"
done > "runs-$id.tmp" 2>&1
{FIBERCTL} call json:dumps '[[1]]' >> "runs-$id.tmp" 2>&1; echo "rc $?" >> "runs-$id.tmp"
{FIBERCTL} call json:loads '["{{"]' >> "runs-$id.tmp" 2>&1; echo "rc $?" >> "runs-$id.tmp"
mv "runs-$id.tmp" "runs-$id"
"""

# A fiber that outlives the script unless something stops it; its record from `fiberctl ls`.
LONG_FIBER = f"""{FIBERCTL} run -- sleep 300 &
until {FIBERCTL} ls --json > "ls-$id.tmp" 2>/dev/null && grep -q '"running"' "ls-$id.tmp"; do
  sleep 0.1
done
mv "ls-$id.tmp" "ls-$id.json"
"""

# Job A or B of a pair: its GPU as a fiber sees it and as the job's own step sees it, its
# token copied out, then (when the test names a token file in present-<id>) that token
# presented in this job.
PAIR_JOB = f"""{FIBERCTL} run -- sh -c 'echo $CUDA_VISIBLE_DEVICES $SLURM_JOB_GPUS' > "cvd-$id.tmp"
srun --overlap -n1 sh -c 'echo $CUDA_VISIBLE_DEVICES' >> "cvd-$id.tmp"
mv "cvd-$id.tmp" "cvd-$id"
cp "{{state}}/nodes/$SLURMD_NODENAME/jobs/$id/grants/job-$id.jwt" "token-$id"
i=0; while [ ! -f "present-$id" ] && [ ! -f "release-$id" ] && [ $i -lt 600 ]; do
  sleep 0.1; i=$((i+1)); done
if [ -f "present-$id" ]; then
  {FIBERCTL} run --token "$(cat "present-$id")" -- true 2> "miss-$id.tmp"
  echo $? > "misscode-$id.tmp"; mv "miss-$id.tmp" "miss-$id"; mv "misscode-$id.tmp" "misscode-$id"
fi
"""


def site_of(cluster: SlurmCluster) -> SiteConfig:
    assert cluster.site_config is not None, "the cluster is up without hooks: bare-host down"
    return load_site_config({"SLURM_FIBER_CONFIG": str(cluster.site_config)})


def clean_after(cluster: SlurmCluster, node: str, job_id: int, pids: list[int],
                uid: int | None = None) -> None:
    """Wait (bounded) until nothing of the job remains on ``node`` (``uid``: nor its Slurm
    cgroup v1 groups)."""
    site = site_of(cluster)
    settle(lambda: leftovers(site, cluster.env["SLURM_CONF"], "citest", node, job_id, pids,
                             uid), f"job {job_id} left something behind")


def events_of(cluster: SlurmCluster, node: str, job_id: int) -> list[str]:
    return [str(record["event"]) for record in audit_events(site_of(cluster), node, job_id)]


def fiber_pids(work: Path, job_id: int) -> list[int]:
    return [int(f["pid"]) for f in json.loads(wait_file(work / f"ls-{job_id}.json"))]


def test_a_gpu_job_runs_fibers_and_a_call_through_its_fiberd(
        slurm_cluster: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    work = job_dir(job_user)
    job = slurm_cluster.submit(job_script(slurm_cluster, work, GPU_JOB), "-w", "n1",
                               "--gres=gpu:1", "-t", "2", workdir=work, user=job_user)
    lines = wait_file(work / f"runs-{job}", timeout=120).splitlines()
    pid = fiberd_pid(work, job)
    gpu = (work / f"gpus-{job}").read_text()
    assert gpu in {"0", "1"}
    expected = [line for n in range(1, RUNS + 1) for line in (f"run {n} gpu={gpu}", f"rc {n % 4}")]
    assert lines[:2 * RUNS] == expected
    assert lines[2 * RUNS:2 * RUNS + 2] == ['"[1]"', "rc 0"]
    assert lines[-2].startswith("JSONDecodeError: ") and lines[-1] == "rc 1", lines[-2:]
    assert ended(slurm_cluster, job) == "COMPLETED"
    clean_after(slurm_cluster, "n1", job, [pid], job_user.uid)
    events = events_of(slurm_cluster, "n1", job)
    assert events[:2] == ["start", "admit"] and events[-1] == "stop", events
    assert events.count("clone") == RUNS + 2 and events.count("fiber_exit") == RUNS + 2


def test_two_jobs_on_a_node_get_different_gpus_and_refuse_each_others_token(
        slurm_cluster: SlurmCluster, job_user: JobUser, other_user: JobUser,
        job_dir: WorkDir) -> None:
    site = site_of(slurm_cluster)
    works = {user.name: job_dir(user) for user in (job_user, other_user)}
    a, b = (slurm_cluster.submit(
        job_script(slurm_cluster, works[user.name], PAIR_JOB.format(state=site.state_root)),
        "-w", "n1", "--gres=gpu:1", "-t", "2", workdir=works[user.name], user=user)
        for user in (job_user, other_user))
    work_of = {a: works[job_user.name], b: works[other_user.name]}
    try:
        # The jobs hold different GPUs of the node (SLURM_JOB_GPUS, the node's index), and
        # each fiber sees its GPU as the job's steps see it (Slurm renumbers it from 0
        # where it constrains devices).
        seen = [wait_file(work_of[job] / f"cvd-{job}", timeout=120).split() for job in (a, b)]
        assert sorted(job_gpus for _, job_gpus, _ in seen) == ["0", "1"], seen
        assert all(cvd == step_cvd for cvd, _, step_cvd in seen), seen
        wait_file(work_of[a] / f"token-{a}")
        # The other user got hold of job A's token (the test hands it over).
        stolen = work_of[b] / f"stolen-{a}"
        shutil.copyfile(work_of[a] / f"token-{a}", stolen)
        os.chown(stolen, other_user.uid, other_user.gid)
        (work_of[b] / f"present-{b}").write_text(str(stolen))
        code = int(wait_file(work_of[b] / f"misscode-{b}"))
        said = (work_of[b] / f"miss-{b}").read_text().strip()
        assert code == EXIT_FINAL_MISS, (code, said)
        assert said.startswith("invalid_token: ") and f"slurm:citest:{a}" in said, said
    finally:
        for job in (a, b):
            (work_of[job] / f"release-{job}").touch()
    for job in (a, b):
        assert ended(slurm_cluster, job) == "COMPLETED"
        clean_after(slurm_cluster, "n1", job, [])
    misses = [r for r in audit_events(site, "n1", b) if r["event"] == "miss"]
    assert [(r.get("code"), r.get("detail")) for r in misses] == [
        ("invalid_token", "wrong_audience")], misses


def test_scancel_with_a_fiber_running_leaves_nothing(
        slurm_cluster: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    work = job_dir(job_user)
    job = slurm_cluster.submit(job_script(slurm_cluster, work, LONG_FIBER, hold=True),
                               "-w", "n2", "--gres=gpu:1", "-t", "2", workdir=work,
                               user=job_user)
    pids = [fiberd_pid(work, job), *fiber_pids(work, job)]
    assert slurm_cluster.run("scancel", str(job)).returncode == 0
    assert ended(slurm_cluster, job) == "CANCELLED"
    clean_after(slurm_cluster, "n2", job, pids, job_user.uid)
    events = events_of(slurm_cluster, "n2", job)
    assert {"admit", "clone"} <= set(events), events


def test_fiberd_killed_with_a_fiber_running_leaves_nothing(
        slurm_cluster: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    """fiberd-run's python gets SIGKILL while a fiber runs; the script then ends: the epilog
    must stop the orphaned template and fiber and release what fiberd held."""
    body = LONG_FIBER + KILL_FIBERD + """sleep 0.5
for p in $(grep -o '"pid": [0-9]*' "ls-$id.json" | cut -d' ' -f2); do
  kill -0 "$p" 2>/dev/null && echo "$p"
done > "survivors-$id"
mv "ls-$id.json" "killed-$id.json"
"""
    work = job_dir(job_user)
    job = slurm_cluster.submit(job_script(slurm_cluster, work, body), "-w", "n2",
                               "--gres=gpu:1", "-t", "2", workdir=work, user=job_user)
    fibers = [int(f["pid"]) for f in json.loads(wait_file(work / f"killed-{job}.json"))]
    pid = fiberd_pid(work, job)
    assert not alive(pid)
    survivors = (work / f"survivors-{job}").read_text().split()
    assert survivors == [str(p) for p in fibers], "the fiber did not outlive its fiberd"
    slurm_cluster.wait_done(job)
    clean_after(slurm_cluster, "n2", job, [pid, *fibers], job_user.uid)
    events = events_of(slurm_cluster, "n2", job)
    assert {"admit", "clone"} <= set(events) and "stop" not in events, events


def test_a_time_limit_with_a_fiber_running_leaves_nothing(
        slurm_cluster: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    """The slow one: Slurm checks limits every 30 s or so, so `-t 1` ends the job at 60-90 s."""
    work = job_dir(job_user)
    job = slurm_cluster.submit(job_script(slurm_cluster, work, LONG_FIBER, hold=True),
                               "-w", "n1", "--gres=gpu:1", "-t", "1", workdir=work,
                               user=job_user)
    pids = [fiberd_pid(work, job), *fiber_pids(work, job)]
    assert job_paths(site_of(slurm_cluster).state_root, "n1", job).socket.exists()
    assert ended(slurm_cluster, job, timeout=150) == "TIMEOUT"
    clean_after(slurm_cluster, "n1", job, pids, job_user.uid)
    events = events_of(slurm_cluster, "n1", job)
    assert {"admit", "clone", "stop"} <= set(events), events
