"""The epilog's keeping of a job's audit log: a checked copy, root's, and what it shows.

A Slurm job's fiberd runs as the job user and writes its audit log in the job's state
dir, which that user owns: they can forge it, remove it, or put a link, a FIFO or a
directory in its place. ``keep_job_audit`` never moves or follows what is there. It
opens the log through ``slurm_fiber.safefs`` (the state dir walked from "/", the log a
regular file of one link owned by the job user (or root), opened without following a link or
blocking on a FIFO), copies at most ``KEEP_MAX_BYTES`` of it into a new root-owned
0600 file in root's ``<state root>/nodes/<node>/audit/`` (``job-<id>.jsonl``, numbered
when a later run for the same job keeps another), and writes beside it
``job-<id>[.n].keep.json``: size, SHA-256, whether it was cut, the job user's uid, and
``core.audit.check_chain``'s reading (sequence, chain, stop record). An inconsistent
log is kept all the same and said in one note (syslog). Anything but a regular file is
dropped (its name taken out of the way inside the state dir, so the state dir step
removes the rest) and reported; nothing of it reaches root's directory.

What it cannot do: tell the job user's forgery from fiberd's record. The copy is the
job user's testimony, made root's only so that nobody changes it after the job; a
consistent chain shows only that nothing which did not rewrite the whole chain
changed it (docs/design.md, threat model, rule 12). Bounded: at most
``KEEP_MAX_BYTES`` read, and a temporary file never outlives a failed or timed-out
step.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import time
from pathlib import Path

from slurm_fiber import safefs
from slurm_fiber.core.audit.log import ChainCheck, check_chain
from slurm_fiber.homes.slurm.jobenv import SlurmJob
from slurm_fiber.homes.slurm.paths import node_dir
from slurm_fiber.hooks.hook import Hook

AUDIT_NAME = "audit.jsonl"
KEEP_MAX_BYTES = 64 << 20
_CHUNK = 1 << 20


def keep_job_audit(hook: Hook, state_dir: Path, state_root: Path, job: SlurmJob) -> Path | None:
    """Keep a checked copy of the job's audit log (module doc); where it went, None when
    there was none. An inconsistent log is kept and warned of through ``hook``. Raises
    OSError (one line) when it cannot be kept: the entry was not a regular file of one
    link owned by the job user ("dropped"), or root's audit dir is unusable."""
    try:
        state_fd = safefs.open_dir(state_dir, trusted_owners=(job.uid,))
    except FileNotFoundError:
        return None
    try:
        if not _exists(state_fd, AUDIT_NAME):
            return None
        audit_dir = node_dir(state_root, job.node) / "audit"
        dir_fd = safefs.open_dir(audit_dir, create_mode=0o700)
        try:
            try:
                src = safefs.open_file(state_fd, AUDIT_NAME, os.O_RDONLY, owners=(job.uid, 0))
            except FileNotFoundError:
                return None
            except safefs.UnsafePath as err:
                _take_aside(state_fd)
                raise OSError(errno.EINVAL, f"not the job user's regular file of one link; "
                              f"dropped ({err})", str(state_dir / AUDIT_NAME)) from None
            try:
                return _keep(hook, src, dir_fd, audit_dir, state_dir, job)
            finally:
                os.close(src)
        finally:
            os.close(dir_fd)
    finally:
        os.close(state_fd)


def _take_aside(state_fd: int) -> None:
    """Rename the bad entry inside the job's state dir (never followed), so the state dir
    step removes it with the rest."""
    with contextlib.suppress(OSError):
        os.rename(AUDIT_NAME, f".{AUDIT_NAME}.dropped-{os.urandom(4).hex()}",
                  src_dir_fd=state_fd, dst_dir_fd=state_fd)


def _keep(hook: Hook, src: int, dir_fd: int, audit_dir: Path, state_dir: Path,
          job: SlurmJob) -> Path:
    name = _free_name(dir_fd, job.job_id)
    tmp = f".{name}.{os.urandom(6).hex()}.tmp"
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                  0o600, dir_fd=dir_fd)
    try:
        try:
            size, digest, cut, check = _copy(src, out)
            os.fchmod(out, 0o600)
            os.fsync(out)
        finally:
            os.close(out)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:  # a failure or the step's timeout: no temporary file stays
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    record = {
        "job": job.job_id, "node": job.node, "source": str(state_dir / AUDIT_NAME),
        "kept_as": name, "kept_at": round(time.time(), 6), "bytes": size,
        "sha256": digest, "cut_at": KEEP_MAX_BYTES if cut else None,
        "written_by": {"uid": job.uid, "user": job.user,
                       "trust": "the job user's own account wrote this log: what it "
                                "says is theirs to say; the chain shows only changes "
                                "made without rewriting it whole"},
        "check": check.to_json(),
    }
    safefs.write_atomic(dir_fd, name.removesuffix(".jsonl") + ".keep.json",
                        (json.dumps(record, indent=1) + "\n").encode(), mode=0o600)
    if cut or not check.consistent:
        why = ([f"cut at {KEEP_MAX_BYTES} bytes"] if cut else []) + check.problems[:3] + (
            [] if check.stopped else ["no stop record at its end"])
        hook.note("audit", f"kept {audit_dir / name}, not consistent: {'; '.join(why)}")
    return audit_dir / name


def _free_name(dir_fd: int, job_id: int) -> str:
    name = f"job-{job_id}.jsonl"
    n = 0
    while _exists(dir_fd, name):
        n += 1
        name = f"job-{job_id}.{n}.jsonl"
    return name


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _copy(src: int, out: int) -> tuple[int, str, bool, ChainCheck]:
    """Copy at most KEEP_MAX_BYTES of ``src`` to ``out``; size, SHA-256, whether it was cut,
    and the chain check of the lines copied."""
    hasher = hashlib.sha256()
    size = 0
    rest = b""
    lines: list[bytes] = []
    while size < KEEP_MAX_BYTES:
        chunk = os.read(src, min(_CHUNK, KEEP_MAX_BYTES - size))
        if not chunk:
            break
        view = memoryview(chunk)
        while view:
            view = view[os.write(out, view):]
        hasher.update(chunk)
        size += len(chunk)
        parts = (rest + chunk).split(b"\n")
        rest = parts.pop()
        lines.extend(parts)
    cut = size >= KEEP_MAX_BYTES and bool(os.read(src, 1))
    if rest:
        lines.append(rest)
    return size, hasher.hexdigest(), cut, check_chain(lines)
