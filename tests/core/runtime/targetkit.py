"""Functions fibers run in the runtime tests (importable by templates through PYTHONPATH)."""

from __future__ import annotations

import os
import signal
import sys
import time


def imported(name: str) -> bool:
    """Whether ``name`` was already imported in this interpreter (the template's preload)."""
    return name in sys.modules


def getenv(name: str) -> str | None:
    return os.environ.get(name)


def cgroups() -> str:
    """This process's /proc/self/cgroup."""
    with open("/proc/self/cgroup") as f:
        return f.read()


def sleep(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


def escape(cgroup: str, seconds: float) -> str:
    """Ignore SIGTERM, move into ``cgroup`` (out of the fiber's own), say so, then sleep."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as procs:
        procs.write(str(os.getpid()))
    print("moved", flush=True)
    time.sleep(seconds)
    return "outlived"


STUBBORN_NOW = "ignoring SIGTERM"


def stubborn(seconds: float) -> str:
    """Ignore SIGTERM, say so on stdout (``STUBBORN_NOW``), then sleep: only SIGKILL ends
    it early (a SIGTERM before the line may still end it)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(STUBBORN_NOW, flush=True)
    time.sleep(seconds)
    return "outlived"
