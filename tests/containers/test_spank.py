"""A job user's fibers in cgroups of their own on Slurm's cgroup/v2, through the SPANK plugin.

On every release's container cluster (Slurm's cgroup/v2, ConstrainDevices, the plugin
slurm_fiber_cgroup loaded from /etc/slurm/plugstack.conf), sfalice's job holds the node's
second GPU (sfmallory's job holds the first) and runs fiberd as a step: the plugin hands
that step's task cgroup to sfalice, and fiberd carves a cgroup per fiber below it. The
tests read what the kernel says: the fibers' /proc/self/cgroup, the owners of the
delegated files, what a fiber gets when it moves itself out of the subtree or raises a
limit set above it, what opening the GPUs gives (another job's: EPERM from Slurm's device
program; its own: ENXIO, no driver), which escaped children survive `fiberctl stop` and
the job's end, and which cgroup directories are left on the node after jobs that carve,
fail and are cancelled.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.containers.conftest import ContainerCluster

USER, OTHER = "sfalice", "sfmallory"
SCOPE = "/sys/fs/cgroup/system.slice/n1_slurmstepd.scope"
GPU_VARS = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL",
            "ZE_AFFINITY_MASK")
FINISHED_WITHIN_S = 5.0  # the must-show: nothing of the job left 5 s after it ended

# Run in a fiber: its cgroup, the GPU variables, what opening each path given gives.
PROBE = """import errno, json, os, sys, time
def opened(path):
    try:
        os.close(os.open(path, os.O_RDONLY))
        return "ok"
    except OSError as err:
        return errno.errorcode[err.errno]
cgroup = [l[3:] for l in open("/proc/self/cgroup").read().splitlines() if l.startswith("0::")]
print(json.dumps({"cgroup": cgroup[0], "fiber": os.environ.get("SLURM_FIBER_ID"),
                  "env": {k: os.environ.get(k) for k in sys.argv[1].split(",")},
                  "open": {p: opened(p) for p in sys.argv[2:]}}), flush=True)
time.sleep(3)  # the three fibers run at once
"""
# Run in a fiber: the moves and writes a job user must not be able to make, each one's
# errno ("ok" had it worked), and the owners of the delegated task cgroup's files.
ATTEMPTS = """import errno, json, os, sys
cg = [l[3:] for l in open("/proc/self/cgroup").read().splitlines() if l.startswith("0::")][0]
parts = cg.split("/")
task = "/sys/fs/cgroup" + "/".join(parts[:next(i for i, p in enumerate(parts)
                                              if p.startswith("task_")) + 1])
job = os.path.dirname(os.path.dirname(os.path.dirname(task)))
scope = os.path.dirname(job)
other = [d for d in sorted(os.listdir(scope)) if os.path.join(scope, d) != job
         and os.path.isdir(os.path.join(scope, d, "step_batch"))]
def attempt(path, value):
    try:
        with open(path, "w") as f:
            f.write(value)
        return "ok"
    except OSError as err:
        return errno.errorcode[err.errno]
me = str(os.getpid())
out = {"task": task, "moves": {
    "out of the subtree (step's user cgroup)": attempt(os.path.dirname(task) + "/cgroup.procs", me),
    "into the job's cgroup": attempt(job + "/cgroup.procs", me),
    "into another step (step_batch)": attempt(job + "/step_batch/user/task_0/cgroup.procs", me),
    "into another job": attempt(os.path.join(scope, other[0], "step_batch/user/task_0",
                                             "cgroup.procs"), me) if other else "no other job",
    "raise cgroup.max.descendants above it": attempt(task + "/cgroup.max.descendants", "max"),
    "raise cgroup.max.depth above it": attempt(task + "/cgroup.max.depth", "max"),
}, "owners": {name: os.stat(os.path.join(task, name)).st_uid for name in (
    ".", "cgroup.procs", "cgroup.threads", "cgroup.subtree_control", "cgroup.max.depth",
    "cgroup.max.descendants", "cgroup.type", "cgroup.freeze", "cgroup.kill")},
    "caps": {name: open(os.path.join(task, name)).read().strip()
             for name in ("cgroup.max.depth", "cgroup.max.descendants")},
    "cgroup": cg}
