"""Slurm's own confinement with a job's fiberd below it (cgroup/v1, proctrack/cgroup,
task/cgroup, ConstrainDevices, ConstrainRAMSpace on the bare-host cluster).

Each job starts its own fiberd as a job user (fiberjobkit.job_script) and runs
fibers that report what the kernel says: which cgroups they are in, and what
opening the node's fake GPUs gives. A fake GPU is a character device of an
absent driver (195:N): where the device cgroup allows it, open() reaches the
driver and fails with ENXIO; where the cgroup denies it, open() fails with
EPERM before that. A cluster brought up with ``--slurm-cgroup none`` has no
Slurm confinement: these tests skip there, saying so.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from slurm_fiber.homes.slurm.cgroup_v1 import job_groups, read_cgroup_conf
from tests.barehost.fiberjobkit import (
    FIBERCTL,
    KILL_FIBERD,
    ended,
    fiberd_pid,
    job_script,
    wait_file,
)

if TYPE_CHECKING:
    from tests.barehost.clusterkit import SlurmCluster
    from tests.security.userkit import JobUser

    WorkDir = Callable[[JobUser], Path]

pytestmark = pytest.mark.slurm

# Run in a fiber: its cgroups, and what opening each path given gives (errno name or "ok").
PROBE = """import errno, json, os, sys
opened = {}
for path in sys.argv[1:]:
    try:
        os.close(os.open(path, os.O_RDONLY))
        opened[path] = "ok"
    except OSError as err:
        opened[path] = errno.errorcode[err.errno]
