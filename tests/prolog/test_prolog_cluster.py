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
from slurm_fiber.core.trust.issuers import TrustStore
from slurm_fiber.core.trust.tokens import TokenVerifier
from slurm_fiber.homes.slurm.leases import AREA_OWNERS
from slurm_fiber.homes.slurm.paths import job_paths
from slurm_fiber.homes.slurm.siteconfig import SiteConfig, load_site_config
from slurm_fiber.lease import Leases
from slurm_fiber.lease.dirlease import HOLDER_FILE

if TYPE_CHECKING:
    from tests.barehost.clusterkit import BareHost, SlurmCluster
    from tests.security.userkit import JobUser

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
    """The node's root-only lease area, read as the hooks read it (root's entries only)."""
    paths = job_paths(site.state_root, node, 1)
    return Leases(paths.lease_dir, paths.lease_state, FakeClock(), owners=AREA_OWNERS)


def assert_held_by_job(site: SiteConfig, node: str, job: int, user: JobUser,
                       resource: str) -> None:
    """``resource`` is held, as the prolog leaves it, by ``job``'s party (no process named,
    root's record) and no grant of the job is left pending in the state document."""
    leases = leases_of(site, node)
    holder = leases.dir.get(resource)
    party = f"slurm-job:citest:{job}"
    assert holder is not None, f"{resource} is free"
    assert (holder.party().session, holder.process(), holder.holder) == (
        party, None, f"slurm job {job} ({user.name})"), holder
    record = leases.dir.path / resource / HOLDER_FILE
    assert (record.stat().st_uid, record.stat().st_mode & 0o777) == (0, 0o644)
    pending = [g.resource for g in leases.state().grants if g.to.session == party]
    assert pending == [], f"job {job} still has pending grants {pending}"


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
        assert_held_by_job(site, "n1", job, test_user, f"gpu:n1:{gpu}")
        held = [h.env for h in leases_of(site, "n1").dir.list()
                if h.party().session == f"slurm-job:citest:{job}"]
        assert held == [f"gpu:n1:{gpu}"]
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
        held = {h.party().session: h.env for h in leases_of(site, "n1").dir.list()}
        mine = [held.get(f"slurm-job:citest:{job}") for job in jobs]
        gpus = [f"gpu:n1:{(work_of[job] / f'gpus-{job}').read_text()}" for job in jobs]
        assert mine == gpus and len(set(mine)) == 2
        for job, user, gpu in zip(jobs, users, gpus, strict=True):
            assert_held_by_job(site, "n1", job, user, gpu)
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


VERIFYING_JOB = """#!/bin/sh
cd "{work}"
"{python}" - > "claim-$SLURM_JOB_ID.tmp" 2>&1 <<'PY'
import os
from slurm_fiber.core.clock import SystemClock
from slurm_fiber.homes.slurm.home import DevicesRefused
from slurm_fiber.homes.slurm.jobenv import job_from_env
from slurm_fiber.homes.slurm.leases import NodeLeases
from slurm_fiber.homes.slurm.paths import gpu_resource, job_paths
from slurm_fiber.homes.slurm.siteconfig import load_site_config
config = load_site_config(os.environ)
job = job_from_env(os.environ)
leases = NodeLeases.for_job(config, job, SystemClock())
for gpu in job.gpus:
    leases.claim(gpu_resource(job.node, gpu))
    print("verified", gpu_resource(job.node, gpu))
other = gpu_resource(job.node, 1 - job.gpus[0])  # the node's other GPU, not the job's
try:
    leases.claim(other)
    print("claimed", other)
except DevicesRefused as err:
    print("refused", other, err.code)
lease_dir = job_paths(config.state_root, job.node, job.job_id).lease_dir
try:
    os.mkdir(lease_dir / other)
    print("wrote", other)
except PermissionError:
    print("read-only", lease_dir)
PY
mv "claim-$SLURM_JOB_ID.tmp" "claim-$SLURM_JOB_ID"
i=0; while [ ! -f release ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done
"""


def test_the_job_users_claim_verifies_the_prologs_lease_and_the_epilog_frees_it(
        slurm_cluster: SlurmCluster, job_dir: WorkDir, test_user: JobUser) -> None:
    """What fiberd does as the job user, done by the job itself with the site install:
    its claim only verifies the lease the prolog claimed in the job's name."""
    site = site_of(slurm_cluster)
    work = job_dir(test_user)
    job = slurm_cluster.submit(
        VERIFYING_JOB.format(work=work, python=slurm_cluster.site_bin / "python"), "-w", "n1",
        "--gres=gpu:1", "-t", "2", workdir=work, user=test_user)
    try:
        eventually(lambda: (work / f"claim-{job}").exists(), f"job {job} did not verify")
        said = (work / f"claim-{job}").read_text().split("\n")
        assert said[0].startswith("verified gpu:n1:"), said
        resource = said[0].split()[1]
        other = f"gpu:n1:{1 - int(resource.rsplit(':', 1)[1])}"
        refused, lease_dir = said[1].split(), leases_of(site, "n1").dir.path
        assert refused[:2] == ["refused", other], said
        assert refused[2] in ("lease_failed", "device_held"), said
        assert said[2] == f"read-only {lease_dir}", said
        assert_held_by_job(site, "n1", job, test_user, resource)
        assert (lease_dir / resource).stat().st_uid == 0
    finally:
        (work / "release").touch()
        slurm_cluster.wait_done(job)
    eventually(lambda: nothing_left(site, "n1", job), f"job {job}'s lease remains")
