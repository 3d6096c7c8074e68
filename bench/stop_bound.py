"""The least a stop of N carved fibers can cost on this host, with no fiberd (issue 19).

``stop_bound(n, parents)``: N ``sleep`` processes, each in its own leaf
made the way fiberd lays out a grant (``group-<k>/slot-<n>``, 100 leaves to a
group) under every hierarchy fiberd carved in (``parents``: the directories
holding fiberd's ``slurm-fiber.<pid>`` trees, the cgroup2 one first, which
must offer ``cgroup.kill``); then, timed: one ``cgroup.kill`` on the cgroup2
tree, and each process reaped with its leaves removed right after it (the
kernel's teardown of the others goes on meanwhile), then the groups and the
trees. That is the kernel's share of fiberd's stop: what remains of fiberd's
stop time above it is fiberd's own. Run it as root (it writes cgroup.procs in
every hierarchy). Leaves nothing behind, even when interrupted.

    .venv/bin/python bench/stop_bound.py N PARENT [PARENT...]
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

PER_GROUP = 100


def stop_bound(n: int, parents: Sequence[Path]) -> dict[str, float | int]:
    """Seconds of the kill, of reaping with leaf removal, and in all, for ``n`` processes
    in ``len(parents)`` hierarchies. Blocks; raises OSError when a cgroup cannot be made."""
    roots = [Path(p) / f"slurm-fiber-bound.{os.getpid()}" for p in parents]
    leaves = [f"group-{i // PER_GROUP}/slot-{i % PER_GROUP}" for i in range(n)]
    pids: list[int] = []
    try:
        for leaf in leaves:
            for root in roots:
                (root / leaf).mkdir(parents=True, exist_ok=True)
        pids = [_spawn_in([root / leaf for root in roots]) for leaf in leaves]
        time.sleep(1.0)  # every child has joined its leaves and exec'd
        t0 = time.perf_counter()
        (roots[0] / "cgroup.kill").write_text("1")
        t1 = time.perf_counter()
        for pid, leaf in zip(pids, leaves, strict=True):
            os.waitpid(pid, 0)
            for root in roots:
                os.rmdir(root / leaf)
        t2 = time.perf_counter()
        _remove(roots)
        t3 = time.perf_counter()
        pids = []
    finally:
        for pid in pids:
            with contextlib.suppress(ChildProcessError, ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        _remove(roots)
    return {"n": n, "hierarchies": len(roots), "kill_s": round(t1 - t0, 3),
            "reap_rmdir_s": round(t2 - t1, 3), "total_s": round(t3 - t0, 3)}


def _spawn_in(leaves: Sequence[Path]) -> int:
    """Fork a child that joins every leaf and execs ``sleep 600``; its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            for leaf in leaves:
                with open(leaf / "cgroup.procs", "w") as f:
                    f.write("0")
            os.execvp("sleep", ["sleep", "600"])
        finally:
            os._exit(127)
    return pid


def _remove(roots: Sequence[Path]) -> None:
    """rmdir every tree, deepest first; gone is fine."""
    for root in roots:
        for top, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(top)


if __name__ == "__main__":
    print(json.dumps(stop_bound(int(sys.argv[1]), [Path(p) for p in sys.argv[2:]])))
