"""The prolog, run as slurmd runs it (`env -i`, root, the job in the environment), on tmp dirs.

The job runs as a non-root user so ownership is really checked. Tokens are
verified with the real verifier; steps that must time out block on a real
lock held by the test.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from slurm_fiber.core.clock import FakeClock, SystemClock
from slurm_fiber.core.trust.issuers import TrustStore
from slurm_fiber.core.trust.mint import mint
from slurm_fiber.core.trust.tokens import TokenVerifier
from slurm_fiber.homes import EventKind, GrantDir
from slurm_fiber.homes.slurm.cgroup_root import delegated_root
from slurm_fiber.homes.slurm.leases import job_party
from slurm_fiber.homes.slurm.paths import job_paths
from slurm_fiber.lease import Leases
from tests.hooks.hookkit import ISSUER, Site, job_env, run_hook

if TYPE_CHECKING:
    from tests.security.userkit import JobUser

CGROUP2 = Path("/sys/fs/cgroup/unified")


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path / "site")


def verify(site: Site, token: bytes, audience: str) -> object:
    return TokenVerifier(TrustStore({ISSUER: site.jwks}), audience, SystemClock()).verify(token)


def owned(path: Path, uid: int, mode: int) -> bool:
    st = os.lstat(path)
    return st.st_uid == uid and stat.S_IMODE(st.st_mode) == mode


def test_the_prolog_places_the_jobs_token_in_dirs_the_job_user_owns(
        site: Site, test_user: JobUser) -> None:
    env = job_env(site, 41, test_user.uid, test_user.gid, test_user.name)
    out = run_hook("prolog", env)
    assert (out.returncode, out.stderr) == (0, "")
    paths = job_paths(site.state_root, "n1", 41)
    assert owned(paths.state_dir, test_user.uid, 0o700)
    assert owned(paths.grantdir, test_user.uid, 0o700)
    token_file = paths.grantdir / "job-41.jwt"
    assert owned(token_file, test_user.uid, 0o600)
    assert owned(paths.state_dir.parent, 0, 0o755)  # nodes/n1/jobs stays root's
    grant = verify(site, token_file.read_bytes(), "slurm:citest:41")
    assert grant.uid == "job-41" and grant.spec.devices == ("gpu",)  # type: ignore[attr-defined]
    assert abs(grant.exp - (time.time() + 86400)) < 60  # type: ignore[attr-defined]
    assert not list(paths.state_dir.parent.parent.glob("leases"))  # no GPUs, no lease area
    problems: list[object] = []
    events = GrantDir(paths.grantdir, FakeClock(), on_problem=problems.append,
                      owner=test_user.uid).poll()  # what the job's Slurm home reads
    assert [(e.kind, e.token) for e in events] == [(EventKind.GRANT_ADDED,
                                                    token_file.read_bytes())]
    assert problems == []


def test_the_token_ends_at_the_jobs_end_when_slurm_says_it(site: Site,
                                                           test_user: JobUser) -> None:
    end = int(time.time()) + 600
    env = job_env(site, 42, test_user.uid, test_user.gid, test_user.name,
                  SLURM_JOB_END_TIME=str(end))
    assert run_hook("prolog", env).returncode == 0
    token = (job_paths(site.state_root, "n1", 42).grantdir / "job-42.jwt").read_bytes()
    assert verify(site, token, "slurm:citest:42").exp == end  # type: ignore[attr-defined]


def test_gpus_are_granted_to_the_job_and_claimed_in_its_name(site: Site,
                                                             test_user: JobUser) -> None:
    env = job_env(site, 43, test_user.uid, test_user.gid, test_user.name, gpus="0-1")
    assert run_hook("prolog", env).returncode == 0
    assert run_hook("prolog", env).returncode == 0  # idempotent
    paths = job_paths(site.state_root, "n1", 43)
    leases = Leases(paths.lease_dir, paths.lease_state, FakeClock(), owners=(0,))
    state = leases.state()
    assert state.grants == []  # both grants consumed by the prolog's claims
    holders = leases.dir.list()
    assert [h.env for h in holders] == ["gpu:n1:0", "gpu:n1:1"]
    party = holders[0].party()
    assert party.session == "slurm-job:citest:43" and party.person == test_user.name
    assert state.supervisor is not None and state.supervisor.party.session == "slurm-prolog:n1"
    for path in (paths.lease_dir, *paths.lease_dir.rglob("*")):
        assert path.stat().st_uid == 0 and path.stat().st_mode & 0o022 == 0, path


def spool_token(site: Site, audience: str, *, exp_in: float = 600, uid: str = "cp-1") -> bytes:
    now = time.time()
    return mint(site.key, issuer=ISSUER, uid=uid, audience=audience, iat=now,
                exp=now + exp_in).encode()


def test_spooled_tokens_are_verified_before_import(site: Site, test_user: JobUser) -> None:
    spool = site.root / "spool"
    site.configure(f'spool_dir = "{spool}"')
    drop = spool / "citest" / "44"
    drop.mkdir(parents=True)
    (drop / "good.jwt").write_bytes(spool_token(site, "slurm:citest:44"))
    (drop / "other-job.jwt").write_bytes(spool_token(site, "slurm:citest:45"))
    (drop / "junk.jwt").write_bytes(b"not a token")
    (drop / "huge.jwt").write_bytes(b"x" * 70_000)
    (drop / "link.jwt").symlink_to(drop / "good.jwt")
    (drop / "README").write_text("not a token file")
    env = job_env(site, 44, test_user.uid, test_user.gid, test_user.name)
    out = run_hook("prolog", env)
    assert out.returncode == 0
    grants = job_paths(site.state_root, "n1", 44).grantdir
    assert sorted(p.name for p in grants.iterdir()) == ["job-44.jwt", "spool-good.jwt"]
    assert owned(grants / "spool-good.jwt", test_user.uid, 0o600)
    lines = out.stderr.splitlines()
    assert len(lines) == 5 and all(line.startswith("slurm-fiber-prolog: job 44: spool: ")
                                   for line in lines), out.stderr
    assert any("other-job.jwt: skipped, wrong_audience" in line for line in lines)
    assert any("link.jwt: skipped" in line for line in lines)


def test_a_broken_config_never_drains_unless_the_site_says_so(site: Site,
                                                              test_user: JobUser) -> None:
    env = job_env(site, 46, test_user.uid, test_user.gid, test_user.name)
    site.config.write_text("issuer = [")  # not TOML
    out = run_hook("prolog", env)
    assert out.returncode == 0 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("slurm-fiber-prolog: config: ") and "not valid TOML" in out.stderr
    site.config.write_text("fatal = ['config']\nstep_seconds = 'soon'\n")
    out = run_hook("prolog", env)
    assert out.returncode == 1 and "step_seconds: must be a number" in out.stderr
    assert not site.state_root.exists()  # a broken config touches nothing


def test_a_failed_step_drains_only_when_fatal(site: Site, test_user: JobUser) -> None:
    site.state_root.write_text("a file where the state root should be")
    env = job_env(site, 47, test_user.uid, test_user.gid, test_user.name)
    out = run_hook("prolog", env)
    assert out.returncode == 0 and "job 47: state_dir: " in out.stderr
    site.configure('fatal = ["state_dir"]')
    assert run_hook("prolog", env).returncode == 1


def test_a_planted_symlink_is_refused_not_followed(site: Site, test_user: JobUser) -> None:
    env = job_env(site, 48, test_user.uid, test_user.gid, test_user.name)
    assert run_hook("prolog", env).returncode == 0
    paths = job_paths(site.state_root, "n1", 48)
    target = site.root / "victim"
    target.mkdir(mode=0o700)
    for token in paths.grantdir.iterdir():
        token.unlink()
    paths.grantdir.rmdir()
    paths.grantdir.symlink_to(target)  # what the job user could do to its own state dir
    out = run_hook("prolog", env)  # a second run never reuses what the user had
    assert out.returncode == 0 and "job 48: state_dir: moved what was left at" in out.stderr
    assert list(target.iterdir()) == [] and owned(target, 0, 0o700)
    assert not paths.grantdir.is_symlink() and owned(paths.grantdir, test_user.uid, 0o700)
    assert [p.name for p in paths.grantdir.iterdir()] == ["job-48.jwt"]


def test_a_blocked_step_is_bounded_in_time(site: Site, test_user: JobUser) -> None:
    site.configure("step_seconds = 0.5")
    env = job_env(site, 49, test_user.uid, test_user.gid, test_user.name, gpus="0")
    assert run_hook("prolog", job_env(site, 1, 0, 0, "root", gpus="1")).returncode == 0
    lock = job_paths(site.state_root, "n1", 49).lease_state.with_name("state.json.lock")
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a stuck lease user holds the node's lease state
        started = time.monotonic()
        out = run_hook("prolog", env)
        took = time.monotonic() - started
        assert out.returncode == 0 and "job 49: leases: did not finish within 0.5 s" in out.stderr
        assert took < 5
        assert (job_paths(site.state_root, "n1", 49).grantdir / "job-49.jwt").exists()
        site.configure("step_seconds = 0.5", 'fatal = ["leases"]')
        assert run_hook("prolog", env).returncode == 1
    finally:
        os.close(fd)


@pytest.mark.machine_may_lack("a writable cgroup v2 hierarchy")
def test_a_delegated_cgroup_is_given_to_the_job_user(site: Site, test_user: JobUser) -> None:
    if not os.access(CGROUP2 / "cgroup.procs", os.W_OK):
        pytest.skip(f"no writable cgroup v2 at {CGROUP2}")
    parent = CGROUP2 / f"sf-test-{uuid.uuid4().hex[:8]}"
    site.configure("delegate_cgroup = true", f'cgroup_parent = "{parent}"')
    env = job_env(site, 50, test_user.uid, test_user.gid, test_user.name)
    try:
        assert run_hook("prolog", env, umask=0o077).returncode == 0
        cgroup = parent / "n1" / "job_50"
        assert stat.S_IMODE(os.stat(parent / "n1").st_mode) == 0o755
        assert os.stat(cgroup).st_uid == test_user.uid
        for name in ("cgroup.procs", "cgroup.subtree_control", "cgroup.threads"):
            assert os.stat(cgroup / name).st_uid == test_user.uid
        assert os.stat(cgroup / "cgroup.kill").st_uid == 0  # only the delegation files
        record = job_paths(site.state_root, "n1", 50).cgroup_file
        assert record.read_text() == f"{cgroup}\n" and owned(record, 0, 0o644)
        choice = delegated_root(record, CGROUP2, 50)  # what the Slurm home makes of it
        assert choice is not None and choice.path == cgroup, choice
    finally:
        for path in (parent / "n1" / "job_50", parent / "n1", parent):
            if path.exists():
                path.rmdir()


def test_help_teaches_and_json_reports(site: Site) -> None:
    out = run_hook("prolog", {}, "--help")
    assert out.returncode == 0 and "PrologFlags=Alloc" in out.stdout and "fatal" in out.stdout
    assert run_hook("prolog", {}, "--bogus").returncode == 2
    out = run_hook("prolog", {"SLURM_FIBER_CONFIG": str(site.config)}, "--json", "--no-syslog")
    doc = json.loads(out.stdout.splitlines()[-1])
    assert doc["exit"] == 0 and doc["failed"] == {
        "job": "SLURM_JOB_ID is not set: not running under Slurm for a job?"}


def test_job_party_names_cluster_and_job() -> None:
    from slurm_fiber.homes.slurm.jobenv import job_from_env

    job = job_from_env({"SLURM_JOB_ID": "5", "SLURM_JOB_UID": "0", "SLURM_JOB_GID": "0",
                        "SLURM_JOB_USER": "root", "SLURM_JOB_PARTITION": "p",
                        "SLURMD_NODENAME": "n1", "SLURM_CLUSTER_NAME": "c"})
    assert job_party(job).session == "slurm-job:c:5"


def test_another_users_leftovers_under_a_reused_job_id_are_cleared(site: Site,
                                                                   test_user: JobUser) -> None:
    root_env = job_env(site, 51, 0, 0, "root")
    assert run_hook("prolog", root_env).returncode == 0  # root's job 51; its epilog never ran
    paths = job_paths(site.state_root, "n1", 51)
    (paths.grantdir / "stale.jwt").write_text("a token of the old job")
    os.chown(paths.state_dir, 65534, 65534)  # a job of another user left it
    env = job_env(site, 51, test_user.uid, test_user.gid, test_user.name)
    assert run_hook("prolog", env).returncode == 0
    assert sorted(p.name for p in paths.grantdir.iterdir()) == ["job-51.jwt"]
    assert owned(paths.state_dir, test_user.uid, 0o700)
    (paths.state_dir / "keep").write_text("the job's own")
    assert run_hook("prolog", env).returncode == 0  # its own dir too: moved aside, never reused
    assert not (paths.state_dir / "keep").exists() and owned(paths.state_dir, test_user.uid, 0o700)
    assert sorted(p.name for p in paths.grantdir.iterdir()) == ["job-51.jwt"]


def test_a_strict_umask_still_lets_the_job_user_reach_its_dirs(site: Site,
                                                               test_user: JobUser) -> None:
    env = job_env(site, 52, test_user.uid, test_user.gid, test_user.name, gpus="0")
    assert run_hook("prolog", env, umask=0o077).returncode == 0
    paths = job_paths(site.state_root, "n1", 52)
    for parent in (site.state_root, site.state_root / "nodes", paths.state_dir.parent.parent,
                   paths.state_dir.parent):
        assert owned(parent, 0, 0o755), parent
    assert owned(paths.grantdir, test_user.uid, 0o700)
    assert owned(paths.lease_dir, 0, 0o755)  # root's alone, readable by the job user
