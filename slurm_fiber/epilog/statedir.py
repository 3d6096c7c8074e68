"""The epilog's side of a job's state dir: taken out of reach first, removed in bounded steps.

The job user owns the state dir, so root never walks it by path. At the
epilog's first step the whole state dir is renamed, as an entry of the
root-owned ``jobs/`` dir, into the node's retired area (hooks.retire): the
job id's name is free at once (a later job with the same id is never
blocked by what this one left), and the grantdir inside is renamed up into
the area and removed there, so a fiberd still running sees its grants go.
The later steps read the retired copy (fiberd's record, the audit log)
through root's 0700 area, where it is *busy*: another job's epilog sweeping
the area meanwhile leaves it alone for the epilog's whole bound. The last
step removes it, and then what earlier epilogs left in the area, until a
deadline: a tree of any depth or width costs at most the step's bound, and
what is left (its busy mark dropped) waits for the next epilog.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from slurm_fiber import safefs
from slurm_fiber.homes.slurm.paths import JobPaths
from slurm_fiber.hooks.retire import (
    AREA_NAME,
    KEPT_PREFIX,
    open_area,
    remove_entry,
    remove_some,
    retire,
    settle,
)
from slurm_fiber.safefs import DIR_FLAGS, UnsafePath


def _root_dir(parent_fd: int, name: str) -> int | None:
    """``name`` in ``parent_fd`` opened as a directory root owns and no one else can write;
    None when it does not exist. Raises UnsafePath otherwise."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise UnsafePath(f"{safefs.fd_path(parent_fd, name)}: not a directory "
                         f"({err.strerror})") from None
    st = os.fstat(fd)
    if st.st_uid != 0 or st.st_mode & 0o022:
        os.close(fd)
        raise UnsafePath(f"{safefs.fd_path(parent_fd, name)} is not root's alone "
                         f"(uid {st.st_uid}, mode {st.st_mode & 0o7777:04o})")
    return fd


def retire_state_dir(paths: JobPaths, job_id: int, seconds: float) -> Path | None:
    """Move the job's state dir into the node's retired area and remove its grantdir there
    (for at most ``seconds``); where the state dir now is (None: there was none).

    Raises OSError (UnsafePath) when the node's directories cannot be trusted.
    """
    deadline = time.monotonic() + seconds
    node = paths.state_dir.parent.parent
    try:
        node_fd = safefs.open_dir(node)
    except FileNotFoundError:
        return None
    try:
        jobs_fd = _root_dir(node_fd, paths.state_dir.parent.name)
        if jobs_fd is None:
            return None
        try:
            area_fd = open_area(node_fd)
            try:
                name = retire(jobs_fd, paths.state_dir.name, area_fd, f"job-{job_id}",
                              busy=True)
                if name is not None:
                    _drop_grants(area_fd, name, job_id, paths.grantdir.name, deadline)
            finally:
                os.close(area_fd)
        finally:
            os.close(jobs_fd)
    finally:
        os.close(node_fd)
    return None if name is None else node / AREA_NAME / name


def _drop_grants(area_fd: int, name: str, job_id: int, grants: str, deadline: float) -> None:
    """Rename the grantdir of retired state dir ``name`` up into the area and remove it."""
    try:
        state_fd = os.open(name, DIR_FLAGS, dir_fd=area_fd)
    except OSError:  # not a directory (only root could have made it one): removed later
        return
    try:
        moved = retire(state_fd, grants, area_fd, f"job-{job_id}-grants")
    finally:
        os.close(state_fd)
    if moved is not None:
        with contextlib.suppress(OSError):
            remove_entry(area_fd, moved, deadline)


def remove_retired(paths: JobPaths, first: str | None, seconds: float,
                   spare_seconds: float) -> bool:
    """Remove ``first`` from the node's retired area, then what earlier runs left there
    (never a busy entry younger than ``spare_seconds``: another epilog still reads it),
    for at most ``seconds``; whether ``first`` is gone (True when None). A ``first`` left
    is settled, so that the next epilog goes on with it."""
    deadline = time.monotonic() + seconds
    try:
        node_fd = safefs.open_dir(paths.state_dir.parent.parent)
    except FileNotFoundError:
        return True
    try:
        area_fd = _root_dir(node_fd, AREA_NAME)
    finally:
        os.close(node_fd)
    if area_fd is None:
        return True
    try:
        if first is not None and not remove_entry(area_fd, first, deadline):
            settle(area_fd, first)
            return False
        remove_some(area_fd, deadline, spare_seconds)
        return True
    finally:
        os.close(area_fd)


def keep_retired(retired: Path) -> Path:
    """Rename retired state dir ``retired`` to ``kept-<name>`` in its area, which no
    removal touches (an admin looks at it); its new path."""
    area_fd = safefs.open_dir(retired.parent)
    try:
        return retired.parent / settle(area_fd, retired.name, KEPT_PREFIX)
    finally:
        os.close(area_fd)
