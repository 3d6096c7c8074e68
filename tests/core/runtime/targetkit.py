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


def sleep(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


def stubborn(seconds: float) -> str:
    """Ignore SIGTERM, then sleep: only SIGKILL ends it early."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(seconds)
    return "outlived"
