"""Cgroup control files held open to be used again: one ``pread`` or ``write`` each time.

A leaf is handed out to fiber after fiber and read at each fiber's end, and a
template moves itself into and out of leaves to spawn exec fibers; a kept
descriptor read at offset 0 gives the file's current text, as a fresh open does
(cgroupfs files are generated on each read from the start).

- ``HeldFiles.read(group, name)`` and ``write(group, name, data)`` use ``group/name``
  through a descriptor kept for that use; at most ``groups`` groups keep theirs,
  the least recently used closed first.
- A group that was removed (or made again by the same name) fails with ENODEV
  through the old descriptor: the file is then opened afresh and used once more,
  and an error of that is raised as a plain open's or write's would be.
- ``forget(group)`` closes a group's descriptors as it is removed, so no descriptor
  outlives its group for long.
- fiberd's table is this module's (``read_held``, ``write_held``, ``forget``), behind
  a lock (the event loop reads, worker threads remove groups). A template keeps a
  table of its own for its moves, and a process forked from it closes that before
  user code. Cgroup control files do not block on I/O.
"""

from __future__ import annotations

import _thread
import os
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeVar

    T = TypeVar("T")

HELD_GROUPS = 64  # groups whose descriptors are kept (a few files each)
_CHUNK = 65536  # control files read whole: events, counters, a peak


class HeldFiles:
    """A table of kept control-file descriptors (see the module doc)."""

    def __init__(self, groups: int = HELD_GROUPS) -> None:
        self.groups = groups
        self._fds: OrderedDict[str, dict[tuple[str, int], int]] = OrderedDict()
        self._lock = _thread.allocate_lock()  # threading's, without importing threading

    def read(self, group: str, name: str) -> str:
        """The text of ``group/name`` (a directory path and a file name). Raises OSError
        as opening and reading it would."""
        return self._use(group, name, os.O_RDONLY,
                         lambda fd: os.pread(fd, _CHUNK, 0)).decode()

    def write(self, group: str, name: str, data: bytes) -> None:
        """Write ``data`` to ``group/name`` (``cgroup.procs`` ``0``: move this process
        there). Raises OSError as opening and writing it would."""
        self._use(group, name, os.O_WRONLY, lambda fd: os.write(fd, data))

    def forget(self, group: str) -> None:
        """Close ``group``'s kept descriptors (it is being removed)."""
        with self._lock:
            files = self._fds.pop(group, None)
            if files:
                _close_all(files)

    def close(self) -> None:
        """Close every kept descriptor."""
        with self._lock:
            while self._fds:
                _close_all(self._fds.popitem()[1])

    def _use(self, group: str, name: str, flags: int, use: Callable[[int], T]) -> T:
        """``use(fd)`` on the descriptor kept for ``group/name`` opened with ``flags``;
        a kept one that fails is closed, and the file opened afresh and used once more."""
        key = (name, flags)
        with self._lock:
            files = self._fds.get(group)
            if files is None:
                files = self._fds[group] = {}
                while len(self._fds) > self.groups:
                    _close_all(self._fds.popitem(last=False)[1])
            else:
                self._fds.move_to_end(group)
            fd = files.pop(key, None)
            if fd is not None:
                try:
                    done = use(fd)
                except OSError:
                    os.close(fd)  # its group is gone (perhaps made again): open it afresh
                else:
                    files[key] = fd
                    return done
            fd = os.open(f"{group}/{name}", flags | os.O_CLOEXEC)
            try:
                done = use(fd)
            except OSError:
                os.close(fd)
                raise
            files[key] = fd
            return done


def _close_all(files: dict[tuple[str, int], int]) -> None:
    for fd in files.values():
        os.close(fd)


_HELD = HeldFiles()


def read_held(group: str, name: str) -> str:
    """``HeldFiles.read`` on fiberd's table. Raises OSError."""
    return _HELD.read(group, name)


def write_held(group: str, name: str, data: bytes) -> None:
    """``HeldFiles.write`` on fiberd's table. Raises OSError."""
    _HELD.write(group, name, data)


def forget(group: str) -> None:
    """``HeldFiles.forget`` on fiberd's table."""
    _HELD.forget(group)
