"""The job's state dir and grantdir, made by root for the job user without following links.

The state root and the per-node directories above a job's state dir belong
to root and must not be writable by anyone else (``check_parent``), so no
job user can swap a path component. The job's own directories
(``paths.job_paths``: state dir and grantdir) are created, or taken over
when a previous prolog of the job made them, through directory file
descriptors opened with O_NOFOLLOW, then given to the job user with mode
0700 (not readable, let alone writable, by others): a symlink planted by a
user is refused, never followed. Files are written the same way
(``write_file``): a temporary file opened O_EXCL|O_NOFOLLOW in the directory,
then renamed over the target. Blocking file I/O; errors are OSError (or
UnsafePath) with the path in the message.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from pathlib import Path

from slurm_fiber.homes.slurm.paths import JobPaths

JOB_DIR_MODE = 0o700
ROOT_DIR_MODE = 0o755
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(OSError):
    """A directory on the job's path is not what the prolog can trust (a link, foreign owner)."""


def check_parent(path: Path) -> None:
    """Create ``path`` (root, 0755 whatever slurmd's umask) if missing; refuse it unless a
    root-owned dir not writable by group or others."""
    try:
        path.mkdir(mode=ROOT_DIR_MODE, parents=True)
        os.chmod(path, ROOT_DIR_MODE)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path} is not a directory (a symlink?)")
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePath(f"{path} must be owned by uid {os.geteuid()} and not writable by "
                         f"others (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")


def own_dir(parent_fd: int, name: str, uid: int, gid: int) -> int:
    """Create or take over directory ``name`` in ``parent_fd`` for uid:gid, mode 0700.

    Returns an fd of the directory (the caller closes it). Raises UnsafePath
    when ``name`` is a symlink or not a directory.
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, JOB_DIR_MODE, dir_fd=parent_fd)
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as err:
        raise UnsafePath(f"{name}: not a directory the prolog can use ({err.strerror})") from None
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, JOB_DIR_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


def clear_foreign(parent_fd: int, name: str, uid: int) -> bool:
    """Remove ``name`` in ``parent_fd`` unless it is a directory of ``uid`` (or root's, a
    prolog's first step): another user's leftovers under a reused job id. True if removed."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode) and st.st_uid in (uid, 0):
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=parent_fd)
    else:
        os.unlink(name, dir_fd=parent_fd)
    return True


def make_job_dirs(paths: JobPaths, uid: int, gid: int) -> None:
    """Create the job's state dir and grantdir owned by uid:gid (0700). Idempotent.

    A state dir left by another user under the same job id (an epilog that
    never ran) is removed first, so none of its grants can reach this job.
    """
    jobs = paths.state_dir.parent
    for parent in (*reversed(jobs.parents[:3]), jobs):
        check_parent(parent)
    jobs_fd = os.open(jobs, DIR_FLAGS)
    try:
        clear_foreign(jobs_fd, paths.state_dir.name, uid)
        state_fd = own_dir(jobs_fd, paths.state_dir.name, uid, gid)
        try:
            os.close(own_dir(state_fd, paths.grantdir.name, uid, gid))
        finally:
            os.close(state_fd)
    finally:
        os.close(jobs_fd)


def write_file(directory: Path, name: str, data: bytes, *, uid: int, gid: int,
               mode: int) -> None:
    """Replace ``directory``/``name`` with ``data`` atomically, owned by uid:gid with ``mode``.

    ``directory`` itself is opened without following a final symlink.
    Raises OSError (UnsafePath for a directory that is a link).
    """
    try:
        dir_fd = os.open(directory, DIR_FLAGS)
    except OSError as err:
        raise UnsafePath(f"{directory}: {err.strerror}") from None
    tmp = f".{name}.{os.urandom(6).hex()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     mode, dir_fd=dir_fd)
        try:
            os.write(fd, data)
            os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    finally:
        os.close(dir_fd)
