"""Which children of this process exited, learned without asking the kernel about all of them.

A template is the parent of every fiber it forked, so it may hold thousands of
children, and ``waitid(P_ALL)`` walks them all. The template learns exits as
events that name the child instead:

- ``ChildExits`` blocks SIGCHLD in the calling thread and reads it from a
  ``signalfd``, whose records carry the exited child's pid (``pids``); the
  template then waits for that pid alone;
- standard signals coalesce, so a full walk still runs now and then: ``sweep_due``
  allows one once a SIGCHLD came and the time since the last walk is
  ``SWEEP_SPACING`` times the CPU its looking took, and never later than
  ``SWEEP_MAX_WAIT``;
- a SIGCHLD delivered to another thread (one a grant's warm code started) wakes the
  template through Python's wakeup fd; that wakeup allows a walk too.

Linux only (signalfd); used by one thread; nothing blocks.
"""

from __future__ import annotations

import ctypes
import os
import signal
import struct

SWEEP_SPACING = 50.0  # a walk may take at most 1/50 of the template's time
SWEEP_MAX_WAIT = 0.1  # seconds an exit whose SIGCHLD coalesced waits for a walk, at most
_SIGINFO = struct.Struct("<IiiI")  # signalfd_siginfo's head: signo, errno, code, pid
_SIGINFO_SIZE = 128  # sizeof(struct signalfd_siginfo)
_SIGSET_SIZE = 128  # glibc's sigset_t


def sweep_due(signalled: bool, now: float, last_end: float, last_took: float) -> bool:
    """Whether a full walk of the children may run at ``now`` (monotonic seconds): a
    SIGCHLD (or wakeup) came since the last walk, which ended at ``last_end`` and took
    ``last_took`` CPU seconds to look, and ``SWEEP_SPACING`` times that (at most
    ``SWEEP_MAX_WAIT``) has passed since."""
    return sweep_wait(signalled, now, last_end, last_took) == 0.0


def sweep_wait(signalled: bool, now: float, last_end: float, last_took: float) -> float | None:
    """Seconds until ``sweep_due`` turns true without another event (0 if it is), or None
    when nothing is owed (no SIGCHLD since the last walk): a poll timeout."""
    if not signalled:
        return None
    return max(0.0, last_end + min(SWEEP_MAX_WAIT, SWEEP_SPACING * last_took) - now)


class ChildExits:
    """SIGCHLD, blocked in this thread, read from a signalfd. ``fileno`` is readable when a
    child exited (or stopped); ``pids`` returns the children the pending records name.
    Raises OSError when the signalfd cannot be made (then nothing was changed)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        sigset = ctypes.create_string_buffer(_SIGSET_SIZE)
        if libc.sigemptyset(sigset) != 0 or libc.sigaddset(sigset, signal.SIGCHLD) != 0:
            raise OSError(ctypes.get_errno(), "sigaddset failed")
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
        fd = libc.signalfd(-1, sigset, os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
            raise OSError(err, f"signalfd: {os.strerror(err)}")
        self.fd: int = fd

    def fileno(self) -> int:
        return self.fd

    def pids(self) -> list[int]:
        """The pids the pending SIGCHLD records name, oldest first (possibly none)."""
        found: list[int] = []
        while True:
            try:
                data = os.read(self.fd, _SIGINFO_SIZE * 64)
            except BlockingIOError:
                return found
            if not data:
                return found
            for offset in range(0, len(data) - _SIGINFO_SIZE + 1, _SIGINFO_SIZE):
                found.append(_SIGINFO.unpack_from(data, offset)[3])

    def close(self) -> None:
        """Close the signalfd (in a forked child, before user code, which must also
        unblock SIGCHLD: a program it runs would never see its own children exit)."""
        os.close(self.fd)

