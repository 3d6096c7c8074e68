"""The container cluster on each Slurm release: a user's GPU job running fibers, conform.

Brought up by `docker/slurm-cluster/cluster up --release R` (conftest.py). Every
container is on the host network: the engine has no network but host and none, and no
container is privileged.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import yaml

from tests.barehost.importtimekit import imported
from tests.conform.conformkit import SLURM_CLAUSES, outcomes
from tests.containers.conftest import CLUSTER, ContainerCluster

USER = "sfalice"
COMPOSE = CLUSTER.parent / "compose.yaml"
COMPOSE_V2 = CLUSTER.parent / "compose.cgroup-v2.yaml"  # `cluster up --slurm-cgroup v2`
# A job author's script (docs/slurm.md): the job's fiberd as a step, then fibers.
FIBER_JOB = """#!/bin/sh
#SBATCH --gres=gpu:1 -n1
srun --overlap -n1 fiberd-run > "fiberd-$SLURM_JOB_ID.log" 2>&1 &
i=0
until fiberctl status --json 2>/dev/null | grep -q '"ready": true'; do
  i=$((i+1)); [ $i -gt 600 ] && { echo "fiberd not ready"; exit 1; }; sleep 0.1
done
for n in 1 2 3; do
  fiberctl run -- sh -c 'echo "fiber $1 user=$(id -un) gpus=$CUDA_VISIBLE_DEVICES"' sh $n
done
"""


def test_no_network_but_host_and_none(container_cluster: ContainerCluster) -> None:
    names = container_cluster.docker("network", "ls", "--format", "{{.Name}}").stdout.split()
    assert sorted(names) == ["host", "none"]
    for service in ("slurmctld", "n1", "n2"):
        shown = container_cluster.docker(
            "inspect", "-f", "{{.HostConfig.NetworkMode}} {{.HostConfig.Privileged}}",
            f"slurm-fiber-{service}").stdout.split()
        assert shown == ["host", "false"], service


def test_the_release_runs_and_a_user_reaches_both_nodes(
        container_cluster: ContainerCluster) -> None:
    version = container_cluster.run("slurmctld", "scontrol", "-V").stdout
    assert version.split()[1].startswith(container_cluster.release + "."), version
    out = container_cluster.run("slurmctld", "srun", "-N2", "sh", "-c",
                                'echo "$SLURMD_NODENAME $(id -un)"', user=USER)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == [f"n1 {USER}", f"n2 {USER}"]


def test_the_site_venvs_fiberctl_imports_no_re(container_cluster: ContainerCluster) -> None:
    """The image installs as docs/slurm.md's site install does, pip >= 25.2 first, so the
    console script imports no re (with enum, functools and collections, about 8 ms of every
    fiberctl), whatever pip the release's venv brings. No fiberd at that socket: 69."""
    venv = "/opt/slurm-fiber/venv/bin"
    out = container_cluster.run("n1", f"{venv}/python", "-X", "importtime", f"{venv}/fiberctl",
                                "run", "-S", "/nonexistent", "--", "true", user=USER)
    assert out.returncode == 69, out.stderr
    modules = imported(out.stderr)
    assert "slurm_fiber.client.fiberctl" in modules and "re" not in modules, out.stderr


def test_a_users_gpu_job_runs_fibers(container_cluster: ContainerCluster) -> None:
    work = f"/tmp/fiber-job-{container_cluster.release}"
    made = container_cluster.run("n1", "sh", "-c", f"rm -rf {work} && mkdir {work} && "
                                 f"cat > {work}/job.sh", user=USER, stdin=FIBER_JOB)
    assert made.returncode == 0, made.stderr
    sub = container_cluster.run("n1", "sbatch", "--parsable", f"--chdir={work}",
                                f"--output={work}/out", f"{work}/job.sh", user=USER)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    state = container_cluster.wait_finished(job_id)
    out = container_cluster.run("n1", "cat", f"{work}/out").stdout
    log = container_cluster.run("n1", "sh", "-c", f"cat {work}/fiberd-*.log").stdout
    assert state == "COMPLETED", out + log
    lines = [line for line in out.splitlines() if line.startswith("fiber ")]
    assert len(lines) == 3, out + log
    for n, line in enumerate(lines, 1):
        fiber, user, gpus = line.split()[1:]
        assert (fiber, user) == (str(n), f"user={USER}")
        assert gpus in ("gpus=0", "gpus=1"), line
    assert "fiberd slurm listening" in log


# A job's fiberd (step 0) on n1 under Slurm's cgroup/v2, then one fiber reporting its cgroup.
CGROUP_JOB = """#!/bin/sh
#SBATCH -n1 -w n1
# A root job's fiberd runs its fibers as the account it names: root, said explicitly.
[ "$(id -u)" = 0 ] && export FIBERD_FIBER_USER=root
srun --overlap -n1 fiberd-run > "fiberd-$SLURM_JOB_ID.log" 2>&1 &
i=0
until fiberctl status --json > status.json 2>/dev/null && grep -q '"ready": true' status.json; do
  i=$((i+1)); [ $i -gt 600 ] && { echo "fiberd not ready"; exit 1; }; sleep 0.1
done
echo "job $SLURM_JOB_ID ${SLURM_JOB_SLUID:-}"
grep '^0::' /proc/self/cgroup | sed 's/^/batch /'
fiberctl run -- sh -c 'grep "^0::" /proc/self/cgroup | sed "s/^/fiber /"'
"""


