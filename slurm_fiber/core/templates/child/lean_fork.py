"""The warm template's fork: libc's ``fork`` where the process has one thread, not ``os.fork``.

In a process with one thread, most of what ``os.fork`` re-initialises in the child
(the runtime's locks, the GIL, the thread states) changes nothing, and redoing it
writes to pages the fiber shares with the template (docs/design.md, "Templates").
``LeanFork.fork`` calls libc's ``fork`` and runs the ``os.register_at_fork``
handlers itself, in ``os.fork``'s order (an exception in one is written to stderr
and the others still run), all but those that only guard the fork against other
threads (``_single_thread_noops``: threading's, logging's and concurrent.futures'
lock handlers).

Called by the template only: ``LeanFork()`` before ``ready()``; ``ready()`` after
the warm, when no more code registers a handler or starts a thread, and before
``gc.freeze``. On a CPython other than 3.11, where the handler lists are not found,
or where the process has more than one thread, ``fork`` is ``os.fork``. Not done:
``os.fork``'s audit event, and dropping signals caught but not yet handled (the
template blocks the signals it handles around each fork).
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import traceback
from collections.abc import Callable, Iterable

_KINDS = ("before", "after_in_parent", "after_in_child")
VERIFIED_ON = ("cpython", (3, 11))  # the interpreter whose os.fork this was checked against
Handlers = list[Callable[[], object]]


class _Marker:
    """A handler that does nothing: registered once per kind, it names that kind's list."""

    def __call__(self) -> None:
        return None


class LeanFork:
    """The template's fork (see the module doc). Not thread-safe: the template has one
    thread."""

    def __init__(self) -> None:
        """Register a marker handler of each kind (the template calls this before it imports
        its preloads)."""
        self.markers = {kind: _Marker() for kind in _KINDS}
        os.register_at_fork(**self.markers)
        self.lists: dict[str, Handlers] | None = None  # chosen by ``ready``

    def ready(self) -> str | None:
        """Choose libc's fork when it is safe; None when chosen, else why not (one line, for
        the template's log). Call once, after the warm and before ``gc.freeze``."""
        if (sys.implementation.name, sys.version_info[:2]) != VERIFIED_ON:
            return (f"{sys.implementation.name} {sys.version_info[0]}.{sys.version_info[1]}"
                    f" is not the {VERIFIED_ON[0]} {VERIFIED_ON[1][0]}.{VERIFIED_ON[1][1]} "
                    "whose os.fork this replaces")
        threads = _thread_count()
        if threads != 1:
            return f"the template has {threads} threads after its warm"
        lists = {kind: _list_holding(marker) for kind, marker in self.markers.items()}
        if any(handlers is None for handlers in lists.values()):
            return "the interpreter's at-fork handler lists were not found"
        noops = [*self.markers.values(), *_single_thread_noops()]
        self.lists = {kind: [h for h in handlers or [] if not any(h == n for n in noops)]
                      for kind, handlers in lists.items()}
        self.lists["before"].reverse()
        return None

    def fork(self) -> int:
        """Fork this process; the child's pid in the parent, 0 in the child. Raises OSError."""
        if self.lists is None:
            return os.fork()
        _run(self.lists["before"])
        pid: int = _libc_fork()
        if pid < 0:
            err = ctypes.get_errno()
            _run(self.lists["after_in_parent"])
            raise OSError(err, os.strerror(err))
        _run(self.lists["after_in_child" if pid == 0 else "after_in_parent"])
        return pid


def _single_thread_noops() -> list[object]:
    """The loaded stdlib handlers that only guard a fork against other threads: they take a
    lock before it and release or renew it after, or rebuild threading's tables."""
    noops: list[object] = []
    threading = sys.modules.get("threading")
    if threading is not None:
        noops.append(threading._after_fork)
    logging = sys.modules.get("logging")
    if logging is not None:
        noops += [logging._acquireLock, logging._releaseLock,
                  logging._after_at_fork_child_reinit_locks]
    futures = sys.modules.get("concurrent.futures.thread")
    if futures is not None:
        lock = futures._global_shutdown_lock
        noops += [lock.acquire, lock.release, lock._at_fork_reinit]
    return noops


_libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held across the call
_libc_fork = _libc.fork
_libc_fork.argtypes = ()
_libc_fork.restype = ctypes.c_int


def _thread_count() -> int:
    """This process's threads (0 when /proc cannot tell)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _list_holding(marker: _Marker) -> Handlers | None:
    """The one list that holds ``marker`` (the interpreter's handler list of its kind)."""
    lists = [r for r in gc.get_referrers(marker) if type(r) is list]
    return lists[0] if len(lists) == 1 else None


def _run(handlers: Iterable[Callable[[], object]]) -> None:
    """Call each handler, as os.fork does: an exception is written to stderr, not raised."""
    for handler in handlers:
        try:
            handler()
        except BaseException:
            print(f"Exception ignored in at-fork handler {handler!r}:", file=sys.stderr)
            traceback.print_exc()
