"""The prolog and epilog on the real bare-host cluster, as slurmd runs them for real jobs.

Jobs run as job users (two jobs against each other as two users), each in a
work dir of its own; one job runs as root, on a private cluster whose site
delegates a cgroup per job, because only root may move a process into it
here. The waits are for the cluster to act (a job to start, its epilog to
finish), polled every 0.1 s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from slurm_fiber.core.clock import FakeClock, SystemClock
from slurm_fiber.core.tokens import TokenVerifier
from slurm_fiber.core.trust import TrustStore
from slurm_fiber.homes.slurm.paths import job_paths
from slurm_fiber.homes.slurm.siteconfig import SiteConfig, load_site_config
from slurm_fiber.lease import Leases

if TYPE_CHECKING:
    from conftest import BareHost, JobUser, SlurmCluster

    WorkDir = Callable[[JobUser], Path]

pytestmark = pytest.mark.slurm
WAIT_S = 60.0

HOLDING_JOB = """#!/bin/sh
state="{state}/nodes/$SLURMD_NODENAME/jobs/$SLURM_JOB_ID"
cd "{work}"
stat -c '%U %a %n' "$state" "$state/grants" "$state/grants/job-$SLURM_JOB_ID.jwt" \
  > "stat-$SLURM_JOB_ID.tmp" 2>&1