def run_cgroup_job(cluster: ContainerCluster, user: str) -> tuple[dict[str, str], dict]:
    """CGROUP_JOB as ``user``: its lines by first word, and fiberd's status."""
    work = f"/tmp/cgroup-job-{cluster.release}-{user}"
    made = cluster.run("n1", "sh", "-c", f"rm -rf {work} && mkdir {work} && cat > {work}/job.sh",
                       user=user, stdin=CGROUP_JOB)
    assert made.returncode == 0, made.stderr
    sub = cluster.run("n1", "sbatch", "--parsable", f"--chdir={work}", f"--output={work}/out",
                      f"{work}/job.sh", user=user)
    assert sub.returncode == 0, sub.stderr
    state = cluster.wait_finished(sub.stdout.strip().split(";")[0])
    out = cluster.run("n1", "cat", f"{work}/out").stdout
    log = cluster.run("n1", "sh", "-c", f"cat {work}/fiberd-*.log").stdout
    assert state == "COMPLETED", out + log
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    status = json.loads(cluster.run("n1", "cat", f"{work}/status.json").stdout)
    return lines, status


def test_slurm_cgroup_v2_names_the_job_and_fiberd_resolves_it(
        container_cluster: ContainerCluster) -> None:
    """Slurm's cgroup/v2 puts the job in <scope>/<job dir>/step_<n>/user/task_0: job_<id> up to
    24.11, the job's SLUID on 26.05. Slurm leaves it root's; the SPANK plugin hands the
    fiberd step's task cgroup to the job user, so the job user's fiberd carves below it as
    root's does."""
    scope = "/system.slice/n1_slurmstepd.scope"
    for user in (USER, "root"):
        lines, status = run_cgroup_job(container_cluster, user)
        job_id, _, sluid = lines["job"].partition(" ")
        if container_cluster.release >= "26.05":
            assert sluid.startswith("s") and len(sluid) == 14, lines
            job_dir = sluid
        else:
            assert sluid == "", lines
            job_dir = f"job_{job_id}"
        assert lines["batch"] == f"0::{scope}/{job_dir}/step_batch/user/task_0"
        task = f"{scope}/{job_dir}/step_0/user/task_0"
        cgroups = status["status"]["cgroups"]
        assert cgroups["carved"] and cgroups["root"] == f"/sys/fs/cgroup{task}", cgroups
        assert lines["fiber"].startswith(f"0::{task}/"), lines


def test_conform_passes_as_a_job_user(container_cluster: ContainerCluster) -> None:
    out = container_cluster.run(
        "n1", "env", f"SLURM_FIBER_CONFORM_USER={USER}",
        "SLURM_FIBER_SITE_VENV=/opt/slurm-fiber/venv",
        "slurm-fiber", "conform", "--home", "slurm", "--json", timeout=300)
    assert outcomes(json.loads(out.stdout)) == dict.fromkeys(SLURM_CLAUSES, "pass"), \
        out.stdout + out.stderr[-3000:]
    assert out.returncode == 0 and "Traceback" not in out.stderr


def test_the_compose_file_runs_on_compose_v1_and_v2() -> None:
    """No top-level `name:` (v1 refuses it), no build (the script builds the one image), every
    service on the host network, none privileged; v1 itself accepts the file when present."""
    doc = yaml.safe_load(COMPOSE.read_text())
    assert set(doc) == {"x-node", "services", "volumes"}
    for name, service in doc["services"].items():
        assert service["network_mode"] == "host" and "build" not in service, name
        assert not service.get("privileged") and service["device_cgroup_rules"] == ["c 195:* rwm"]
    v2 = yaml.safe_load(COMPOSE_V2.read_text())
    assert set(v2) == {"services"} and set(v2["services"]) == {"n1", "n2"}
    for name, service in v2["services"].items():  # SYS_ADMIN for `unshare --cgroup` only
        assert service["cap_add"] == ["SYS_ADMIN"] and not service.get("privileged"), name
    if shutil.which("docker-compose"):
        env = {**os.environ, "SLURM_FIBER_CGROUP_N1": "/n1", "SLURM_FIBER_CGROUP_N2": "/n2",
               "SLURM_FIBER_CGROUP2_VIEW": "/view.so"}
        for files in (["-f", str(COMPOSE)], ["-f", str(COMPOSE), "-f", str(COMPOSE_V2)]):
            out = subprocess.run(["docker-compose", *files, "config", "-q"], env=env,
                                 capture_output=True, text=True, check=False)
            assert out.returncode == 0, out.stderr
