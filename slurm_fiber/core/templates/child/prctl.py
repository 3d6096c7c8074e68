"""Tie a process's life to its parent (PR_SET_PDEATHSIG with the race closed), and
give up gaining privileges (PR_SET_NO_NEW_PRIVS).

Used first thing in a template (parent: fiberd; SIGTERM, which the template
turns into a kill of all its fibers) and in a fiber right after fork
(parent: the template; SIGKILL). ``die_with_parent(expected_parent, sig)``
arms the signal and then checks the parent is still the one
expected: if it already died before the call, the process exits at once,
so no window lets it outlive its parent. The signal is tied to the parent
*thread* that forked us; fiberd starts templates from its event-loop thread.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl
_prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
_prctl.restype = ctypes.c_int


def die_with_parent(expected_parent: int, sig: int = signal.SIGKILL, exit_code: int = 70) -> None:
    """Arm ``sig`` on parent death; ``os._exit(exit_code)`` if the parent is already gone.

    Never returns an error: a failing prctl raises OSError (the caller is not
    safe to run without it).
    """
    if _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != expected_parent:
        os._exit(exit_code)


_PR_SET_NO_NEW_PRIVS = 38


def no_new_privs() -> None:
    """Set ``no_new_privs`` on this process (inherited by every child, never cleared):
    exec of a setuid or file-capability program gives it nothing. Raises OSError."""
    if _prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
