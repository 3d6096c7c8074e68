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
  W1-clone3 the same ``true`` from a child that ``clone3(CLONE_INTO_CGROUP)`` starts
            inside the cgroup2 leaf (the leaf's directory fd; kernel 5.7 or later): no
            move at all, so only on the cgroup2 hierarchy alone, what a pure cgroup2 host
            has. Fork semantics (no CLONE_VM: the child gets a copy of the worker's page
            tables, as W1-fork's does) through ``syscall(435, ...)`` by ctypes; the
            child execs at once, with nothing re-initialised: neither ``os.fork``'s
            interpreter re-init (which W1-fork pays) nor glibc's fork bookkeeping (its
            atfork handlers, the thread's cached tid), safe because the worker has one
            thread and the child only execs (as core/templates/child/lean_fork.py
            argues for the template). The worker imports ctypes for it and nothing
            else. Beside W1-fork it is what the child's move and os.fork's re-init
            cost; beside W1, whether a copy of the page tables with no move beats vfork
            with two.
            Vfork semantics (CLONE_VM|CLONE_VFORK, as glibc's posix_spawn uses) cannot be
            had from Python safely: the child would run the interpreter on the worker's
            stack and memory. It is not tried here
  moves     no process: the two ``cgroup.procs`` writes W1 makes per task (into the
            leaves and back), alone. W1 less its moves bounds what a C-level spawn
            straight into the cgroup (CLONE_VM|CLONE_VFORK|CLONE_INTO_CGROUP) would
            cost: the kernel's placement at clone time is not in it

The first task checks it sits in every leaf (W1 and W1-clone3: ``cat /proc/self/cgroup``
started in its place, its output read by the worker). The worker reads the result where there
is one and reaps the child. Leaves are reused from task to task, as fiberd's leaf pool
reuses them (core/leaves.py). There is no socket, admission, audit record, spare or
client: what a task costs here is what the kernel charges for the process, the cgroup
moves, exec, exit and wait, and the least Python around them. So no implementation of
a fresh confined process per task of that kind can go much faster on this host's CPUs,
and ``cpu_per_task_ms`` is the part of any per-task CPU budget that is gone before a
daemon does anything. (W1 against W1-fork is what spawning an exec fiber, instead of
execing a pre-placed fork, would save.)

Returns tasks/s over all workers (the slowest worker's wall time) and CPU ms per task
(workers and their reaped children, getrusage); W1 also the wall and CPU time its
workers spent in their moves, per task. Needs root (or a delegated
subtree) where hierarchies are given; leaves no cgroup behind; raises OSError with
one line when it cannot place or measure. Blocks; run it from a script.

By default the leaves are on the cgroup2 hierarchy alone; ``--v1`` adds the v1 ones
(not with W1-clone3). ``--rounds R`` runs the workloads listed alternately R times and
prints each round and the medians, and W1 less its moves (``without_moves``).

    .venv/bin/python bench/confined_floor.py [-n 400] [-j 2] [--v1] [--rounds 3]
        [--workloads W1,W1-fork,W1-clone3,moves]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from cgroup_join import own_dir  # bench/cgroup_join.py: this process's cgroup v2 directory

from slurm_fiber.core.cgroups.v1 import V1_LIMITED, V1_NOT_PER_FIBER, V1Layout

_WORKER = """
import gc, json, os, resource, sys, time
def cpu_now():  # seconds of CPU, this worker and its reaped children
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))
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

if workload == "W1-clone3":  # clone3(CLONE_INTO_CGROUP), fork semantics
    import ctypes, struct
    libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held, as in os.fork
    libc.syscall.restype = ctypes.c_long
    leaf_fd = os.open(leaves[0], os.O_RDONLY | os.O_DIRECTORY)  # close-on-exec
    # struct clone_args (v2, 88 bytes): flags=CLONE_INTO_CGROUP, exit_signal=SIGCHLD, cgroup
    packed = struct.pack("=11Q", 0x200000000, 0, 0, 0, 17, 0, 0, 0, 0, 0, leaf_fd)
    clone_args = ctypes.create_string_buffer(packed, len(packed))
    size, sys_clone3 = ctypes.c_size_t(len(packed)), ctypes.c_long(435)  # x86_64, aarch64

sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()  # released with the other workers
moving, moving_cpu = 0.0, 0.0  # W1: wall and this thread's CPU seconds in its moves
t0, c0 = time.perf_counter(), cpu_now()
for i in range(n):
    if workload == "moves":  # W1's two moves per task, no process
        join(procs)
        join(homes)
        continue
    r, w = os.pipe()
    if workload == "W1":  # spawned from inside the leaves, the worker back out at once
        check = i == 0 and leaves
        m0, m1 = time.perf_counter(), time.thread_time()
        join(procs)
        moving += time.perf_counter() - m0
        moving_cpu += time.thread_time() - m1
        try:
            pid = os.posix_spawn("/bin/cat", ["cat", "/proc/self/cgroup"], env,
                                 file_actions=[quiet[0], (os.POSIX_SPAWN_DUP2, w, 1)]) \\
                if check else os.posix_spawn("/bin/true", ["true"], env, file_actions=quiet)
        finally:
            m0, m1 = time.perf_counter(), time.thread_time()
            join(homes)
            moving += time.perf_counter() - m0
            moving_cpu += time.thread_time() - m1
    elif workload == "W1-clone3":  # the child starts in the leaf; it execs at once
        pid = libc.syscall(sys_clone3, clone_args, size)
        if pid == 0:  # no os.fork re-init: one thread here, and the child only execs
            try:
                if i == 0:  # the check: what sits in the child's place says where it is
                    os.dup2(w, 1)
                    os.execv("/bin/cat", ["cat", "/proc/self/cgroup"])
                os.execv("/bin/true", ["true"])
            finally:
                os._exit(127)
        if pid < 0:
            sys.exit(f"clone3: {os.strerror(ctypes.get_errno())}")
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
    if workload in ("W1", "W1-clone3") and i == 0 and leaves and not placed(got.decode()):
        sys.exit(f"task 0 did not sit in every leaf: {got!r}")
    if status != 0 or (workload == "W2" and int(got) != i * i):
        sys.exit(f"task {i}: status {status}, result {got!r}")
cpu = cpu_now() - c0
print(json.dumps({"wall": time.perf_counter() - t0, "cpu": cpu, "moving": moving,
                  "moving_cpu": moving_cpu}))
"""


WORKLOADS = ("W1", "W1-fork", "W2")  # the default run
ALL_WORKLOADS = (*WORKLOADS, "W1-clone3", "moves")


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
    CPU ms per task; W1 also the wall and CPU ms per task of its moves. OSError when a
    worker fails, a leaf cannot be made, or W1-clone3 is asked for on any hierarchy but
    cgroup2 alone."""
    if workload == "W1-clone3" and hierarchies != ["unified"]:
        raise OSError("W1-clone3 places its child on the cgroup2 hierarchy only; "
                      "run it without --v1")
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
    figures = {"tasks_per_s": round(tasks / max(r["wall"] for r in runs), 1),
               "cpu_per_task_ms": round(sum(r["cpu"] for r in runs) / tasks * 1000, 3)}
    if workload == "W1":
        for key, name in (("moving", "move_wall_ms_per_task"),
                          ("moving_cpu", "move_cpu_ms_per_task")):
            figures[name] = round(sum(r[key] for r in runs) / tasks * 1000, 3)
    return figures


def medians(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each workload's figures, the median over the rounds."""
    return {w: {k: round(statistics.median(r[w][k] for r in rounds), 3) for k in rounds[0][w]}
            for w in rounds[0]}


def without_moves(figures: dict[str, dict[str, float]], jobs: int) -> dict[str, dict[str, float]]:
    """W1 less its two moves: what a spawn straight into the cgroup would cost at most,
    the kernel's placement at clone time aside. ``in_situ``: less the wall and CPU W1's
    own workers spent in their moves; ``alone`` (with the ``moves`` workload in the
    round): less the wall time per task and the CPU the moves alone took, as many at once."""
    w1 = figures["W1"]
    moves = {"in_situ": (w1["move_wall_ms_per_task"], w1["move_cpu_ms_per_task"])}
    if "moves" in figures:
        moves["alone"] = (jobs / figures["moves"]["tasks_per_s"] * 1000,
                          figures["moves"]["cpu_per_task_ms"])
    per_task = jobs / w1["tasks_per_s"] * 1000  # a worker's wall ms per task
    return {name: {"tasks_per_s": round(jobs * 1000 / (per_task - wall), 1),
                   "cpu_per_task_ms": round(w1["cpu_per_task_ms"] - cpu, 3)}
            for name, (wall, cpu) in moves.items() if per_task > wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=400, help="tasks per worker")
    parser.add_argument("-j", "--jobs", type=int, default=len(os.sched_getaffinity(0)),
                        help="workers at once (default: usable CPUs)")
    parser.add_argument("--v1", action="store_true",
                        help="also the v1 hierarchies (a fiber on the hybrid backend); "
                             "without it, the cgroup2 hierarchy alone")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, run in this order each round, of "
                             f"{', '.join(ALL_WORKLOADS)} (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of the workloads, alternated; each printed, then medians")
    parser.add_argument("modules", nargs="*", default=["json", "decimal", "asyncio"],
                        help="W2's preloads")
    opts = parser.parse_args()
    workloads = [w for w in opts.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in ALL_WORKLOADS]
    if unknown or not workloads or opts.rounds < 1:
        parser.error(f"workloads are some of {', '.join(ALL_WORKLOADS)} "
                     f"(not {', '.join(unknown) or 'none'}); rounds at least 1")
    where = fiber_hierarchies(True, "hybrid" if opts.v1 else "v2")
    rounds: list[dict[str, dict[str, float]]] = []
    try:
        for k in range(opts.rounds):
            rounds.append({w: confined_floor(w, opts.n, opts.jobs, opts.modules, where)
                           for w in workloads})
            if opts.rounds > 1:
                print(f"round {k + 1}: " + json.dumps(rounds[-1]), file=sys.stderr)
    except OSError as err:
        print(json.dumps({"bench": "confined_floor", "unavailable": str(err)}))
        return 1
    figures: dict[str, object] = {"bench": "confined_floor", "hierarchies": where}
    if opts.rounds == 1:
        figures.update(rounds[0])
    else:
        figures.update({"rounds": rounds, "median": medians(rounds)})
    if "W1" in workloads:
        bounds = [without_moves(r, opts.jobs) for r in rounds]
        figures["W1_less_moves"] = bounds[0] if opts.rounds == 1 else bounds
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
