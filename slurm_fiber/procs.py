"""Processes found by a mark in their environment (conformance runs, throwaway sites).

Every template (and so every fiber forked from it) of a conformance grant
carries ``SF_CONFORM_MARK=<run mark>``; a throwaway site's carry its own
variable (``cli.throwaway``). ``marked`` lists the live ones (a clause waits
on it to know fiberd really stopped a grant's processes, and the runner
checks it after fiberd stops); ``kill`` ends leftovers. Reads /proc; never
raises for a process that vanishes meanwhile. Neutral ground: conform and the
CLI both use it, neither owns it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

MARK_ENV = "SF_CONFORM_MARK"


def marked(mark: str, env: str = MARK_ENV) -> list[int]:
    """Pids of live (not zombie) processes whose environment has ``env=mark``."""
    needle = f"{env}={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            if needle not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state not in ("Z", "X"):
                found.append(int(entry))
    return found


def describe(pid: int) -> str:
    """``pid (command line)``, shortened, for a report line."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} ({' '.join(a.decode(errors='replace') for a in argv if a)[:80]})"


def kill(pids: list[int]) -> None:
    """SIGKILL each pid (processes this run started); gone ones are ignored."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