cp "$state/grants/job-$SLURM_JOB_ID.jwt" "token-$SLURM_JOB_ID.tmp" 2>/dev/null
printf %s "$SLURM_JOB_GPUS" > "gpus-$SLURM_JOB_ID.tmp"
for f in stat token gpus; do mv "$f-$SLURM_JOB_ID.tmp" "$f-$SLURM_JOB_ID"; done
i=0; while [ ! -f release ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
"""


def site_of(cluster: SlurmCluster) -> SiteConfig:
    if cluster.site_config is None:
        pytest.fail("the cluster is up without hooks: run `bare-host down`, then the tests")
    return load_site_config({"SLURM_FIBER_CONFIG": str(cluster.site_config)})


def eventually(check: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} after {timeout} s"
        time.sleep(0.1)


def leases_of(site: SiteConfig, node: str) -> Leases:
    paths = job_paths(site.state_root, node, 1)
    return Leases(paths.lease_dir, paths.lease_state, FakeClock())


def nothing_left(site: SiteConfig, node: str, job_id: int) -> bool:
    """No state dir, grant, lease or lease grant of the job remains on ``node``."""
    paths = job_paths(site.state_root, node, job_id)
    leases = leases_of(site, node)
    party = f"slurm-job:citest:{job_id}"
    return (not paths.state_dir.exists()
            and not any(h.party().session == party for h in leases.dir.list())
            and not any(g.to.session == party for g in leases.state().grants))


def test_a_jobs_prolog_places_a_verifying_token_and_its_gpu_lease(
        slurm_cluster: SlurmCluster, job_dir: WorkDir, test_user: JobUser) -> None:
    site = site_of(slurm_cluster)
    work = job_dir(test_user)
    script = HOLDING_JOB.format(state=site.state_root, work=work)
    job = slurm_cluster.submit(script, "-w", "n1", "--gres=gpu:1", "-t", "2",
                               workdir=work, user=test_user)
    try:
        eventually(lambda: (work / f"gpus-{job}").exists(), f"job {job} did not report")
        stats = (work / f"stat-{job}").read_text().split("\n")
        assert [line.split()[:2] for line in stats if line] == [
            [test_user.name, "700"], [test_user.name, "700"], [test_user.name, "600"]]
        trust = TrustStore(dict(site.trust))
        grant = TokenVerifier(trust, f"slurm:citest:{job}", SystemClock()).verify(
            (work / f"token-{job}").read_bytes())
        assert grant.uid == f"job-{job}" and grant.issuer == site.issuer
        gpu = int((work / f"gpus-{job}").read_text())
        grants = leases_of(site, "n1").state().grants
        mine = [g.resource for g in grants if g.to.session == f"slurm-job:citest:{job}"]
        assert mine == [f"gpu:n1:{gpu}"]
    finally:
        (work / "release").touch()
        slurm_cluster.wait_done(job)
    eventually(lambda: nothing_left(site, "n1", job), f"job {job}'s state remains")


def test_two_jobs_on_one_node_get_different_gpus_and_leases(
        slurm_cluster: SlurmCluster, job_dir: WorkDir, job_user: JobUser,
        other_user: JobUser) -> None:
    site = site_of(slurm_cluster)
    users = (job_user, other_user)
    works = [job_dir(user) for user in users]
    jobs = [slurm_cluster.submit(HOLDING_JOB.format(state=site.state_root, work=work), "-w",
                                 "n1", "--gres=gpu:1", "-t", "2", workdir=work, user=user)
            for user, work in zip(users, works, strict=True)]
    work_of = dict(zip(jobs, works, strict=True))
    try:
        for job in jobs:
            eventually(lambda job=job: (work_of[job] / f"gpus-{job}").exists(),
                       f"job {job} silent")
        grants = leases_of(site, "n1").state().grants
        held = {g.to.session: g.resource for g in grants}
        mine = [held.get(f"slurm-job:citest:{job}") for job in jobs]
        gpus = [f"gpu:n1:{(work_of[job] / f'gpus-{job}').read_text()}" for job in jobs]
        assert mine == gpus and len(set(mine)) == 2
        owners = [(work_of[job] / f"stat-{job}").read_text().split()[0] for job in jobs]
        assert owners == [user.name for user in users]
    finally:
        for work in works:
            (work / "release").touch()
        for job in jobs:
            slurm_cluster.wait_done(job)
    for job in jobs:
        eventually(lambda job=job: nothing_left(site, "n1", job), f"job {job} state remains")


def test_scancel_and_a_time_limit_leave_nothing_behind(
        slurm_cluster: SlurmCluster, job_dir: WorkDir, test_user: JobUser) -> None:
    site = site_of(slurm_cluster)
    work = job_dir(test_user)
    script = HOLDING_JOB.format(state=site.state_root, work=work)
    cancelled, timed_out = (slurm_cluster.submit(script, "-w", node, "--gres=gpu:1", "-t", "5",
                                                 workdir=work, user=test_user)
                            for node in ("n2", "n2"))
    for job in (cancelled, timed_out):
        eventually(lambda job=job: (work / f"gpus-{job}").exists(), f"job {job} silent")
    assert not nothing_left(site, "n2", cancelled)
    slurm_cluster.run("scancel", str(cancelled))
    out = slurm_cluster.run("scontrol", "update", f"JobId={timed_out}", "TimeLimit=0:01")
    assert out.returncode == 0, out.stderr
    eventually(lambda: nothing_left(site, "n2", cancelled), "the cancelled job's state remains")
    slurm_cluster.wait_done(timed_out, timeout=90)
    eventually(lambda: nothing_left(site, "n2", timed_out), "the timed-out job's state remains")


ESCAPING_JOB = """#!/bin/sh
state="{state}/nodes/$SLURMD_NODENAME/jobs/$SLURM_JOB_ID"
cd "{work}"
{launch}
echo $! > "pid-$SLURM_JOB_ID.tmp" && mv "pid-$SLURM_JOB_ID.tmp" "pid-$SLURM_JOB_ID"
sleep 0.5
"""
# Escapes proctrack/linuxproc: in its own session, reparented once the script exits.
INTO_CGROUP = ("/usr/bin/env -i setsid /bin/sh -c "
               "'echo $$ > \"$1/cgroup.procs\" && exec sleep 300' "
               "sh \"$(cat \"$state/cgroup\")\" &")
WITH_JOB_ENV = "setsid sleep 300 &"


def escaped(cluster: SlurmCluster, work: Path, launch: str,
            user: JobUser | None) -> tuple[int, int]:
    site = site_of(cluster)
    script = ESCAPING_JOB.format(state=site.state_root, work=work, launch=launch)
    job = cluster.submit(script, "-w", "n1", "-t", "2", workdir=work, user=user)
    eventually(lambda: (work / f"pid-{job}").exists(), f"job {job} silent")
    cluster.wait_done(job)
    return job, int((work / f"pid-{job}").read_text())


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture
def delegating_cluster(private_dir: Path, slurm_cluster: SlurmCluster,
                       bare_host_script: BareHost) -> Iterator[SlurmCluster]:
    """A private cluster whose site delegates a cgroup per job (`up --delegate-cgroup`)."""
    if os.geteuid() != 0:
        pytest.skip("bare-host up needs root")
    env = bare_host_script.private_env(private_dir) | {"SLURM_FIBER_CLUSTER_NAME": "cgtest"}
    up = bare_host_script.run("up", "--delegate-cgroup", env=env)
    assert up.returncode == 0, up.stderr
    try:
        variables = bare_host_script.exports(bare_host_script.run("env", env=env).stdout)
        yield dataclasses.replace(
            slurm_cluster, env=env | variables,
            run_dir=Path(variables["SLURM_FIBER_CLUSTER_DIR"]),
            site_config=Path(variables["SLURM_FIBER_CONFIG"]))
    finally:
        down = bare_host_script.run("down", env=env)
    assert down.returncode == 0, down.stderr


@pytest.mark.machine_may_lack("a writable cgroup v2 hierarchy")
def test_a_process_left_in_the_delegated_cgroup_is_killed_by_the_epilog(
        delegating_cluster: SlurmCluster, tmp_path: Path) -> None:
    site = site_of(delegating_cluster)
    if not site.delegate_cgroup:
        pytest.skip("bare-host found no cgroup2 mount: no delegation here")
    work = tmp_path / "work"
    work.mkdir()
    # As root: only root may move a process from the cgroup2 root into the job's subtree.
    job, pid = escaped(delegating_cluster, work, INTO_CGROUP, None)
    try:
        eventually(lambda: gone(pid), f"pid {pid} in job {job}'s cgroup survived the epilog")
        assert site.cgroup_parent is not None
        eventually(lambda: not (site.cgroup_parent / "n1" / f"job_{job}").exists(),
                   "the delegated cgroup remains")
    finally:
        if not gone(pid):
            os.kill(pid, 9)


def test_an_orphan_of_the_job_user_is_killed_by_the_epilog(
        slurm_cluster: SlurmCluster, job_dir: WorkDir, test_user: JobUser) -> None:
    job, pid = escaped(slurm_cluster, job_dir(test_user), WITH_JOB_ENV, test_user)
    try:
        eventually(lambda: gone(pid), f"job {job}'s orphan {pid} survived the epilog")
    finally:
        if not gone(pid):
            os.kill(pid, 9)


def test_a_broken_config_drains_only_when_marked_fatal(
        private_dir: Path, bare_host_script: BareHost, slurm_cluster: SlurmCluster,
        job_user: JobUser) -> None:
    """A private cluster: its prolog config is broken, then broken with `config` fatal."""
    bare_host, exports = bare_host_script.run, bare_host_script.exports
    if os.geteuid() != 0:
        pytest.skip("bare-host up needs root")
    env = bare_host_script.private_env(private_dir) | {"SLURM_FIBER_CLUSTER_NAME": "cfgtest"}
    up = bare_host("up", env=env)
    assert up.returncode == 0, up.stderr
    try:
        variables = exports(bare_host("env", env=env).stdout)
        config = Path(variables["SLURM_FIBER_CONFIG"])
        status = json.loads(bare_host("status", "--json", env=env).stdout)
        assert status["site_config"] == str(config)
        good = config.read_text()
        site = load_site_config({"SLURM_FIBER_CONFIG": str(config)})
        assert site.issuer == "cfgtest" and site.issuer_key is not None
        assert site.issuer_key.stat().st_mode & 0o777 == 0o600
        private = dataclasses.replace(slurm_cluster, env=env | variables)

        def run_job() -> tuple[int, str]:
            out = private.srun("-w", "n1", "-t", "1", "--chdir=/", "true", user=job_user)
            state = private.run("sinfo", "-h", "-n", "n1", "-o", "%T").stdout.strip()
            return out.returncode, state

        config.write_text("issuer = [\n")  # not TOML, and no fatal list
        code, state = run_job()
        assert code == 0 and "drain" not in state, state
        config.write_text("fatal = ['config']\nbogus_key = 1\n")
        code, state = run_job()
        assert code != 0 and "drain" in state, (code, state)
        log = (private_dir / "cluster" / "log" / "slurmd-n1.log").read_text()
        assert "slurm-fiber-prolog: config: " in log and "unknown key 'bogus_key'" in log
    finally:
        if "config" in locals():
            config.write_text(good)
        dataclasses.replace(slurm_cluster, env=env | exports(bare_host("env", env=env).stdout)
                            ).run("scontrol", "update", "nodename=n1", "state=resume")
        down = bare_host("down", env=env)
    assert down.returncode == 0, down.stderr
    assert site.cgroup_parent is None or not site.cgroup_parent.exists()


def test_every_node_of_a_job_gets_its_own_state(slurm_cluster: SlurmCluster,
                                                 job_user: JobUser) -> None:
    site = site_of(slurm_cluster)
    check = (f'd={site.state_root}/nodes/$SLURMD_NODENAME/jobs/$SLURM_JOB_ID; '
             'test -s "$d/grants/job-$SLURM_JOB_ID.jwt" && echo "$SLURMD_NODENAME $SLURM_JOB_ID"')
    out = slurm_cluster.srun("-N2", "--gres=gpu:1", "sh", "-c", check, user=job_user)
    assert out.returncode == 0, out.stderr
    lines = sorted(out.stdout.split("\n")[:2])
    assert [line.split()[0] for line in lines] == ["n1", "n2"], out.stdout
    job = int(lines[0].split()[1])
    for node in ("n1", "n2"):
        eventually(lambda node=node: nothing_left(site, node, job), f"job {job} left on {node}")


CLAIMING_JOB = """#!/bin/sh
cd "{work}"
"{python}" - > "claim-$SLURM_JOB_ID.tmp" 2>&1 <<'PY'
import os
from slurm_fiber.core.clock import SystemClock
from slurm_fiber.homes.slurm.jobenv import job_from_env
from slurm_fiber.homes.slurm.leases import NodeLeases
from slurm_fiber.homes.slurm.paths import gpu_resource
from slurm_fiber.homes.slurm.siteconfig import load_site_config
from slurm_fiber.lease.stale import process_ref
job = job_from_env(os.environ)
leases = NodeLeases.for_job(load_site_config(os.environ), job, SystemClock(),
                            process_ref(os.getppid()))
for gpu in job.gpus:
    leases.claim(gpu_resource(job.node, gpu))
    print("claimed", gpu_resource(job.node, gpu))
PY
mv "claim-$SLURM_JOB_ID.tmp" "claim-$SLURM_JOB_ID"
i=0; while [ ! -f release ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
"""


def test_the_job_user_claims_its_granted_gpu_and_the_epilog_frees_it(
        slurm_cluster: SlurmCluster, job_dir: WorkDir, test_user: JobUser) -> None:
    """What fiberd does as the job user, done by the job itself with the site install."""
    site = site_of(slurm_cluster)
    work = job_dir(test_user)
    job = slurm_cluster.submit(
        CLAIMING_JOB.format(work=work, python=slurm_cluster.site_bin / "python"), "-w", "n1",
        "--gres=gpu:1", "-t", "2", workdir=work, user=test_user)
    try:
        eventually(lambda: (work / f"claim-{job}").exists(), f"job {job} did not claim")
        said = (work / f"claim-{job}").read_text()
        assert said.startswith("claimed gpu:n1:"), said
        resource = said.split()[1]
        holder = leases_of(site, "n1").dir.get(resource)
        assert holder is not None and holder.party().session == f"slurm-job:citest:{job}"
        lease = job_paths(site.state_root, "n1", job).lease_dir / resource
        assert lease.stat().st_uid == test_user.uid
    finally:
        (work / "release").touch()
        slurm_cluster.wait_done(job)
    eventually(lambda: nothing_left(site, "n1", job), f"job {job}'s lease remains")
