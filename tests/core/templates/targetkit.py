"""Code that runs inside test templates and fibers (imported there via PYTHONPATH)."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
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


FORK_SEEN: dict[str, int] = {}  # which at-fork handler ran in which process (pid)


def register_fork_handlers() -> None:
    """A warm hook that registers at-fork handlers, as a preloaded library may."""
    os.register_at_fork(before=lambda: FORK_SEEN.update(before=os.getpid()),
                        after_in_parent=lambda: FORK_SEEN.update(parent=os.getpid()),
                        after_in_child=lambda: FORK_SEEN.update(child=os.getpid()))


def fork_seen() -> dict[str, int]:
    """The handlers' record as this fiber sees it, with its own pid and its parent's."""
    return {**FORK_SEEN, "self": os.getpid(), "ppid": os.getppid()}


def start_a_thread() -> None:
    """A warm hook that leaves a thread running in the template."""
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()


def threads_work() -> list[object]:
    """Start, join and name a thread; what threading says of this fiber's own."""
    seen: list[str] = []
    worker = threading.Thread(target=lambda: seen.append(threading.current_thread().name))
    worker.start()
    worker.join(10)
    return [seen, threading.current_thread() is threading.main_thread(),
            threading.active_count(), threading.get_ident() == threading.main_thread().ident]