groups = dict(line.split(":", 2)[1:] for line in open("/proc/self/cgroup").read().splitlines())
print(json.dumps({"cgroups": groups, "open": opened}))
"""
CONFINED = ("freezer", "memory", "devices")


@pytest.fixture
def confined(slurm_cluster: SlurmCluster) -> SlurmCluster:
    """The cluster, when Slurm runs its cgroup/v1 plugin there (bare-host's default)."""
    conf = read_cgroup_conf(Path(slurm_cluster.env["SLURM_CONF"]))
    if conf.get("cgroupplugin") != "cgroup/v1":
        pytest.skip("the cluster runs without Slurm's cgroup plugins (--slurm-cgroup none)")
    return slurm_cluster


def probe_job(cluster: SlurmCluster, work: Path, *paths: Path) -> str:
    """A job body: the job's GPUs into gpus-<id>, then a fiber's PROBE of ``paths``."""
    (work / "probe.py").write_text(PROBE)
    (work / "probe.py").chmod(0o644)
    args = " ".join(f'"{p}"' for p in paths)
    return f"""printf %s "$SLURM_JOB_GPUS" > "gpus-$id"
{FIBERCTL} run -- /usr/bin/python3 "{work}/probe.py" {args} > "probe-$id.tmp" 2>&1
mv "probe-$id.tmp" "probe-$id"
"""


def gpu_nodes(cluster: SlurmCluster, node: str) -> list[Path]:
    return sorted((cluster.run_dir / "dev" / node).glob("nvidia*"))


def test_a_jobs_fiber_cannot_open_another_jobs_gpu(
        confined: SlurmCluster, job_user: JobUser, other_user: JobUser,
        job_dir: WorkDir) -> None:
    """Two jobs on n1, one GPU each, held together: each job's fiber opens its own GPU
    (ENXIO: the device cgroup let it through to the absent driver) and is refused the other
    job's (EPERM: Slurm's device cgroup of the job, above fiberd's groups)."""
    devices = gpu_nodes(confined, "n1")
    assert len(devices) == 2, devices
    works = {user.name: job_dir(user) for user in (job_user, other_user)}
    jobs = {confined.submit(job_script(confined, works[user.name],
                                       probe_job(confined, works[user.name], *devices),
                                       hold=True),
                            "-w", "n1", "--gres=gpu:1", "-t", "2",
                            workdir=works[user.name], user=user): works[user.name]
            for user in (job_user, other_user)}
    try:
        seen = {job: (int(wait_file(work / f"gpus-{job}")),
                      json.loads(wait_file(work / f"probe-{job}", timeout=120)))
                for job, work in jobs.items()}
    finally:
        for job, work in jobs.items():
            (work / f"release-{job}").touch()
    assert sorted(gpu for gpu, _ in seen.values()) == [0, 1], seen  # held at the same time
    for gpu, probe in seen.values():
        assert probe["open"] == {str(device): "ENXIO" if i == gpu else "EPERM"
                                 for i, device in enumerate(devices)}, probe
    for job in jobs:
        assert ended(confined, job) == "COMPLETED"


def test_a_jobs_fibers_sit_below_its_slurm_cgroups(
        confined: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    """In every hierarchy Slurm confines with, the fiber's group is below the job's step
    group: <slurm_n2>/uid_<uid>/job_<id>/step_<n>[/task_<k>]/slurm-fiber.<fiberd pid>/..."""
    work = job_dir(job_user)
    job = confined.submit(job_script(confined, work, probe_job(confined, work)), "-w", "n2",
                          "-t", "2", workdir=work, user=job_user)
    probe = json.loads(wait_file(work / f"probe-{job}", timeout=120))
    pid = fiberd_pid(work, job)
    assert ended(confined, job) == "COMPLETED"
    job_part = f"/slurm_n2/uid_{job_user.uid}/job_{job}/step_"
    for controller in CONFINED:
        group = probe["cgroups"][controller]
        _, _, below = group.partition(job_part)
        assert below, (controller, group)
        step_path = below.split(f"/slurm-fiber.{pid}/", 1)
        assert len(step_path) == 2 and step_path[1].startswith("grant-"), (controller, group)


def test_the_jobs_memory_limit_applies_to_its_fibers(
        confined: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    """The grant sets no memory limit; the job has --mem=256M (Slurm's memory cgroup of the
    job). A fiber that fills 512 MiB is OOM-killed by the kernel, and fiberd, the
    template and the job live on: a second fiber runs."""
    work = job_dir(job_user)
    body = f"""{FIBERCTL} run -- /usr/bin/python3 -c "b = b'x' * (512 << 20)" > "oom-$id.tmp" 2>&1
echo "rc $?" >> "oom-$id.tmp"
{FIBERCTL} run -- echo alive >> "oom-$id.tmp" 2>&1
mv "oom-$id.tmp" "oom-$id"
"""
    job = confined.submit(job_script(confined, work, body), "-w", "n1", "--mem=256M",
                          "-t", "2", workdir=work, user=job_user)
    lines = wait_file(work / f"oom-{job}", timeout=120).splitlines()
    assert ended(confined, job) == "COMPLETED"
    assert lines[-1] == "alive", lines
    said = "\n".join(lines[:-1])
    assert "out of memory: the kernel's OOM killer killed it" in said, said
    assert lines[-2] == "rc 137", lines  # 128 + SIGKILL


def test_a_confined_jobs_epilog_finishes_and_the_node_stays_in_service(
        confined: SlurmCluster, job_user: JobUser, job_dir: WorkDir) -> None:
    """A job user's fiberd carved below Slurm's v1 groups and was SIGKILLed, so its groups
    are left and Slurm cannot remove the job's: the epilog's processes step goes through
    them (devices and memory have no cgroup.kill) and finishes, so the node is not drained
    (a step that fails drains it), and the job's groups are gone."""
    work = job_dir(job_user)
    job = confined.submit(job_script(confined, work, KILL_FIBERD), "-w", "n2", "-t", "2",
                          workdir=work, user=job_user)
    assert ended(confined, job) == "COMPLETED"  # after the epilog: COMPLETING until it ends
    state = confined.run("sinfo", "-h", "-n", "n2", "-o", "%T").stdout.strip()
    assert "drain" not in state, state
    assert job_groups(confined.env["SLURM_CONF"], "n2", job_user.uid, job) == []


# Run in a fiber: its v1 groups, the GPU variables, what opening each path gives; then a
# pause so three such fibers run at once.
CONCURRENT = """import errno, json, os, sys, time
def opened(path):
    try:
        os.close(os.open(path, os.O_RDONLY))
        return "ok"
    except OSError as err:
        return errno.errorcode[err.errno]
groups = dict(line.split(":", 2)[1:] for line in open("/proc/self/cgroup").read().splitlines())
gpu = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "ZE_AFFINITY_MASK")
print(json.dumps({"cgroups": groups, "env": {k: os.environ.get(k) for k in gpu},
                  "open": {p: opened(p) for p in sys.argv[1:]}}), flush=True)
time.sleep(3)
"""
STEP_ENV = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in ('CUDA_VISIBLE_"
            "DEVICES', 'ROCR_VISIBLE_DEVICES', 'GPU_DEVICE_ORDINAL', 'ZE_AFFINITY_MASK')}))")


def v1_dirs(cluster: SlurmCluster) -> list[str]:
    """Every group directory in the cluster's v1 hierarchies (CgroupMountpoint)."""
    base = cluster.run_dir / "cgroup"
    return sorted(str(p.relative_to(base)) for p in base.glob("*/**/") if p.is_dir())


def test_a_users_job_on_the_second_gpu_carves_a_cgroup_per_fiber_and_leaves_none(
        confined: SlurmCluster, job_user: JobUser, other_user: JobUser,
        job_dir: WorkDir) -> None:
    """The must-show on cgroup v1: a job of a job user holding n1's second GPU (another
    user's job holds the first) runs three fibers at once, each in a group of its own below
    the job's step groups; their GPU variables are the job step's; the other job's GPU
    opens with EPERM; `fiberctl stop` and the job's end kill a fiber's escaped children
    (setsid, double fork); 5 s after the job no group of it is left."""
    devices = gpu_nodes(confined, "n1")
    blocker_work = job_dir(other_user)
    blocker = confined.submit("#!/bin/sh\nsleep 300\n", "-w", "n1", "--gres=gpu:1",
                              workdir=blocker_work, user=other_user)
    confined.wait_for(blocker, {"RUNNING"})
    before = v1_dirs(confined)
    work = job_dir(job_user)
    (work / "probe3.py").write_text(CONCURRENT)
    (work / "probe3.py").chmod(0o644)
    args = " ".join(f'"{d}"' for d in devices)
    body = f"""srun --overlap -n1 /usr/bin/python3 -c "{STEP_ENV}" > "step-$id"
pids=""
for n in 1 2 3; do
  {FIBERCTL} run -- /usr/bin/python3 "{work}/probe3.py" {args} > "fiber-$n-$id" 2>&1 &
  pids="$pids $!"
done
wait $pids
{FIBERCTL} run -- sh -c 'echo $SLURM_FIBER_ID > stop-id
  setsid sleep 600 & (sleep 601 &); sleep 602' &
until [ -s stop-id ]; do sleep 0.1; done; sleep 0.5
pgrep -u "$(id -u)" -f '^sleep 60[012]$' | wc -l > "before-stop-$id"
{FIBERCTL} stop --grace 1 "$(cat stop-id)" > /dev/null
pgrep -u "$(id -u)" -f '^sleep 60[012]$' | wc -l > "after-stop-$id"
{FIBERCTL} run -- sh -c 'echo $SLURM_FIBER_ID > end-id
  setsid sleep 700 & (sleep 701 &); sleep 702' &
until [ -s end-id ]; do sleep 0.1; done; sleep 0.5
pgrep -u "$(id -u)" -f '^sleep 70[012]$' | wc -l > "at-end-$id"
"""
    try:
        job = confined.submit(job_script(confined, work, body), "-w", "n1", "--gres=gpu:1",
                              "-t", "2", workdir=work, user=job_user)
        assert ended(confined, job, timeout=120) == "COMPLETED", \
            (work / f"slurm-{job}.out").read_text()
        finished = time.monotonic()
    finally:
        confined.run("scancel", str(blocker))
    step_env = json.loads((work / f"step-{job}").read_text())
    fibers = [json.loads((work / f"fiber-{n}-{job}").read_text()) for n in (1, 2, 3)]
    job_part = f"/slurm_n1/uid_{job_user.uid}/job_{job}/step_"
    for controller in CONFINED:
        groups = {f["cgroups"][controller] for f in fibers}
        assert len(groups) == 3 and all(job_part in g for g in groups), (controller, groups)
    for fiber in fibers:
        assert fiber["env"] == step_env, (fiber["env"], step_env)
        assert fiber["open"] == {str(devices[0]): "EPERM", str(devices[1]): "ENXIO"}, fiber
    counts = {name: (work / f"{name}-{job}").read_text().strip()
              for name in ("before-stop", "after-stop", "at-end")}
    assert counts == {"before-stop": "3", "after-stop": "0", "at-end": "3"}, counts
    print(f"\nbare-host (22.05, cgroup/v1) job {job} on GPU 1: step {step_env}, fibers "
          f"{fibers[0]['env']}; freezer groups {sorted(f['cgroups']['freezer'] for f in fibers)}")
    assert ended(confined, blocker) in ("CANCELLED", "COMPLETED")
    while time.monotonic() < finished + 5 and v1_dirs(confined) != before:
        time.sleep(0.2)
    left = [d for d in v1_dirs(confined) if d not in before]
    assert left == [], left
    escaped = confined.run("pgrep", "-u", job_user.name, "-f", "^sleep 70[012]$").stdout.split()
    assert escaped == [], escaped
