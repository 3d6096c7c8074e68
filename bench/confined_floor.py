"""The floor under issue 14's throughput targets: a fresh, confined process per task with
no daemon, measured on this host.

``confined_floor(workload, n, jobs, preloads, hierarchies)`` runs ``jobs`` worker
processes at once, released together. Each holds one leaf of its own in every cgroup
hierarchy listed (``fiber_hierarchies``: where a fiber of fiberd's cgroup mode and
backend is placed here, the unified hierarchy and, on a hybrid host, each v1
hierarchy fiberd carves a group per fiber in) and, per task, starts a fresh process in those leaves:

  W1        ``true`` spawned (``os.posix_spawn``: vfork and exec, no copy of the worker's
            page tables) while the worker itself sits in the leaves: it joins them (one
            ``cgroup.procs`` write each), spawns, and goes back to its own groups, so the
            leaves hold the task alone, as a template spawns an exec fiber
            (core/exec_spawn.py); from a worker that imported nothing more
  W1-fork   the same ``true`` from a forked child that joins the leaves and execs, as
            a forked spare does (a spare process per task); shown beside W1
  W2        a forked child of a worker holding the preloads with its heap frozen, as a
            template does, that joins the leaves, computes ``i * i`` and writes it to a
            pipe

The first task checks it sits in every leaf. The worker reads the result where there
is one and reaps the child. Leaves are reused from task to task, as fiberd's leaf pool
reuses them (core/leaves.py). There is no socket, admission, audit record, spare or
client: what a task costs here is what the kernel charges for the process, the cgroup
moves, exec, exit and wait, and the least Python around them. So no implementation of
a fresh confined process per task of that kind can go much faster on this host's CPUs,
and ``cpu_per_task_ms`` is the part of any per-task CPU budget that is gone before a
daemon does anything. (W1 against W1-fork is what spawning an exec fiber, instead of
execing a pre-placed fork, would save.)

Returns tasks/s over all workers (the slowest worker's wall time) and CPU ms per task
(workers and their reaped children, /proc clock ticks). Needs root (or a delegated
subtree) where hierarchies are given; leaves no cgroup behind; raises OSError with
one line when it cannot place or measure. Blocks; run it from a script.

    .venv/bin/python bench/confined_floor.py [-n 400] [-j 2] [--v1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from cgroup_join import own_dir  # bench/cgroup_join.py: this process's cgroup v2 directory

from slurm_fiber.core.cgroups.v1 import V1_LIMITED, V1_NOT_PER_FIBER, V1Layout

_WORKER = """
import gc, json, os, sys, time
workload, n, leaves = sys.argv[1], int(sys.argv[2]), [l for l in sys.argv[3].split(",") if l]
for m in sys.argv[4:]:
    __import__(m)
gc.collect(); gc.freeze()
procs = [os.path.join(leaf, "cgroup.procs") for leaf in leaves]
homes = [os.path.join(os.path.dirname(os.path.dirname(leaf)), "cgroup.procs") for leaf in leaves]
tail = "/" + "/".join(leaves[0].split("/")[-2:]) if leaves else ""
env = dict(os.environ)
null = os.open(os.devnull, os.O_RDWR)
quiet = [(os.POSIX_SPAWN_DUP2, null, fd) for fd in (0, 1, 2)]

def join(paths):  # move this process: one cgroup.procs write per hierarchy
    for p in paths:
        fd = os.open(p, os.O_WRONLY)
        os.write(fd, b"0")
        os.close(fd)

def placed(text):  # whether /proc/<pid>/cgroup's text names every leaf
    return sum(line.endswith(tail) for line in text.splitlines()) == len(leaves)

sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()  # released with the other workers
t0, c0 = time.perf_counter(), os.times()
for i in range(n):
    r, w = os.pipe()
    if workload == "W1":  # spawned from inside the leaves, the worker back out at once
        check = i == 0 and leaves
        join(procs)
        try:
            pid = os.posix_spawn("/bin/cat", ["cat", "/proc/self/cgroup"], env,
                                 file_actions=[quiet[0], (os.POSIX_SPAWN_DUP2, w, 1)]) \\
                if check else os.posix_spawn("/bin/true", ["true"], env, file_actions=quiet)
        finally:
            join(homes)
    else:
        pid = os.fork()
        if pid == 0:
            try:
                os.close(r)
                join(procs)
                if i == 0 and leaves and not placed(open("/proc/self/cgroup").read()):
                    os._exit(3)
                if workload == "W1-fork":
                    os.execv("/bin/true", ["true"])
                os.write(w, str(i * i).encode())
                os._exit(0)
            finally:
                os._exit(127)
    os.close(w)
    got = os.read(r, 65536)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if workload == "W1" and i == 0 and leaves and not placed(got.decode()):
        sys.exit(f"task 0 did not sit in every leaf: {got!r}")
    if status != 0 or (workload == "W2" and int(got) != i * i):
        sys.exit(f"task {i}: status {status}, result {got!r}")