print(json.dumps(out), flush=True)
"""
START = """srun --overlap -n1 fiberd-run > "fiberd-$SLURM_JOB_ID.log" 2>&1 &
i=0
until fiberctl status --json > status.json 2>/dev/null && grep -q '"ready": true' status.json; do
  i=$((i+1)); [ $i -gt 600 ] && { echo "fiberd not ready"; exit 1; }; sleep 0.1
done
"""
JOB = """#!/bin/sh
#SBATCH -n1 -w n1 --gres=gpu:1
""" + START + """echo "job $SLURM_JOB_ID ${SLURM_JOB_SLUID:-}"
srun --overlap -n1 python -c 'import json, os; print("step " + json.dumps({k: os.environ.get(k)
    for k in "VARS".split(",")}))'
pids=""
for n in 1 2 3; do
  fiberctl run -- python probe.py VARS /dev/fake-gpu/nvidia0 /dev/fake-gpu/nvidia1 > fiber-$n &
  pids="$pids $!"
done
wait $pids
fiberctl run -- python attempts.py > attempts
# Escaped children: `fiberctl stop` ends them with their fiber...
fiberctl run -- sh -c 'echo $SLURM_FIBER_ID > stop-id
  setsid sleep 600 & (sleep 601 &); sleep 602' &
until [ -s stop-id ]; do sleep 0.1; done; sleep 0.5
pgrep -u "$(id -u)" -f '^sleep 60[012]$' | wc -l | sed 's/^/before-stop /'
fiberctl stop --grace 1 "$(cat stop-id)" > /dev/null
pgrep -u "$(id -u)" -f '^sleep 60[012]$' | wc -l | sed 's/^/after-stop /'
# ... and the job's end ends those of a fiber still running then, which fiberd itself stops
# (SIGTERM: the fiber says so) before Slurm's SIGKILL, though Slurm's SIGTERM misses fiberd.
fiberctl run -- sh -c 'trap "echo TERM > got-term; exit" TERM; trap "echo HUP > got-term; exit" HUP
  echo $SLURM_FIBER_ID > end-id
  setsid sleep 700 & (sleep 701 &); while :; do sleep 0.1; done' &
until [ -s end-id ]; do sleep 0.1; done; sleep 0.5
pgrep -u "$(id -u)" -f '^sleep 70[01]$' | wc -l | sed 's/^/at-end /'
""".replace("VARS", ",".join(GPU_VARS))


def job_dirs(cluster: ContainerCluster) -> list[str]:
    """Every cgroup directory below n1's slurmstepd scope but slurmd's and system's."""
    out = cluster.run("n1", "sh", "-c", f"cd {SCOPE} && find . -mindepth 1 -type d")
    return sorted(d for d in out.stdout.split()
                  if d.split("/")[1] not in ("slurmd", "system"))


def submit(cluster: ContainerCluster, user: str, work: str, script: str,
           *args: str) -> str:
    sub = cluster.run("n1", "sbatch", "--parsable", f"--chdir={work}", f"--output={work}/out",
                      *args, f"{work}/job.sh", user=user)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0]


def workdir(cluster: ContainerCluster, user: str, name: str, files: dict[str, str]) -> str:
    work = f"/tmp/{name}-{cluster.release}"
    made = cluster.run("n1", "sh", "-c", f"rm -rf {work} && mkdir {work}", user=user)
    assert made.returncode == 0, made.stderr
    for file, text in files.items():
        wrote = cluster.run("n1", "sh", "-c", f"cat > {work}/{file}", user=user, stdin=text)
        assert wrote.returncode == 0, wrote.stderr
    return work


