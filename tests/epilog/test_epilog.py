"""The epilog, run as slurmd runs it (`env -i`, root), after a real prolog run, on tmp dirs.

Leftover processes are real processes: in a real delegated cgroup, named
by a fiberd record, or orphans whose environment names the job.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

from slurm_fiber.core.cgroups import teardown
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.epilog import main as epilog
from slurm_fiber.epilog.statedir import retire_state_dir
from slurm_fiber.homes.slurm.fiberdrecord import FiberdRecord, write_record
from slurm_fiber.homes.slurm.paths import job_paths
from slurm_fiber.hooks.hook import Hook
from slurm_fiber.lease import Leases
from tests.hooks.hookkit import Site, gone, job_env, run_hook

if TYPE_CHECKING:
    from tests.security.userkit import JobUser

CGROUP2 = Path("/sys/fs/cgroup/unified")


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path / "site")


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts; whatever the epilog left is killed afterwards."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_the_epilog_removes_everything_and_keeps_the_audit_log(site: Site,
                                                               test_user: JobUser) -> None:
    env = job_env(site, 61, test_user.uid, test_user.gid, test_user.name, gpus="0,1")
    assert run_hook("prolog", env).returncode == 0
    paths = job_paths(site.state_root, "n1", 61)
    (paths.state_dir / "audit.jsonl").write_text('{"event": "admit"}\n')
    out = run_hook("epilog", env | {"SLURM_SCRIPT_CONTEXT": "epilog_slurmd"})
    assert (out.returncode, out.stderr) == (0, "")
    assert not paths.state_dir.exists()
    kept = site.state_root / "nodes" / "n1" / "audit" / "job-61.jsonl"
    assert kept.read_text() == '{"event": "admit"}\n' and kept.stat().st_mode & 0o777 == 0o600
    leases = Leases(paths.lease_dir, paths.lease_state, FakeClock())
    assert leases.state().grants == [] and leases.dir.list() == []
    again = run_hook("epilog", env)  # idempotent
    assert (again.returncode, again.stderr) == (0, "")


def test_a_half_done_prolog_or_none_at_all_is_fine(site: Site, test_user: JobUser) -> None:
    env = job_env(site, 62, test_user.uid, test_user.gid, test_user.name, gpus="0")
    out = run_hook("epilog", env)  # the prolog never ran
    assert (out.returncode, out.stderr) == (0, "")
    paths = job_paths(site.state_root, "n1", 62)
    paths.state_dir.mkdir(parents=True)  # the prolog died after its first mkdir
    out = run_hook("epilog", env)
    assert (out.returncode, out.stderr) == (0, "") and not paths.state_dir.exists()


def test_the_fiberd_of_the_record_and_its_children_are_stopped(
        site: Site, test_user: JobUser, spawned: list[subprocess.Popen[bytes]]) -> None:
    env = job_env(site, 63, test_user.uid, test_user.gid, test_user.name)
    assert run_hook("prolog", env).returncode == 0
    fiberd = subprocess.Popen(["/bin/sh", "-c", "sleep 300 & sleep 300 & wait"],
                              user=test_user.uid, group=test_user.gid, extra_groups=[],
                              env={})  # crashed fiberd-run: nothing in its env names the job
    spawned.append(fiberd)
    deadline = time.monotonic() + 10
    while len(psutil.Process(fiberd.pid).children()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    children = [c.pid for c in psutil.Process(fiberd.pid).children()]
    start = round(psutil.Process(fiberd.pid).create_time(), 2)
    paths = job_paths(site.state_root, "n1", 63)
    write_record(paths.state_dir, FiberdRecord(fiberd.pid, start, str(paths.socket), None,
                                               test_user.uid))
    out = run_hook("epilog", env)
    assert out.returncode == 0, out.stderr
    assert "killed 3 leftover process(es)" in out.stderr and "fiberd (its record)" in out.stderr
    assert all(gone(pid) for pid in [fiberd.pid, *children])


def test_a_record_naming_someone_elses_process_is_ignored(
        site: Site, test_user: JobUser, spawned: list[subprocess.Popen[bytes]]) -> None:
    env = job_env(site, 64, test_user.uid, test_user.gid, test_user.name)
    assert run_hook("prolog", env).returncode == 0
    victim = subprocess.Popen(["sleep", "300"])  # root's, not the job user's
    spawned.append(victim)
    start = round(psutil.Process(victim.pid).create_time(), 2)
    paths = job_paths(site.state_root, "n1", 64)
    write_record(paths.state_dir, FiberdRecord(victim.pid, start, "s", "/", test_user.uid))
    out = run_hook("epilog", env)
    assert (out.returncode, out.stderr) == (0, "")
    assert victim.poll() is None


def test_orphans_whose_environment_names_the_job_are_stopped(
        site: Site, test_user: JobUser, spawned: list[subprocess.Popen[bytes]]) -> None:
    env = job_env(site, 65, test_user.uid, test_user.gid, test_user.name)
    assert run_hook("prolog", env).returncode == 0
    marker = {"SLURM_JOB_ID": "65", "SLURMD_NODENAME": "n1", "SLURM_CLUSTER_NAME": "citest",
              "SLURM_CONF": "/etc/slurm/slurm.conf"}

    def start(uid: int, environ: dict[str, str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["sleep", "300"], env={"PATH": "/usr/bin:/bin", **environ},
                                user=uid, start_new_session=True)
        spawned.append(proc)
        return proc

    orphan = start(test_user.uid, marker)
    other_job = start(test_user.uid, marker | {"SLURM_JOB_ID": "66"})
    other_node = start(test_user.uid, marker | {"SLURMD_NODENAME": "n2"})
    other_cluster = start(test_user.uid, marker | {"SLURM_CONF": "/other/slurm.conf"})
    no_conf = start(test_user.uid, {k: v for k, v in marker.items() if k != "SLURM_CONF"})
    other_user = start(0, marker)
    out = run_hook("epilog", env | {"SLURM_CONF": "/etc/slurm/slurm.conf"})
    assert out.returncode == 0, out.stderr
    assert "its environment names job 65" in out.stderr
    deadline = time.monotonic() + 5
    while orphan.poll() is None:
        assert time.monotonic() < deadline, "the orphan survived"
        time.sleep(0.02)
    assert all(p.poll() is None
               for p in (other_job, other_node, other_cluster, no_conf, other_user))


@pytest.mark.machine_may_lack("a writable cgroup v2 hierarchy")
def test_a_process_left_in_the_delegated_cgroup_is_killed(
        site: Site, test_user: JobUser, spawned: list[subprocess.Popen[bytes]]) -> None:
    if not os.access(CGROUP2 / "cgroup.procs", os.W_OK):
        pytest.skip(f"no writable cgroup v2 at {CGROUP2}")
    parent = CGROUP2 / f"sf-test-{uuid.uuid4().hex[:8]}"
    site.configure("delegate_cgroup = true", f'cgroup_parent = "{parent}"')
    env = job_env(site, 67, test_user.uid, test_user.gid, test_user.name)
    try:
        assert run_hook("prolog", env).returncode == 0
        cgroup = parent / "n1" / "job_67"
        (cgroup / "inner").mkdir()  # what fiberd carves
        leftover = subprocess.Popen(["sleep", "300"], env={})  # no job marker at all
        spawned.append(leftover)
        (cgroup / "inner" / "cgroup.procs").write_text(f"{leftover.pid}\n")
        out = run_hook("epilog", env)
        assert out.returncode == 0, out.stderr
        assert f"in cgroup {cgroup}" in out.stderr
        assert leftover.wait(5) == -9 and not cgroup.exists()
    finally:
        for path in (parent / "n1" / "job_67" / "inner", parent / "n1" / "job_67",
                     parent / "n1", parent):
            if path.exists():
                path.rmdir()


@pytest.mark.machine_may_lack("a writable cgroup v2 hierarchy")
def test_a_delegated_cgroup_tree_deeper_than_pythons_recursion_is_removed_whole(
        site: Site, test_user: JobUser) -> None:
    """A job makes its delegated subtree 1,100 groups deep: the epilog removes it all,
    within the default bound of its step (a recursive walk gave up at Python's recursion
    limit and left the tree behind; a walk by full paths, whose cost grows with the
    square of the depth, ran out of the step's time)."""
    if not os.access(CGROUP2 / "cgroup.procs", os.W_OK):
        pytest.skip(f"no writable cgroup v2 at {CGROUP2}")
    parent = CGROUP2 / f"sf-test-{uuid.uuid4().hex[:8]}"
    site.configure("delegate_cgroup = true", f'cgroup_parent = "{parent}"')
    env = job_env(site, 68, test_user.uid, test_user.gid, test_user.name)
    cgroup = parent / "n1" / "job_68"
    try:
        assert run_hook("prolog", env).returncode == 0
        fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for _ in range(1100):  # relative to the last one: no path grows past PATH_MAX
                os.mkdir("g", dir_fd=fd)
                inner = os.open("g", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = inner
        finally:
            os.close(fd)
        out = run_hook("epilog", env)
        assert out.returncode == 0, out.stderr
        assert not cgroup.exists(), out.stderr
    finally:
        if cgroup.exists():
            teardown.remove_tree(cgroup, time.monotonic() + 60)
        for path in (parent / "n1", parent):
            if path.exists():
                path.rmdir()


def test_a_state_dir_with_an_unmovable_audit_log_is_kept(site: Site,
                                                         test_user: JobUser) -> None:
    env = job_env(site, 68, test_user.uid, test_user.gid, test_user.name)
    assert run_hook("prolog", env).returncode == 0
    paths = job_paths(site.state_root, "n1", 68)
    (paths.state_dir / "audit.jsonl").write_text("{}\n")
    (site.state_root / "nodes" / "n1" / "audit").write_text("a file, not a directory")
    out = run_hook("epilog", env)
    assert out.returncode == 0 and "job 68: audit: " in out.stderr
    kept = list((site.state_root / "nodes" / "n1" / "retired").glob("kept-job-68.*/audit.jsonl"))
    assert "kept" in out.stderr and len(kept) == 1 and not paths.state_dir.exists()


def test_an_epilog_leaves_the_state_dir_another_epilog_still_reads(
        site: Site, test_user: JobUser) -> None:
    """Two jobs end together on a node: job 70's epilog has retired its state dir and not
    yet kept its audit log when job 69's epilog sweeps the retired area."""
    envs = {job: job_env(site, job, test_user.uid, test_user.gid, test_user.name)
            for job in (69, 70)}
    for job, env in envs.items():
        assert run_hook("prolog", env).returncode == 0
        (job_paths(site.state_root, "n1", job).state_dir / "audit.jsonl").write_text(
            f'{{"job": {job}}}\n')
    busy = retire_state_dir(job_paths(site.state_root, "n1", 70), 70, 5.0)
    assert busy is not None
    area = busy.parent
    stale = area / f"busy-{int(time.time()) - 3600}-job-71.0123456789ab"  # its epilog died
    stale.mkdir()
    out = run_hook("epilog", envs[69])
    assert (out.returncode, out.stderr) == (0, "")
    assert (busy / "audit.jsonl").read_text() == '{"job": 70}\n'
    assert sorted(p.name for p in area.iterdir()) == [busy.name]
    kept = site.state_root / "nodes" / "n1" / "audit" / "job-69.jsonl"
    assert kept.read_text() == '{"job": 69}\n'


FREEZER = Path("/sys/fs/cgroup/freezer")


@pytest.fixture
def frozen() -> Iterator[subprocess.Popen[bytes]]:
    """A process frozen in a cgroup v1 freezer: SIGKILL cannot end it until it is thawed."""
    if not os.access(FREEZER / "tasks", os.W_OK):
        pytest.skip(f"no writable cgroup v1 freezer at {FREEZER}")
    cgroup = FREEZER / f"sf-test-{uuid.uuid4().hex[:8]}"
    cgroup.mkdir()
    proc = subprocess.Popen(["sleep", "300"])
    try:
        (cgroup / "tasks").write_text(f"{proc.pid}\n")
        (cgroup / "freezer.state").write_text("FROZEN\n")
        yield proc
    finally:
        (cgroup / "freezer.state").write_text("THAWED\n")
        proc.kill()
        proc.wait()
        cgroup.rmdir()


@pytest.mark.machine_may_lack("a cgroup v1 freezer to hold a process through SIGKILL")
def test_processes_that_survive_sigkill_drain_the_node_and_are_named(
        site: Site, frozen: subprocess.Popen[bytes]) -> None:
    env = job_env(site, 69, 0, 0, "root")
    site.configure("step_seconds = 3.0")  # the frozen one holds its wait share (0.6) of it
    assert run_hook("prolog", env).returncode == 0
    paths = job_paths(site.state_root, "n1", 69)
    start = round(psutil.Process(frozen.pid).create_time(), 2)
    write_record(paths.state_dir, FiberdRecord(frozen.pid, start, "s", None, 0))
    out = run_hook("epilog", env)
    assert out.returncode == 1
    assert f"processes: survived SIGKILL: pid {frozen.pid} (sleep 300" in out.stderr
    assert frozen.poll() is None


def test_an_audit_log_swapped_for_a_link_is_dropped_not_followed(site: Site,
                                                                 test_user: JobUser) -> None:
    env = job_env(site, 70, test_user.uid, test_user.gid, test_user.name)
    assert run_hook("prolog", env).returncode == 0
    victim = site.root / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    paths = job_paths(site.state_root, "n1", 70)
    (paths.state_dir / "audit.jsonl").symlink_to(victim)  # what the job user could plant
    out = run_hook("epilog", env)
    assert out.returncode == 0 and "job 70: audit: " in out.stderr and "dropped" in out.stderr
    assert victim.stat().st_mode & 0o777 == 0o644 and victim.read_text() == "precious\n"
    assert not paths.state_dir.exists()
    assert list((site.state_root / "nodes" / "n1" / "audit").iterdir()) == []


def test_environ_matching_is_exact() -> None:
    from slurm_fiber.epilog.procscan import environ_names_job
    from slurm_fiber.homes.slurm.jobenv import SlurmJob

    job = SlurmJob(job_id=7, uid=0, gid=0, user="root", partition="p", node="n1", cluster="c")
    env = b"A=1\0SLURM_JOB_ID=7\0SLURMD_NODENAME=n1\0SLURM_CLUSTER_NAME=c\0SLURM_CONF=/s\0"
    assert environ_names_job(env, job, "/s") and environ_names_job(env, job, None)
    assert not environ_names_job(env, job, "/other")
    assert not environ_names_job(env.replace(b"JOB_ID=7", b"JOB_ID=77"), job, "/s")
    assert not environ_names_job(env.replace(b"SLURM_CONF=/s\0", b""), job, "/s")
    assert not environ_names_job(b"\xff\0garbage", job, None)


def test_the_caller_and_its_ancestors_are_protected(tmp_path: Path) -> None:
    from slurm_fiber.epilog.survivors import protected_pids

    ancestors = {p.pid for p in psutil.Process().parents()}
    assert protected_pids() == {1, os.getpid()} | ancestors
    parent = os.getppid()  # a fake /proc: a command name holding ") S 9 " cannot fool it
    for pid, stat in ((parent, f"{parent} (evil) S 9 ) S 5 1 1"), (5, "5 (sh) S 1 5 5")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(stat)
    assert protected_pids(tmp_path) == {1, os.getpid(), parent, 5}
    (tmp_path / "5" / "stat").write_text("5 (sh")  # junk ends the walk, keeping what it has
    assert protected_pids(tmp_path) == {1, os.getpid(), parent, 5}


def test_the_epilog_tightens_a_shared_lease_area_before_releasing(site: Site,
                                                                  test_user: JobUser) -> None:
    env = job_env(site, 71, test_user.uid, test_user.gid, test_user.name, gpus="0")
    assert run_hook("prolog", env).returncode == 0
    paths = job_paths(site.state_root, "n1", 71)
    paths.lease_dir.chmod(0o777)  # as an older version left it
    stray = paths.lease_dir / "gpu:n1:5"
    stray.mkdir()
    os.chown(stray, test_user.uid, test_user.gid)  # a job user's own "lease"
    out = run_hook("epilog", env)
    assert out.returncode == 0
    assert out.stderr.count("\n") == 1 and "moved aside 1 untrusted entry" in out.stderr
    assert f"{stray} is a directory of uid {test_user.uid}" in out.stderr
    assert paths.lease_dir.stat().st_mode & 0o7777 == 0o755
    assert Leases(paths.lease_dir, paths.lease_state, FakeClock()).dir.list() == []


def test_a_processes_step_that_cannot_finish_drains_the_node(
        site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    """A processes step that overruns its bound (a /proc scan on a node in trouble) shows
    nothing gone: the node drains rather than go to the next job with the last one's
    processes maybe still running, and the line says which step and why."""
    env = job_env(site, 70, 0, 0, "root")
    site.configure("step_seconds = 0.2")
    monkeypatch.setattr(epilog, "_processes", lambda *args: time.sleep(30))
    hook = Hook(epilog.NAME, use_syslog=False)
    assert epilog.run_epilog(env, hook) == 1
    assert hook.failed == {"processes": "did not finish within 0.2 s"}
