"""The job's state dir and grantdir, made by root for the job user without following links.

The state root and the per-node directories above a job's state dir belong
to root and must not be writable by anyone else (``check_parent``, which
walks the whole path with safefs.open_dir), so no job user can swap a path
component. The job's own directories (``paths.job_paths``: state dir and
grantdir) are created, or taken over when a previous prolog of the job
made them, through directory file descriptors opened with O_NOFOLLOW, then
given to the job user with mode 0700 (not readable, let alone writable, by
others): a symlink planted by a user is refused, never followed. Files are
written with safefs.write_atomic relative to a directory fd checked to be
the job user's or root's (``write_file``). Blocking file I/O; errors are
OSError (UnsafePath) with the path in the message.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from slurm_fiber import safefs
from slurm_fiber.homes.slurm.paths import JobPaths
from slurm_fiber.safefs import DIR_FLAGS, UnsafePath

JOB_DIR_MODE = 0o700
ROOT_DIR_MODE = 0o755

__all__ = ["UnsafePath", "check_parent", "clear_foreign", "make_job_dirs", "own_dir",
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
        import shutil  # rare (a reused job id): shutil imports bz2, lzma and zlib

        shutil.rmtree(name, dir_fd=parent_fd)
    else:
        os.unlink(name, dir_fd=parent_fd)
    return True


def make_job_dirs(paths: JobPaths, uid: int, gid: int) -> None:
    """Create the job's state dir and grantdir owned by uid:gid (0700). Idempotent.

    A state dir left by another user under the same job id (an epilog that
    never ran) is removed first, so none of its grants can reach this job.
    """
    jobs_fd = check_parent(paths.state_dir.parent)
    try:
        clear_foreign(jobs_fd, paths.state_dir.name, uid)
        state_fd = own_dir(jobs_fd, paths.state_dir.name, uid, gid)
        try:
            os.close(own_dir(state_fd, paths.grantdir.name, uid, gid))
        finally:
            os.close(state_fd)
    finally:
        os.close(jobs_fd)


def write_file(directory: Path, name: str, data: bytes, *, dir_owner: int, uid: int, gid: int,
               mode: int) -> None:
    """Replace ``directory``/``name`` with ``data`` atomically, owned by uid:gid with ``mode``.

    ``directory`` must be root's or ``dir_owner``'s all the way from "/" and
    writable by no one else (safefs.open_dir); whatever ``name`` is (a
    planted link, a FIFO) is replaced, never followed. Raises OSError
    (UnsafePath for a directory that cannot be trusted).
    """
    dir_fd = safefs.open_dir(directory, trusted_owners=(dir_owner,))
    try:
        safefs.write_atomic(dir_fd, name, data, mode=mode, uid=uid, gid=gid)
    finally:
        os.close(dir_fd)
