"""Moving a directory a job user owns (or has owned) out of reach, and removing it in bounded steps.

Root never walks a path below a directory a job user owns or has owned: the
user could swap any name in it for a link, plant a tree 3,000 deep or 200,000
files wide, or keep writing into it through a descriptor held from another
job. ``retire`` therefore takes such a directory away in one rename: the
entry moves from a root-owned parent (opened and checked by the caller) into
the node's retired area (``<node dir>/retired``, root's, mode 0700, made and
checked by ``open_area``). The name is free at once for a later job with the
same id, and from then on nobody but root reaches the tree by a path.

An epilog retires its job's state dir *busy* (``busy-<unix time>-<label>.<random>``):
it still reads the job's audit log from there, so another epilog's sweep of
the area (``remove_some``) leaves a busy entry alone for ``spare_seconds``
(the epilog's whole bound), and the epilog itself either removes it or
``settle``s it (the busy mark dropped, or ``kept-`` put in its place) before
it ends. A busy entry whose epilog died is swept once its time has passed.

``remove_some`` removes what the area holds, oldest work first, until a
deadline: only through directory fds opened with O_NOFOLLOW|O_DIRECTORY
relative to fds it holds (a link is unlinked, never followed; ``..`` is
never used), holding at most MAX_DEPTH of them (a deeper directory is
renamed up into the area and removed as an entry of its own). Whatever is
left at the deadline stays in the area for the next call: no tree, however
deep or wide, makes it overrun or fail. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time

from slurm_fiber.safefs import DIR_FLAGS, UnsafePath

AREA_NAME = "retired"
KEPT_PREFIX = "kept-"  # entries an admin must look at (an audit log that could not be moved)
BUSY_PREFIX = "busy-"  # entries an epilog still reads: busy-<unix time>-<label>.<random>
AREA_MODE = 0o700
MAX_DEPTH = 32  # directory fds held at once while removing one tree


def open_area(node_fd: int) -> int:
    """The retired area below the node dir ``node_fd`` (created root's, 0700); its fd.

    ``node_fd`` must be a directory root owns and nobody else can write (the
    caller checked it). Raises UnsafePath when the area is not root's own
    directory.
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(AREA_NAME, AREA_MODE, dir_fd=node_fd)
    try:
        fd = os.open(AREA_NAME, DIR_FLAGS, dir_fd=node_fd)
    except OSError as err:
        raise UnsafePath(f"{AREA_NAME}: not a directory root can use ({err.strerror})") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != 0:
            raise UnsafePath(f"the retired area is owned by uid {st.st_uid}, not root")
        os.fchmod(fd, AREA_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def retire(parent_fd: int, name: str, area_fd: int, label: str, *, busy: bool = False
           ) -> str | None:
    """Rename ``name`` of ``parent_fd`` (whatever it is) into the area as ``<label>.<random>``
    (``busy-<unix time>-<label>.<random>`` when ``busy``); its new name, or None when there
    was nothing to move. Raises OSError otherwise."""
    new = f"{label}.{os.urandom(6).hex()}"
    if busy:
        new = f"{BUSY_PREFIX}{int(time.time())}-{new}"
    try:
        os.rename(name, new, src_dir_fd=parent_fd, dst_dir_fd=area_fd)
    except FileNotFoundError:
        return None
    return new


def settle(area_fd: int, name: str, prefix: str = "") -> str:
    """Rename busy entry ``name`` of the area to ``prefix`` + its name without the busy mark
    (any epilog's sweep then takes it, or none when ``prefix`` is ``kept-``); the new name."""
    plain = name.split("-", 2)[2] if name.startswith(BUSY_PREFIX) else name
    os.rename(name, prefix + plain, src_dir_fd=area_fd, dst_dir_fd=area_fd)
    return prefix + plain


def is_spared(name: str, spare_seconds: float, now: float) -> bool:
    """Whether a sweep leaves entry ``name`` alone: ``kept-*``, or busy and retired less
    than ``spare_seconds`` before ``now`` (a time from the future counts as passed)."""
    if name.startswith(KEPT_PREFIX):
        return True
    if not name.startswith(BUSY_PREFIX):
        return False
    stamp = name[len(BUSY_PREFIX):].split("-", 1)[0]
    return stamp.isdigit() and 0 <= now - int(stamp) < spare_seconds


def remove_some(area_fd: int, deadline: float, spare_seconds: float = 0.0) -> bool:
    """Remove entries of the area, in name order, until ``deadline`` (time.monotonic()),
    leaving those ``is_spared``; whether nothing else is left. Never raises for what an
    entry holds: what cannot be removed now is left for a later call. Entries made
    meanwhile (a deep directory moved up) are taken in the next round."""
    while time.monotonic() < deadline:
        names = _sweepable(area_fd, spare_seconds)
        if not names:
            return True
        for name in names:
            if time.monotonic() >= deadline:
                break
            with contextlib.suppress(OSError):
                remove_entry(area_fd, name, deadline)
    return not _sweepable(area_fd, spare_seconds)


def _sweepable(area_fd: int, spare_seconds: float) -> list[str]:
    """The area's entries a sweep removes now, sorted."""
    now = time.time()
    with os.scandir(area_fd) as entries:
        return sorted(e.name for e in entries if not is_spared(e.name, spare_seconds, now))


def remove_entry(area_fd: int, name: str, deadline: float) -> bool:
    """Remove ``name`` of the area, whatever it is, until ``deadline``; whether it is gone.
    Raises OSError when it cannot even be opened."""
    try:
        os.unlink(name, dir_fd=area_fd)  # a file, a link, a FIFO: never followed
        return True
    except FileNotFoundError:
        return True
    except OSError as err:
        if err.errno not in (errno.EISDIR, errno.EPERM):
            raise
    stack: list[tuple[int, str]] = [(os.open(name, DIR_FLAGS, dir_fd=area_fd), name)]
    try:
        while stack:
            if time.monotonic() >= deadline:
                return False
            top, top_name = stack[-1]
            child = _empty_some(top, area_fd, len(stack), deadline)
            if child is not None:
                with contextlib.suppress(OSError):  # swapped for a link or gone: look again
                    stack.append((os.open(child, DIR_FLAGS, dir_fd=top), child))
                continue
            os.close(stack.pop()[0])
            parent = stack[-1][0] if stack else area_fd
            try:
                os.rmdir(top_name, dir_fd=parent)
            except FileNotFoundError:
                pass
            except OSError as err:
                if err.errno != errno.ENOTEMPTY or not stack:
                    return False  # refilled through a held descriptor: a later call
        return True
    finally:
        for fd, _ in stack:
            os.close(fd)


def _empty_some(dir_fd: int, area_fd: int, depth: int, deadline: float) -> str | None:
    """Unlink the non-directories of ``dir_fd``; the first sub-directory to descend into
    (None when none is left, or at the deadline). Below MAX_DEPTH a sub-directory is
    renamed up into the area instead, to be removed as an entry of its own."""
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if time.monotonic() >= deadline:  # an unlink can take milliseconds under load
                return None
            try:
                os.unlink(entry.name, dir_fd=dir_fd)
                continue
            except FileNotFoundError:
                continue
            except OSError as err:
                if err.errno not in (errno.EISDIR, errno.EPERM):
                    continue
            if depth < MAX_DEPTH:
                return entry.name
            with contextlib.suppress(OSError):
                os.rename(entry.name, f"deep.{os.urandom(6).hex()}", src_dir_fd=dir_fd,
                          dst_dir_fd=area_fd)
    return None
