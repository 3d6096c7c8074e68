"""Finding (issue 38, medium): the job user owns the audit log, and the epilog kept it as root's.

``mallory``'s fiberd writes its audit log in her job's state dir, which she owns: she
can forge it, remove it or make it a directory, and the epilog renamed whatever was
there into root's audit directory and made it root's. Now the epilog copies only a
regular file of one link (hooks/auditkeep.py), never what else is there, and records
beside the copy, root's, what it is: the job user's account, its size and SHA-256,
and whether its chain of records holds (core/audit.py: a line edited or removed by
anything that did not rewrite the whole chain shows). The epilog run is the real
console script, as slurmd runs it.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.core.audit.log import AuditLog
from slurm_fiber.homes.slurm.paths import job_paths
from tests.hooks.hookkit import Site, job_env, run_hook
from tests.security.publicdirkit import public_dir
from tests.security.userkit import JobUser


@pytest.fixture
def site() -> Iterator[Site]:
    with public_dir() as scratch:
        yield Site(scratch / "site")


def as_mallory(mallory: JobUser, where: Path, script: str) -> None:
    done = subprocess.run(["/bin/sh", "-c", f"cd '{where}' && {script}"], capture_output=True,
                          text=True, timeout=60, **mallory.spawn_args())
    assert done.returncode == 0, done.stderr


def genuine_log(site: Site) -> Path:
    """A log as fiberd writes one (start, a few decisions, stop), readable by mallory."""
    path = site.root / "genuine.jsonl"
    log = AuditLog(path, "never")
    log.write("start", pid=1)
    for n in range(5):
        log.write("clone", uid="g1", fiber=f"f{n}")
    log.write("stop", reason="stop requested")
    log.close()
    path.chmod(0o644)
    return path


def epilog(site: Site, mallory: JobUser, job: int) -> tuple[subprocess.CompletedProcess[str],
                                                             Path]:
    env = job_env(site, job, mallory.uid, mallory.gid, mallory.name)
    return run_hook("epilog", env | {"SLURM_SCRIPT_CONTEXT": "epilog_slurmd"}), \
        site.state_root / "nodes" / "n1" / "audit"


def prolog(site: Site, mallory: JobUser, job: int) -> Path:
    env = job_env(site, job, mallory.uid, mallory.gid, mallory.name)
    assert run_hook("prolog", env).returncode == 0
    return job_paths(site.state_root, "n1", job).state_dir


def test_hostile_audit_log_made_a_directory_never_reaches_roots_audit_dir(
        site: Site, mallory: JobUser) -> None:
    state_dir = prolog(site, mallory, 31)
    as_mallory(mallory, state_dir, "mkdir audit.jsonl && echo forged > audit.jsonl/x")
    out, audit_dir = epilog(site, mallory, 31)
    assert out.returncode == 0, out.stderr
    assert "job 31: audit: " in out.stderr and "dropped" in out.stderr
    assert [p.name for p in audit_dir.iterdir()] == []  # nothing of hers is root's
    assert not state_dir.exists()


def test_hostile_forged_audit_log_is_kept_as_hers_with_the_forgery_shown(
        site: Site, mallory: JobUser) -> None:
    state_dir = prolog(site, mallory, 32)
    genuine = genuine_log(site)
    # mallory puts fiberd's log in place, then removes the record of fiber f2.
    as_mallory(mallory, state_dir, f"cat '{genuine}' > audit.jsonl && "
                                   "grep -v '\"fiber\":\"f2\"' audit.jsonl > t && mv t audit.jsonl")
    out, audit_dir = epilog(site, mallory, 32)
    assert out.returncode == 0, out.stderr
    kept = audit_dir / "job-32.jsonl"
    assert kept.stat().st_uid == 0 and kept.stat().st_mode & 0o777 == 0o600
    record = json.loads((audit_dir / "job-32.keep.json").read_text())
    assert record["written_by"]["uid"] == mallory.uid
    assert record["bytes"] == kept.stat().st_size
    check = record["check"]
    assert check["consistent"] is False and check["ends_with_stop"] is True, check
    assert any("follows" in p for p in check["problems"]), check
    assert any("does not chain" in p for p in check["problems"]), check


def test_a_genuine_audit_log_is_kept_and_read_consistent(site: Site, mallory: JobUser) -> None:
    state_dir = prolog(site, mallory, 33)
    genuine = genuine_log(site)
    as_mallory(mallory, state_dir, f"cat '{genuine}' > audit.jsonl")
    out, audit_dir = epilog(site, mallory, 33)
    assert (out.returncode, out.stderr) == (0, "")
    record = json.loads((audit_dir / "job-33.keep.json").read_text())
    assert record["check"] == {"lines": 7, "first_seq": 1, "last_seq": 7,
                               "ends_with_stop": True, "consistent": True, "problems": []}
    assert (audit_dir / "job-33.jsonl").read_bytes() == genuine.read_bytes()
