"""A hostile job user against a Slurm node's lease area that an older version left shared
(dir 0777 without the sticky bit, lock and audit files 0666).

``mallory`` (a real unprivileged account) plants hard links, symlinks and FIFOs, and
moves another job's lease away; root then runs what it runs on a node (the real prolog
console script as slurmd does, or an admin's ``slurm-fiber lease`` command). Each attack
must be refused or harmless, bounded in time, with a one-line message. Every root
action runs with a subprocess timeout, so a stall fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator

import pytest

from slurm_fiber.core.clock import FakeClock, SystemClock
from slurm_fiber.homes.slurm.jobenv import job_from_env
from slurm_fiber.homes.slurm.leases import job_party
from slurm_fiber.homes.slurm.paths import JobPaths, job_paths
from slurm_fiber.lease import Leases
from tests.hooks.hookkit import VENV_BIN, Site, job_env, run_hook
from tests.security.publicdirkit import public_dir
from tests.security.userkit import JobUser

BOUND_S = 20  # far above any hook's step bound: reaching it means a stall


@pytest.fixture
def site() -> Iterator[Site]:
    with public_dir() as scratch:
        yield Site(scratch / "site")


def shared_area(site: Site) -> JobPaths:
    """The node's lease area as an older slurm_fiber prepared it: everyone may write."""
    paths = job_paths(site.state_root, "n1", 1)
    paths.lease_dir.mkdir(parents=True)
    for path in (*reversed(paths.lease_dir.parents[:3]), paths.lease_dir.parent):
        path.chmod(0o755)
    paths.lease_dir.chmod(0o777)
    for name in ("state.json.lock", "audit.jsonl"):
        (paths.lease_dir / name).touch()
        (paths.lease_dir / name).chmod(0o666)
    return paths


def as_user(user: JobUser, script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with /bin/sh as ``user``; its outcome (failures are the point)."""
    return subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True,
                          timeout=BOUND_S, **user.spawn_args())


def lease_cli(paths: JobPaths, *args: str) -> subprocess.CompletedProcess[str]:
    """An admin's `slurm-fiber lease` command as root on the node's lease dir."""
    return subprocess.run([str(VENV_BIN / "slurm-fiber"), "lease", "--dir",
                           str(paths.lease_dir), *args], capture_output=True, text=True,
                          timeout=BOUND_S)


def one_line(text: str) -> None:
    assert text.strip() and "\n" not in text.strip() and "Traceback" not in text, text


def test_a_hard_link_at_the_lock_never_makes_root_chmod_its_target(site: Site,
                                                                   mallory: JobUser,
                                                                   alice: JobUser) -> None:
    paths = shared_area(site)
    victim = site.root / "victim.conf"  # a root file others may write, but not chmod
    victim.write_text("setting=1\n")
    victim.chmod(0o606)
    lock = paths.lease_dir / "state.json.lock"
    planted = as_user(mallory, f"rm -f '{lock}' && ln '{victim}' '{lock}'")
    assert planted.returncode == 0, planted.stderr
    out = run_hook("prolog", job_env(site, 11, alice.uid, alice.gid, alice.name, gpus="0"),
                   timeout=BOUND_S)
    assert victim.stat().st_mode & 0o7777 == 0o606 and victim.read_text() == "setting=1\n"
    assert out.returncode == 0
    one_line(out.stderr)
    assert "has 2 hard links" in out.stderr and "moved aside" in out.stderr


def test_a_symlink_at_the_audit_log_never_makes_root_append_to_its_target(
        site: Site, mallory: JobUser) -> None:
    paths = shared_area(site)
    victim = site.root / "profile.sh"  # sourced by an admin later
    victim.write_text("export PATH=/usr/bin\n")
    victim.chmod(0o644)
    audit = paths.lease_dir / "audit.jsonl"
    holder = json.dumps({"env": "gpu:n1:0", "holder": "x", "session": "s",
                         "purpose": "$(touch /tmp/pwned)", "since": "2026-01-01T00:00:00Z"})
    planted = as_user(mallory, f"rm -f '{audit}' && ln -s '{victim}' '{audit}' && "
                               f"mkdir '{paths.lease_dir}/gpu:n1:0' && "
                               f"printf '%s' '{holder}' > '{paths.lease_dir}/gpu:n1:0/holder.json'")
    assert planted.returncode == 0, planted.stderr
    out = lease_cli(paths, "release", "gpu:n1:0", "--force")
    assert victim.read_text() == "export PATH=/usr/bin\n"
    assert out.returncode == 1
    one_line(out.stderr)
    assert "audit.jsonl is a symbolic link" in out.stderr


def test_fifos_in_place_of_records_and_state_stall_nothing(site: Site, mallory: JobUser,
                                                           alice: JobUser) -> None:
    paths = shared_area(site)
    planted = as_user(mallory, f"cd '{paths.lease_dir}' && mkfifo state.json && "
                               "mkdir gpu:n1:1 && mkfifo gpu:n1:1/holder.json")
    assert planted.returncode == 0, planted.stderr
    ls = lease_cli(paths, "ls")  # root's ls over the planted FIFOs: answers, does not hang
    assert ls.returncode == 1
    one_line(ls.stderr)
    assert "state.json is a FIFO" in ls.stderr
    env = job_env(site, 12, alice.uid, alice.gid, alice.name, gpus="0")
    out = run_hook("prolog", env, timeout=BOUND_S)
    assert out.returncode == 0 and "did not finish" not in out.stderr, out.stderr
    one_line(out.stderr)
    assert "moved aside 2 untrusted entries" in out.stderr and "a FIFO of uid" in out.stderr
    leases = Leases(paths.lease_dir, paths.lease_state, FakeClock())
    held = leases.dir.get("gpu:n1:0")
    assert held is not None and held.party().same_as(job_party(job_from_env(env)))
    ls = lease_cli(paths, "ls")
    assert ls.returncode == 0 and "gpu:n1:0" in ls.stdout and "gpu:n1:1" not in ls.stdout


def test_another_jobs_lease_cannot_be_moved_away_and_taken(site: Site, mallory: JobUser,
                                                           alice: JobUser) -> None:
    paths = shared_area(site)
    env = job_env(site, 13, alice.uid, alice.gid, alice.name, gpus="0")
    assert run_hook("prolog", env, timeout=BOUND_S).returncode == 0
    alices = job_party(job_from_env(env))
    leases = Leases(paths.lease_dir, paths.lease_state, SystemClock())
    if leases.dir.get("gpu:n1:0") is None:  # a version whose prolog only granted: her fiberd
        from slurm_fiber.lease import Caller

        leases.claim("gpu:n1:0", Caller(alices, name="slurm job 13"), "fiberd of job 13")
    mine = json.dumps({"env": "gpu:n1:0", "holder": "slurm job 14 (sfmallory)",
                       "session": "slurm-job:citest:14", "person": mallory.name,
                       "purpose": "mine now", "since": "2026-01-01T00:00:00Z"})
    took = as_user(mallory, f"cd '{paths.lease_dir}' && mv gpu:n1:0 .gone && "
                            f"mkdir gpu:n1:0 && printf '%s' '{mine}' > gpu:n1:0/holder.json")
    assert took.returncode != 0 and "Permission denied" in took.stderr
    held = leases.dir.get("gpu:n1:0")
    assert held is not None and held.party().same_as(alices)
    assert os.stat(paths.lease_dir).st_mode & 0o7777 == 0o755