c1 = os.times()
cpu = sum(c1[:4]) - sum(c0[:4])
print(json.dumps({"wall": time.perf_counter() - t0, "cpu": cpu}))
"""


WORKLOADS = ("W1", "W1-fork", "W2")


def fiber_hierarchies(carved: bool, backend: str | None) -> list[str]:
    """The hierarchies a fiber joins here: none uncarved; the unified one; and on a hybrid
    backend each v1 hierarchy fiberd carves that this host mounts and gives each fiber a
    group in (not cpu: a fiber keeps its template's)."""
    if not carved:
        return []
    v1 = V1Layout.of_self()
    mounted = [c for c in V1_LIMITED if c in v1.mounts and c not in V1_NOT_PER_FIBER] \
        if backend == "hybrid" else []
    return ["unified", *mounted]


@contextlib.contextmanager
def leaves(hierarchies: list[str], jobs: int) -> Iterator[list[list[Path]]]:
    """One leaf per worker in each hierarchy, under a scratch group of this process's own
    cgroup there; removed on exit (the workers' children are reaped by then)."""
    name = f"sf-floor-{os.getpid()}"
    v1 = V1Layout.of_self()
    roots = []
    for h in hierarchies:
        root = own_dir() / name if h == "unified" else v1.root(h, name)
        if root is None:
            raise OSError(f"no {h} hierarchy mounted here")
        roots.append(root)
    made: list[Path] = []
    try:
        for root in roots:
            root.mkdir()
            made.append(root)
        per_worker = []
        for k in range(jobs):
            mine = [root / f"w{k}" for root in roots]
            for leaf in mine:
                leaf.mkdir()
                made.append(leaf)
            per_worker.append(mine)
        yield per_worker
    finally:
        for path in reversed(made):
            with contextlib.suppress(OSError):
                path.rmdir()


def confined_floor(workload: str, n: int, jobs: int, preloads: list[str],
                   hierarchies: list[str]) -> dict[str, float]:
    """``n`` tasks per worker, ``jobs`` workers at once (see the module doc): tasks/s and
    CPU ms per task. OSError when a worker fails or a leaf cannot be made."""
    with leaves(hierarchies, jobs) as placed:
        workers = [subprocess.Popen(
            [sys.executable, "-c", _WORKER, workload, str(n), ",".join(map(str, mine)),
             *(preloads if workload == "W2" else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for mine in placed]
        try:
            for w in workers:
                if w.stdout is None or w.stdout.readline() != "ready\n":
                    raise OSError(f"a {workload} floor worker did not start")
            for w in workers:
                assert w.stdin is not None
                w.stdin.write("go\n")
                w.stdin.flush()
            outs = [w.communicate(timeout=600)[0] for w in workers]
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait()
        if any(w.returncode != 0 for w in workers):
            raise OSError(f"a {workload} floor worker failed (exit "
                          f"{[w.returncode for w in workers]})")
    runs = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    tasks = n * jobs
    return {"tasks_per_s": round(tasks / max(r["wall"] for r in runs), 1),
            "cpu_per_task_ms": round(sum(r["cpu"] for r in runs) / tasks * 1000, 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=400, help="tasks per worker")
    parser.add_argument("-j", "--jobs", type=int, default=len(os.sched_getaffinity(0)),
                        help="workers at once (default: usable CPUs)")
    parser.add_argument("--v1", action="store_true",
                        help="also the v1 hierarchies (a fiber on the hybrid backend)")
    parser.add_argument("modules", nargs="*", default=["json", "decimal", "asyncio"],
                        help="W2's preloads")
    opts = parser.parse_args()
    where = fiber_hierarchies(True, "hybrid" if opts.v1 else "v2")
    try:
        figures = {w: confined_floor(w, opts.n, opts.jobs, opts.modules, where)
                   for w in WORKLOADS}
    except OSError as err:
        print(json.dumps({"bench": "confined_floor", "unavailable": str(err)}))
        return 1
    print(json.dumps({"bench": "confined_floor", "hierarchies": where, **figures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
