"""Cgroup control files held open to be read again, one ``pread`` each time.

A fiber's end reads several control files of its leaf (``cgroup.events``,
the memory peak, the OOM count, the memory still charged), and a leaf is
handed out to fiber after fiber (core/leaves.py). Opening and closing each
file every time was the largest share of fiberd's own work in a sequential
exec benchmark (``read_small``, a twelfth of its loop, profiled); a kept
descriptor read at offset 0 gives the file's current text, as a fresh open
does (cgroupfs files are generated on each read from the start).

``read_held(group, name)`` reads ``group/name`` through a kept descriptor.
At most ``HELD_GROUPS`` groups keep theirs, the least recently read closed
first. A group that was removed fails its read with ENODEV (so does one made
again by the same name, through the old descriptor): the file is then opened
afresh, once, and an error of that open (a group that is gone:
FileNotFoundError) is raised as a plain open's would be. ``forget(group)``
closes a group's descriptors as it is removed (``cgroups.remove_tree``), so
no descriptor outlives its group for long.

One table per process, behind a lock: the event loop reads through it and
worker threads remove groups (``cgroups.remove_tree`` runs off the loop).
Reads of cgroup control files do not block on I/O. (The lock is ``_thread``'s: the
epilog imports this module through cgroups, and ``threading`` would add to its start.)
"""

from __future__ import annotations

import _thread
import os
from collections import OrderedDict

HELD_GROUPS = 64  # groups whose read descriptors are kept (a few files each)
_CHUNK = 65536  # control files read whole: events, counters, a peak


class HeldFiles:
    """The table behind ``read_held`` and ``forget`` (see the module doc)."""

    def __init__(self, groups: int = HELD_GROUPS) -> None:
        self.groups = groups
        self._fds: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._lock = _thread.allocate_lock()  # threading's, without importing threading

    def read(self, group: str, name: str) -> str:
        """The text of ``group/name`` (a directory path and a file name). Raises OSError
        as opening and reading it would."""
        with self._lock:
            files = self._fds.get(group)
            if files is None:
                files = self._fds[group] = {}
                while len(self._fds) > self.groups:
                    _close_all(self._fds.popitem(last=False)[1])
            else:
                self._fds.move_to_end(group)
            fd = files.pop(name, None)
            if fd is not None:
                try:
                    text = os.pread(fd, _CHUNK, 0)
                except OSError:
                    os.close(fd)  # its group is gone (perhaps made again): open it afresh
                else:
                    files[name] = fd
                    return text.decode()
            fd = os.open(f"{group}/{name}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                text = os.pread(fd, _CHUNK, 0)
            except OSError:
                os.close(fd)
                raise
            files[name] = fd
            return text.decode()

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


def _close_all(files: dict[str, int]) -> None:
    for fd in files.values():
        os.close(fd)


_HELD = HeldFiles()


def read_held(group: str, name: str) -> str:
    """``HeldFiles.read`` on this process's table. Raises OSError."""
    return _HELD.read(group, name)


def forget(group: str) -> None:
    """``HeldFiles.forget`` on this process's table."""
    _HELD.forget(group)