def wait_running(cluster: ContainerCluster, job_id: str) -> None:
    for _ in range(600):
        state = cluster.run("slurmctld", "squeue", "-h", "-j", job_id, "-o", "%T").stdout
        if state.strip() == "RUNNING":
            return
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} not RUNNING: {state}")


@pytest.fixture
def blocker(container_cluster: ContainerCluster):
    """sfmallory's job holding n1's first GPU (index 0), so sfalice's gets the second."""
    work = workdir(container_cluster, OTHER, "blocker", {"job.sh": "#!/bin/sh\nsleep 300\n"})
    job_id = submit(container_cluster, OTHER, work, "", "-w", "n1", "--gres=gpu:1")
    wait_running(container_cluster, job_id)
    yield job_id
    container_cluster.run("slurmctld", "scancel", job_id)
    container_cluster.wait_finished(job_id)


def test_a_users_fibers_carve_below_the_delegated_task_cgroup(
        container_cluster: ContainerCluster, blocker: str) -> None:
    cluster = container_cluster
    before = job_dirs(cluster)
    work = workdir(cluster, USER, "spank-job", {"job.sh": JOB, "probe.py": PROBE,
                                                "attempts.py": ATTEMPTS})
    job_id = submit(cluster, USER, work, JOB)
    state = cluster.wait_finished(job_id, within=180)
    ended = time.monotonic()
    read = {name: cluster.run("n1", "cat", f"{work}/{name}").stdout
            for name in ("out", "fiber-1", "fiber-2", "fiber-3", "attempts", "status.json")}
    log = cluster.run("n1", "sh", "-c", f"cat {work}/fiberd-*.log").stdout
    shown = json.dumps(read, indent=1) + log[-3000:]
    assert state == "COMPLETED", shown
    lines = dict(line.split(" ", 1) for line in read["out"].splitlines() if " " in line)
    _, _, sluid = lines["job"].partition(" ")
    job_dir = sluid if cluster.release >= "26.05" else f"job_{job_id}"
    task = f"{SCOPE}/{job_dir}/step_0/user/task_0".removeprefix("/sys/fs/cgroup")
    status = json.loads(read["status.json"])["status"]
    cgroups = status["cgroups"]
    assert cgroups["carved"] and cgroups["root"] == f"/sys/fs/cgroup{task}", cgroups
    # This host's cgroup2 offers no controllers: status says no v2 limit is enforced.
    host = status["enforcement"]["host"]
    for name in ("memory", "pids", "cpu"):
        assert name in host["unenforced"] and host["limits"][name]["enforced_by"] is None, host
        assert "controller is not available" in host["limits"][name]["not_enforced"], host

    # Three concurrent fibers, three distinct cgroups below the job's (fiberd's step's task).
    fibers = [json.loads(read[f"fiber-{n}"]) for n in (1, 2, 3)]
    cgroup_paths = {f["cgroup"] for f in fibers}
    assert len(cgroup_paths) == 3, fibers
    assert all(p.startswith(task + "/") for p in cgroup_paths), (task, cgroup_paths)

    # The GPU variables equal what Slurm gives the job's steps (renumbered from 0), though
    # the job holds the node's GPU 1; the other job's GPU opens with EPERM, its own reaches
    # the (absent) driver.
    step_env = json.loads(lines["step"])
    assert step_env["CUDA_VISIBLE_DEVICES"] == "0", step_env
    for fiber in fibers:
        assert fiber["env"] == step_env, (fiber, step_env)
        assert fiber["open"] == {"/dev/fake-gpu/nvidia0": "EPERM",
                                 "/dev/fake-gpu/nvidia1": "ENXIO"}, fiber

    # What the plugin handed over, and what a job user still cannot do.
    attempts = json.loads(read["attempts"])
    uid = int(cluster.run("n1", "id", "-u", USER).stdout)
    assert attempts["owners"] == {".": uid, "cgroup.procs": uid, "cgroup.threads": uid,
                                  "cgroup.subtree_control": uid, "cgroup.max.depth": 0,
                                  "cgroup.max.descendants": 0, "cgroup.type": 0,
                                  "cgroup.freeze": 0, "cgroup.kill": 0}, attempts
    assert attempts["caps"] == {"cgroup.max.depth": "8", "cgroup.max.descendants": "16384"}
    assert set(attempts["moves"].values()) == {"EACCES"}, attempts["moves"]
    print(f"\nSlurm {cluster.release}, job {job_id} ({job_dir}) of {USER} on GPU 1: "
          f"fibers in {sorted(cgroup_paths)}; step {step_env}; fibers {fibers[0]['env']}; "
          f"attempts {json.dumps(attempts['moves'])}")

    # Escaped children (setsid, double fork) end with their fiber and with the job.
    assert lines["before-stop"] == "3" and lines["after-stop"] == "0", lines
    assert lines["at-end"] == "2", lines
    # SIGTERM from fiberd's stop at the job's end, or SIGHUP from fiberd when its client
    # (fiberctl, in the batch step) was killed: fiberd's either way, not Slurm's SIGKILL.
    assert cluster.run("n1", "cat", f"{work}/got-term").stdout in ("TERM\n", "HUP\n"), \
        "fiberd did not stop the fiber at the job's end (Slurm's SIGKILL did)"
    def left_of_job() -> list[str]:  # the blocker's own come and go meanwhile
        return [d for d in job_dirs(cluster) if d not in before and d.split("/")[1] == job_dir]

    deadline = ended + FINISHED_WITHIN_S
    while time.monotonic() < deadline and left_of_job():
        time.sleep(0.2)
    left = cluster.run("n1", "pgrep", "-u", USER, "-f", "^sleep 70[01]$").stdout.split()
    assert left == [], f"escaped children of a fiber outlived job {job_id}: {left}"
    assert left_of_job() == [], f"cgroups of job {job_id} left: {left_of_job()}"


