"""The job's state dir and grantdir: made and filled by root, handed to the job user last.

The state root and the per-node directories above a job's state dir belong
to root and must not be writable by anyone else (``check_parent``, which
walks the whole path with safefs.open_dir), so no job user can swap a path
component. Below them the rule is: root never creates, opens or writes
below a directory a job user owns or has owned. So ``make_job_dirs`` first
moves whatever a job id's name holds (a previous run's dirs, another user's
leftovers) into the node's retired area (hooks.retire), then creates the
state dir and grantdir as root's, mode 0700, and keeps directory fds of
both (``JobDirs``). Every file the prolog places (tokens, the cgroup record)
is written through those fds while they are still root's
(safefs.write_atomic), and ``hand_over`` gives both to the job user last
(fchown/fchmod on the fds, the grantdir first). A job user can act on the
directories only once root is done with them. Blocking file I/O; errors are
OSError (UnsafePath) with the path in the message.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from slurm_fiber import safefs
from slurm_fiber.homes.slurm.paths import JobPaths
from slurm_fiber.hooks.retire import open_area, retire
from slurm_fiber.safefs import DIR_FLAGS, UnsafePath

JOB_DIR_MODE = 0o700
ROOT_DIR_MODE = 0o755

__all__ = ["JobDirs", "UnsafePath", "check_parent", "hand_over", "make_job_dirs",
           "write_file"]


def check_parent(path: Path) -> int:
    """Create ``path`` and its missing parents (root, 0755 whatever slurmd's umask); refuse
    it unless every directory from "/" is root's and writable by no one else. Its fd (the
    caller closes it)."""
    missing = [p for p in (*reversed(path.parents), path) if not os.path.lexists(p)]
    for created in missing:
        with contextlib.suppress(FileExistsError):
            os.mkdir(created, ROOT_DIR_MODE)
            os.chmod(created, ROOT_DIR_MODE)
    return safefs.open_dir(path, trusted_owners=(os.geteuid(),))


@dataclass
class JobDirs:
    """Root's fds of a job's new state dir and grantdir (root's until ``hand_over``), and
    what ``make_job_dirs`` moved aside (the retired name, or None)."""

    state_fd: int
    grant_fd: int
    retired: str | None = None

    def close(self) -> None:
        """Close both fds (idempotent)."""
        for fd in (self.state_fd, self.grant_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.state_fd = self.grant_fd = -1


def _root_dir(parent_fd: int, name: str) -> int:
    """Make directory ``name`` in ``parent_fd`` (root's, 0700; it must not exist); its fd."""
    os.mkdir(name, JOB_DIR_MODE, dir_fd=parent_fd)
    fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            raise UnsafePath(f"{safefs.fd_path(fd)}: replaced while being made")
        os.fchmod(fd, JOB_DIR_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_job_dirs(paths: JobPaths, job_id: int) -> JobDirs:
    """Create the job's state dir and grantdir, both root's (0700), after moving whatever
    was at the state dir's name into the node's retired area. The caller hands them over
    (``hand_over``) and closes them.

    A state dir left by an earlier run for the same job id (of this user or another, an
    epilog that never ran, this prolog run twice) is never reused: nothing of it can
    reach this job, and root never writes below a directory a user had.
    """
    node_fd = check_parent(paths.state_dir.parent.parent)
    try:
        jobs_fd = check_parent(paths.state_dir.parent)
        try:
            area_fd = open_area(node_fd)
            try:
                retired = retire(jobs_fd, paths.state_dir.name, area_fd, f"job-{job_id}")
            finally:
                os.close(area_fd)
            state_fd = _root_dir(jobs_fd, paths.state_dir.name)
            try:
                grant_fd = _root_dir(state_fd, paths.grantdir.name)
            except BaseException:
                os.close(state_fd)
                raise
            return JobDirs(state_fd, grant_fd, retired)
        finally:
            os.close(jobs_fd)
    finally:
        os.close(node_fd)


def hand_over(dirs: JobDirs, uid: int, gid: int) -> None:
    """Give the grantdir, then the state dir, to uid:gid (mode 0700), through their fds."""
    for fd in (dirs.grant_fd, dirs.state_fd):
        os.fchown(fd, uid, gid)
        os.fchmod(fd, JOB_DIR_MODE)


def write_file(dir_fd: int, name: str, data: bytes, *, uid: int, gid: int, mode: int) -> None:
    """Replace ``name`` in root's directory ``dir_fd`` with ``data`` atomically, owned by
    uid:gid with ``mode``. Refuses (UnsafePath) a directory root no longer owns: it may
    already be the job user's."""
    if os.fstat(dir_fd).st_uid != os.geteuid():
        raise UnsafePath(f"{safefs.fd_path(dir_fd)} is no longer root's; nothing is "
                         "written below a directory a job user owns")
    safefs.write_atomic(dir_fd, name, data, mode=mode, uid=uid, gid=gid)
