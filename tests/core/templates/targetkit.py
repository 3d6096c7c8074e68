"""Code that runs inside test templates and fibers (imported there via PYTHONPATH)."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

WARM: dict[str, object] = {}
HEAVY = ("json", "decimal", "asyncio", "email", "http.client")


def warm() -> None:
    """The template's warm hook: remember who warmed and the module objects it holds."""
    WARM["pid"] = os.getpid()
    WARM["modules"] = {m: id(sys.modules[m]) for m in HEAVY if m in sys.modules}


def warm_fails() -> None:
    raise RuntimeError("the model file is missing\nsecond line")


def observe(i: int) -> None:
    """Print what the fiber sees (JSON on stdout) and exit with ``i % 5``."""
    print(json.dumps({
        "i": i,
        "warmed_by_parent": WARM.get("pid") == os.getppid(),
        "same_modules": all(m in sys.modules and id(sys.modules[m]) == ident
                            for m, ident in dict(WARM.get("modules", {})).items()),
        "n_modules": len(WARM.get("modules", {})),
        "cgroup": next(ln for ln in Path("/proc/self/cgroup").read_text().splitlines()
                       if ln.startswith("0::"))[3:],
        "env": {k: v for k, v in os.environ.items()
                if k.endswith(("VISIBLE_DEVICES", "DEVICE_ORDINAL", "AFFINITY_MASK"))},
        "fiber_id": os.environ.get("SLURM_FIBER_ID"),
    }))
    sys.exit(i % 5)


def add(a: int, b: int) -> int:
    return a + b


def text_of(n: int) -> str:
    return "x" * n


def boom() -> None:
    raise ValueError("bad thing")


def unserialisable() -> object:
    return object()


def rand() -> list[float]:
    out = [random.random()]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        out.append(float(numpy.random.rand()))
    return out


def sleep(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


def ignore_term_and_sleep(seconds: float) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ignoring", flush=True)
    time.sleep(seconds)


def echo_lines() -> None:
    """Echo stdin lines to stdout, upper-cased, until EOF."""
    for line in sys.stdin:
        print(line.strip().upper(), flush=True)


def stop_my_template() -> str:
    """What hostile fiber code can do: SIGSTOP the template it was forked from."""
    os.kill(os.getppid(), signal.SIGSTOP)
    return "stopped"


def wait_for_interrupt() -> None:
    print("waiting", flush=True)
    time.sleep(60)


def blocked_signals() -> list[int]:
    """The signals this fiber's thread blocks (its template blocks SIGCHLD for itself)."""
    return sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))