# A job that carves, leaves a fiber running with an escaped child, then ends its own way.
FAILS = ("#!/bin/sh\n#SBATCH -n1 -w n1\n" + START
         + "fiberctl run -- sh -c 'setsid sleep 800 & sleep 801' &\nsleep 1\n")


@pytest.mark.parametrize("how", ["fails", "cancelled", "times out"])
def test_nothing_is_left_after_a_job_that_carved(container_cluster: ContainerCluster,
                                                 how: str) -> None:
    """A job that carved and failed (exit 1), was cancelled or ran out of time leaves no cgroup
    directory on the node and no process of its fibers, 5 s after it ended."""
    cluster = container_cluster
    before = job_dirs(cluster)
    script = FAILS + ("exit 1\n" if how == "fails" else "sleep 300\n")
    work = workdir(cluster, USER, f"spank-{how.replace(' ', '-')}", {"job.sh": script})
    job_id = submit(cluster, USER, work, script, *(["-t", "1"] if how == "times out" else []))
    if how == "cancelled":
        for _ in range(600):
            if cluster.run("n1", "pgrep", "-u", USER, "-f", "^sleep 801$").stdout.strip():
                break
            time.sleep(0.1)
        cluster.run("slurmctld", "scancel", job_id)
    state = cluster.wait_finished(job_id, within=180)
    ended = time.monotonic()
    assert state == {"fails": "FAILED", "cancelled": "CANCELLED", "times out": "TIMEOUT"}[how]
    status = cluster.run("n1", "cat", f"{work}/status.json").stdout
    carved = json.loads(status)["status"]["cgroups"]["carved"]
    deadline = ended + FINISHED_WITHIN_S
    while time.monotonic() < deadline and job_dirs(cluster) != before:
        time.sleep(0.2)
    log = cluster.run("n1", "sh", "-c", f"cat {work}/out {work}/fiberd-*.log").stdout
    assert carved and job_dirs(cluster) == before, (job_dirs(cluster), log[-2000:])
    left = cluster.run("n1", "pgrep", "-u", USER, "-f", "^sleep 80[01]$").stdout.split()
    assert left == [], left
