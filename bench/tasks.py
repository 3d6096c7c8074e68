"""Many short tasks: fibers against the tools job authors use today, in one run (issue 14).

Two workloads, N tasks each: W1 runs ``true``; W2 calls ``square(i)`` (bench/taskfns.py)
in an interpreter that has imported the quickstart's twelve preloads. For each system:
the sequential p50/p99 (one task at a time, submit → result) and the throughput at the
natural parallelism (``-j``, default the usable CPUs), measured in interleaved rounds so
a busy moment of the shared machine falls on every system alike. A system is measured
with no other one working: Dask's cluster, which takes some 10% of a CPU while idle
(heartbeats, monitors), is started (untimed) for each round of its own and closed after
it; the others' processes, and fiberd with its template (0.6% idle), stay and wait.
With it up beside them, the fibers' p50s were 15-25% and their throughputs 12-20%
worse on this 2-core VM:

  subprocess     ``subprocess.run`` per task (W2: ``python -c "import <preloads>; ..."``)
  pool           multiprocessing ``Pool(j)`` (fork), workers hold the preloads
  forkserver     multiprocessing forkserver, one ``Process`` per task, preloads given
                 (from a ``python -c`` program, as bench/clone.py does: started from a
                 script, every child would re-import the script; its start is not timed)
  parallel       GNU parallel ``-j j`` (throughput only; skipped when not installed)
  dask           Dask distributed ``LocalCluster(j processes)``, its workers holding the
                 preloads and warmed by one task (skipped without the ``bench`` extra)
  fiber          slurm_fiber: W1 an exec Clone of ``true`` through ``TaskRunner`` (the
                 path ``fiberctl map`` takes) given this process's stdout and stderr, as
                 ``subprocess.run`` gives them to its ``true`` (passed none, fiberd would
                 make two output files per fiber and remove them empty: 0.12-0.18 ms
                 more a task measured), W2 ``slurm_fiber.Executor``
  fibermap       ``fiberctl map -j j`` (W2 with ``--call``), throughput only; it includes
                 fiberctl's own start-up, once per map
  executor_w     (``--window-path`` with template) W2 through ``Executor(windows=True)``
                 against the same fiberd as ``fiber``: what sending windowed batches
                 changes on fiberd's own path, apart from the template's window
  fiber_tw       W2 through ``Executor(windows=True)`` against a second fiberd with
                 ``task_window = "template"`` (``--window-path`` with template); its
                 sequential samples are lone calls, each one Clone as ``fiber``'s
  fibermap_tw    ``fiberctl map -j j`` (W1 of ``true``, W2 with ``--call``) against that
                 fiberd, throughput only, with its CPU per task per process (as the
                 Executor rows ``executor_w`` and ``fiber_tw``, whose client is this process)

and, to split a missed target into its parts, in the same run: the bound, the least a
Python Clone could cost here (bench/fork_floor.py's pre-forked spare pipeline, no daemon
work: what the machine leaves), and a bare call-mode Clone round trip through
``FiberdClient`` (``slurm_fiber.cli.latency``: what fiberd adds to the bound; the
Executor's and the exec path's p50 over it is what the client side adds), and, for the
throughput runs of ``fiberctl map`` and GNU parallel, the CPU a task cost in all
processes (``cpu_per_task_ms``: fiberd, its templates, the fibers, the spares, the
tool's own process tree; /proc's clock ticks, so read it from runs of a few
hundred tasks): what that CPU allows on this machine's CPUs caps the throughput
whatever the latency (``cpu_bound_per_s``), and ``share_of_bound`` says how close each
run came. Last, after fiberd has stopped, the floor under both throughput targets
(bench/confined_floor.py): W1 and W2 as fresh processes in their own leaves of the
cgroup hierarchies a fiber joins here, ``-j`` at once, no daemon (W1 spawned from inside
the leaves, as a template spawns an exec fiber, and beside it ``W1-fork``, forked and
exec'd as a spare would); for each throughput
target (``floor_budgets``) the rate it asks in this run, the CPU per task that rate
leaves on this machine's CPUs, and what the floor and ``fiberctl map`` spend of it.
The fibers run under a throwaway standalone fiberd (the quickstart's site) configured as a
user gets it (fiberd's defaults: each Clone's audit record fsynced). Missing peers are
installed first (Dask into this environment, GNU parallel from Debian as root;
``--no-install`` skips them instead). Reports the host (kernel, cgroup mode, the cgroup2
mount's options: an option such as ``favordynmods`` changes what cgroup moves cost), every
ratio behind the targets, which system gives a fresh process per task, ``--plot FILE``
(throughput bars and latency CDFs, PNG; the ``plot`` extra) and ends with one JSON line.

``--slurm`` adds, in a batch job on the cluster ``SLURM_CONF`` names (else this
checkout's bare-host cluster; bench/slurm.py's job machinery: one node, run as
the invoking user with this venv, fiberd started with `srun --overlap
fiberd-run`): `fiberctl run -- true` against an `srun --overlap -n1 true` step
and the interpreter's floor (`python -I -S -c pass`, the least fiberctl can
take), sequential p50s in interleaved rounds; and the same N tasks of `true`
(``--slurm-n``) through one `fiberctl map -j j` and as N srun steps, j at once, all N
of each in every round (a map split per round would pay fiberctl's start once per
part); the walls are each round's mean. Beside them, what bounds the map: the same
map under a second fiberd that leaves its audit records' fsync to the kernel
(``audit_fsync = never``; the job's own fsyncs each clone record on its loop, once
per task, each fiber's exit record riding on the next). Its ratios join the targets
(``slurm_*``) and the JSON line (``slurm``).

    .venv/bin/python bench/tasks.py [-n 200] [--rounds 4] [-j 2] [--plot tasks.png]
                                    [--slurm [--slurm-n 500]]
"""

from __future__ import annotations

import argparse
import compileall
import concurrent.futures as cf
import contextlib
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import plots  # bench/plots.py
import slurm  # bench/slurm.py: the job machinery
from clone import cpu_by_role  # bench/clone.py: CPU of fiberd and what runs under it
from confined_floor import WORKLOADS, confined_floor, fiber_hierarchies
from fork_floor import spare_pipeline

from slurm_fiber.cli.latency import clone_round_trips, percentiles
from slurm_fiber.cli.quickstart import DEFAULT_PRELOADS
from slurm_fiber.cli.throwaway import GRANT, Site
from slurm_fiber.client.executor import Executor
from slurm_fiber.client.tasks import Task, TaskRunner
from slurm_fiber.core.cgroups.manager import BACKEND_CHOICES

CHECKOUT = Path(__file__).resolve().parents[1]
BENCH_EXTRA: list[str] = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())[
    "project"]["optional-dependencies"]["bench"]
FNS = "bench.taskfns"
FIBERCTL = str(Path(sys.executable).parent / "fiberctl")
FRESH = {"subprocess": "yes", "pool": "no", "forkserver": "yes", "parallel": "yes",
         "dask": "no", "fiber": "yes + cgroup", "fibermap": "yes + cgroup",
         "fibermap_tw": "yes + cgroup", "fiber_tw": "yes + cgroup",
         "executor_w": "yes + cgroup"}
SEQUENTIAL = ("subprocess", "pool", "forkserver", "dask", "fiber")

DASK_GONE_WITHIN = 30.0  # seconds to wait for a closed Dask cluster's processes to exit
Seq = Callable[[int], None]  # one task, blocking
Par = Callable[[int], object]  # n tasks at the natural parallelism, blocking; returns the
# seconds they took (a float) when the runner times itself, else the caller times it
Batch = Callable[[int], list[float]]  # n sequential tasks, timed by the runner itself

_FORKSERVER = """
import json, multiprocessing, sys, time
from multiprocessing.connection import wait
from bench import taskfns
workload, mode, n, jobs, preloads = sys.argv[1], sys.argv[2], int(sys.argv[3]), \\
    int(sys.argv[4]), sys.argv[5:]
ctx = multiprocessing.get_context("forkserver")
ctx.set_forkserver_preload(preloads)
target = taskfns.run_true if workload == "W1" else taskfns.square

def one(i):
    p = ctx.Process(target=target, args=(i,))
    t = time.perf_counter()
    p.start()
    p.join()
    if p.exitcode != 0:
        sys.exit(f"a forkserver Process exited with {p.exitcode}")
    return time.perf_counter() - t

one(0)  # launches the server: not counted
if mode == "seq":
    print(json.dumps([one(i) for i in range(n)]))
else:  # up to ``jobs`` at once from one thread (Process.start from threads fails here)
    t = time.perf_counter()
    running = {}
    for i in range(n):
        while len(running) >= jobs:
            for sentinel in wait(list(running)):
                p = running.pop(sentinel)
                p.join()
                if p.exitcode != 0:
                    sys.exit(f"a forkserver Process exited with {p.exitcode}")
        p = ctx.Process(target=target, args=(i,))
        p.start()
        running[p.sentinel] = p
    for p in running.values():
        p.join()
        if p.exitcode != 0:
            sys.exit(f"a forkserver Process exited with {p.exitcode}")
    print(json.dumps(time.perf_counter() - t))
"""


def python_w2(i: int, preloads: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-c", f"import {', '.join(preloads)}; import {FNS}; "
            f"{FNS}.square({i})"]


class Systems:
    """Each system's set-up (untimed) and its W1/W2 runners; ``skipped`` says why not."""

    def __init__(self, jobs: int, preloads: tuple[str, ...], site: Site,
                 skip: set[str], window_site: Site | None = None) -> None:
        self.jobs, self.preloads, self.site = jobs, preloads, site
        self.window_site = window_site  # a fiberd with task_window = "template" (--window-path)
        self.skipped: dict[str, str] = {s: "skipped by --skip" for s in skip}
        self.seq: dict[tuple[str, str], Seq] = {}
        self.batch: dict[tuple[str, str], Batch] = {}
        self.par: dict[tuple[str, str], Par] = {}
        self.sessions: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {}
        self.cpu: dict[str, dict[str, float]] = {}  # "system/W": CPU seconds by role, tasks
        self.closers: list[Callable[[], None]] = []
        for name in ("subprocess", "pool", "forkserver", "parallel", "dask", "fiber",
                     "fibermap"):
            if name not in self.skipped:
                getattr(self, f"_{name}")()
        if window_site is not None:
            if "executor_w" not in self.skipped:
                self._executor_w2("executor_w", site)
            if "fiber_tw" not in self.skipped:
                self._executor_w2("fiber_tw", window_site)
            if "fibermap_tw" not in self.skipped:
                self._fibermap_tw(window_site)

    def close(self) -> None:
        for close in reversed(self.closers):
            close()

    def session(self, name: str) -> contextlib.AbstractContextManager[None]:
        """What system ``name`` needs up while it is measured, and only then (Dask's
        cluster); entering it is not timed."""
        return self.sessions.get(name, contextlib.nullcontext)()

    def _cpu_counted(self, key: str, run: Callable[[int], object], daemon: bool,
                     site: Site | None = None, in_process: bool = False) -> Par:
        """``run`` (a throughput run in child processes, or with ``in_process`` in this
        one: the Executor), also adding up the CPU it cost to ``cpu[key]``: its child
        processes' (``client``, all reaped when it returns; with ``in_process``, this
        process's own too) and, with ``daemon``, the fiberd's of ``site`` (default: the
        site's) and what runs under it (bench/clone.py's roles)."""
        def counted(n: int) -> None:
            proc = (site or self.site).proc
            assert proc is not None
            roles = ("fiberd", "template", "fibers", "helpers") if daemon else ()
            before, kids = cpu_by_role(proc.pid), _children_cpu()
            own = time.process_time()
            run(n)
            mine = time.process_time() - own if in_process else 0.0
            after = cpu_by_role(proc.pid)
            acc = self.cpu.setdefault(key, {})
            for role in roles:
                acc[role] = acc.get(role, 0.0) + after[role] - before[role]
            acc["client"] = acc.get("client", 0.0) + _children_cpu() - kids + mine
            acc["tasks"] = acc.get("tasks", 0.0) + n
        return counted

    def _threads(self, one: Seq) -> Par:
        def many(n: int) -> None:
            with cf.ThreadPoolExecutor(self.jobs) as pool:
                list(pool.map(one, range(n)))
        return many

    def _subprocess(self) -> None:
        def w1(_i: int) -> None:
            subprocess.run(["true"], check=True)

        def w2(i: int) -> None:
            subprocess.run(python_w2(i, self.preloads), check=True)

        self.seq["subprocess", "W1"], self.seq["subprocess", "W2"] = w1, w2
        self.par["subprocess", "W1"] = self._threads(w1)
        self.par["subprocess", "W2"] = self._threads(w2)

    def _pool(self) -> None:
        from bench import taskfns

        pool = multiprocessing.get_context("fork").Pool(
            self.jobs, initializer=_import_all, initargs=((*self.preloads, FNS),))
        self.closers.append(pool.terminate)
        self.seq["pool", "W1"] = lambda i: pool.apply(taskfns.run_true, (i,))
        self.seq["pool", "W2"] = lambda i: pool.apply(taskfns.square, (i,))
        self.par["pool", "W1"] = lambda n: pool.map(taskfns.run_true, range(n), chunksize=1)
        self.par["pool", "W2"] = lambda n: pool.map(taskfns.square, range(n), chunksize=1)

    def _forkserver(self) -> None:
        def program(w: str, mode: str, n: int) -> object:
            done = subprocess.run([sys.executable, "-c", _FORKSERVER, w, mode, str(n),
                                   str(self.jobs), *self.preloads, FNS],
                                  check=True, capture_output=True, text=True)
            return json.loads(done.stdout)

        for w in ("W1", "W2"):
            self.batch["forkserver", w] = lambda n, w=w: program(w, "seq", n)  # type: ignore[misc]
            self.par["forkserver", w] = lambda n, w=w: program(w, "par", n)  # type: ignore[misc]

    def _parallel(self) -> None:
        found = shutil.which("parallel")
        if found is None:
            self.skipped["parallel"] = "GNU parallel is not installed (apt-get install parallel)"
            return
        code = " ".join(python_w2(0, self.preloads)[:2]) + ' "' + \
            python_w2(0, self.preloads)[2].replace("square(0)", "square({})") + '"'

        def run(command: list[str], n: int) -> None:
            subprocess.run([found, "--will-cite", "-j", str(self.jobs), *command, ":::",
                            *map(str, range(n))], check=True, stdout=subprocess.DEVNULL)

        self.par["parallel", "W1"] = self._cpu_counted("parallel/W1",
                                                        lambda n: run(["true"], n), False)
        self.par["parallel", "W2"] = lambda n: run([code], n)

    def _dask(self) -> None:
        try:
            from dask.distributed import Client, LocalCluster
        except ImportError:
            self.skipped["dask"] = "dask[distributed] is not installed (pip install " \
                                   "'slurm-fiber[bench]')"
            return
        from bench import taskfns

        up: list[Client] = []  # the client of the cluster up, while Dask is measured

        @contextlib.contextmanager
        def cluster() -> Iterator[None]:
            before = set(multiprocessing.active_children())
            with LocalCluster(n_workers=self.jobs, threads_per_worker=1, processes=True,
                              dashboard_address=None) as cluster, Client(cluster) as client:
                client.run(_import_all, (*self.preloads, FNS))
                client.submit(taskfns.square, 0, pure=False).result()
                up.append(client)
                try:
                    yield
                finally:
                    up.clear()
            for worker in set(multiprocessing.active_children()) - before:
                worker.join(DASK_GONE_WITHIN)  # its exit is no other system's load

        self.sessions["dask"] = cluster
        self.seq["dask", "W1"] = lambda i: up[0].submit(taskfns.run_true, i, pure=False).result()
        self.seq["dask", "W2"] = lambda i: up[0].submit(taskfns.square, i, pure=False).result()
        self.par["dask", "W1"] = lambda n: up[0].gather(
            up[0].map(taskfns.run_true, range(n), pure=False))
        self.par["dask", "W2"] = lambda n: up[0].gather(
            up[0].map(taskfns.square, range(n), pure=False))

    def _fiber(self) -> None:
        from bench import taskfns

        runner = TaskRunner(self.site.socket, grant=GRANT)
        executor = Executor(self.jobs, socket=self.site.socket, grant=GRANT)
        self.closers += [runner.close, executor.shutdown]

        def w1(_i: int) -> None:
            outcome = runner.run(Task(exec={"argv": ["true"], "cwd": "/"},
                                      stdio={"stdout": 1, "stderr": 2}))
            if not outcome.ok:
                raise RuntimeError(f"exec Clone failed: {outcome}")

        def w2(i: int) -> None:
            if executor.submit(taskfns.square, i).result() != i * i:
                raise RuntimeError("the Executor returned a wrong square")

        self.seq["fiber", "W1"], self.seq["fiber", "W2"] = w1, w2
        self.par["fiber", "W1"] = self._threads(w1)
        self.par["fiber", "W2"] = lambda n: list(executor.map(taskfns.square, range(n)))

    def _fibermap(self) -> None:
        def run(extra: list[str], n: int) -> None:
            subprocess.run([FIBERCTL, "map", "-S", str(self.site.socket), "-g", GRANT,
                            "-j", str(self.jobs), "--range", f"1-{n}", *extra], check=True,
                           stdout=subprocess.DEVNULL, cwd="/")

        self.par["fibermap", "W1"] = self._cpu_counted(
            "fibermap/W1", lambda n: run(["--", "true"], n), True)
        self.par["fibermap", "W2"] = self._cpu_counted(
            "fibermap/W2", lambda n: run(["--call", f"{FNS}:square_arg"], n), True)


    def _executor_w2(self, name: str, site: Site) -> None:
        """W2 through ``Executor(windows=True)`` against ``site``'s fiberd (``executor_w``:
        fiberd's own path; ``fiber_tw``: the task-window fiberd): a lone ``submit`` for the
        sequential samples (a lone call goes as one Clone, windows or not), ``map`` for the
        throughput (windows), as ``fiber``'s W2, with its CPU per task per process
        (``client``: this process's, the Executor's threads)."""
        from bench import taskfns

        executor = Executor(self.jobs, socket=site.socket, grant=GRANT, windows=True)
        self.closers.append(executor.shutdown)

        def w2(i: int) -> None:
            if executor.submit(taskfns.square, i).result() != i * i:
                raise RuntimeError("the Executor returned a wrong square")

        self.seq[name, "W2"] = w2
        self.par[name, "W2"] = self._cpu_counted(
            f"{name}/W2", lambda n: list(executor.map(taskfns.square, range(n))), True, site,
            in_process=True)

    def _fibermap_tw(self, site: Site) -> None:
        """``fiberctl map`` against a fiberd with ``task_window = "template"`` (the
        task-window prototype, docs/design.md): W1 of ``true`` and W2 with ``--call``, as
        ``fibermap``'s, each with its CPU per task per process (W2's call items run in the
        template's window too)."""
        def run(extra: list[str], n: int) -> None:
            subprocess.run([FIBERCTL, "map", "-S", str(site.socket), "-g", GRANT,
                            "-j", str(self.jobs), "--range", f"1-{n}", *extra],
                           check=True, stdout=subprocess.DEVNULL, cwd="/")

        self.par["fibermap_tw", "W1"] = self._cpu_counted(
            "fibermap_tw/W1", lambda n: run(["--", "true"], n), True, site)
        self.par["fibermap_tw", "W2"] = self._cpu_counted(
            "fibermap_tw/W2", lambda n: run(["--call", f"{FNS}:square_arg"], n), True, site)


SRUN_TRUE = ["srun", "--overlap", "-n1", "true"]


def slurm_in_job(n: int, seq_n: int, jobs: int, rounds: int) -> dict[str, object]:
    """Inside the bench's own job: its fiberd started and ready, then (see the module doc)
    the sequential samples and the map against srun steps; fiberd stopped at the end.
    Then what bounds the map: one more map of N under a fiberd that leaves its audit
    records' fsync to the kernel (``audit_fsync = never``; the job's fiberd has each clone
    record fsynced before answering, by its helper process, core/audit_syncer.py). Raises
    slurm.BenchFailed with one line when a step or a map fails."""
    ways = {"fiberctl_run": [FIBERCTL, "run", "--", "true"], "srun_step": SRUN_TRUE,
            "python_floor": [sys.executable, "-I", "-S", "-c", "pass"]}
    samples: dict[str, list[float]] = {way: [] for way in ways}
    walls = {"map": 0.0, "srun_steps": 0.0}
    map_argv = [FIBERCTL, "map", "-j", str(jobs), "--range", f"1-{n}", "--", "true"]
    with _job_fiberd("fiberd") as ready_s:
        for round_no in range(seq_n + 1):
            for way, argv in ways.items():
                took = slurm.timed(argv)
                if round_no:  # round 0 warms up
                    samples[way].append(took)
        for _ in range(rounds):  # the whole N each time: one map of N is what is compared
            walls["map"] += slurm.timed(map_argv)
            start = time.perf_counter()
            with cf.ThreadPoolExecutor(jobs) as pool:
                list(pool.map(lambda _i: slurm.timed(SRUN_TRUE), range(n)))
            walls["srun_steps"] += time.perf_counter() - start
    with _job_fiberd("fiberd-fsync-never", FIBERD_AUDIT_FSYNC="never"):
        unsynced = statistics.mean(slurm.timed(map_argv) for _ in range(rounds))
    return {"fiberd_ready_s": round(ready_s, 2), "tasks": n, "jobs": jobs,
            **{way: percentiles(values) for way, values in samples.items()},
            **{f"{way}_wall_s": round(wall / rounds, 3) for way, wall in walls.items()},
            **{f"{way}_tasks_per_s": round(n * rounds / wall, 1) for way, wall in walls.items()},
            "map_audit_fsync_never_wall_s": round(unsynced, 3)}


@contextlib.contextmanager
def _job_fiberd(log_name: str, **env: str) -> Iterator[float]:
    """The job's fiberd (``srun --overlap fiberd-run``, with ``env`` added), ready: yields
    the seconds it took; stopped on exit. Raises slurm.BenchFailed when it is not ready."""
    with open(f"{log_name}-{os.environ['SLURM_JOB_ID']}.log", "wb") as log:
        step = subprocess.Popen(["srun", "--overlap", "-n1", str(slurm.BIN / "fiberd-run")],
                                stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                env=slurm.fiberd_env(**env))
        try:
            yield slurm.wait_ready(step)
        finally:
            step.terminate()
            step.wait(timeout=30)


def slurm_targets(figures: dict[str, object]) -> dict[str, dict[str, object]]:
    """Issue 14's two Slurm targets and what bounds the first (the interpreter's start)."""
    p50 = {way: figures[way]["p50_ms"] for way in ("fiberctl_run", "srun_step",  # type: ignore[index]
                                                   "python_floor")}
    run_over_srun = round(p50["fiberctl_run"] / p50["srun_step"], 2)
    srun_over_map = round(float(figures["srun_steps_wall_s"])  # type: ignore[arg-type]
                          / float(figures["map_wall_s"]), 2)  # type: ignore[arg-type]
    return {
        "slurm_fiberctl_run_p50_over_srun_step_p50": {
            "value": run_over_srun, "target": "<= 1", "met": run_over_srun <= 1,
            "bound_python_floor_over_srun_step": round(p50["python_floor"] / p50["srun_step"],
                                                       2)},
        "slurm_srun_steps_wall_over_map_wall": {
            "value": srun_over_map, "target": ">= 10", "met": srun_over_map >= 10,
            "bound_with_audit_fsync_never": round(
                float(figures["srun_steps_wall_s"])  # type: ignore[arg-type]
                / float(figures["map_audit_fsync_never_wall_s"]), 2)},  # type: ignore[arg-type]
    }


def _import_all(modules: tuple[str, ...]) -> None:
    for m in modules:
        __import__(m)


def _children_cpu() -> float:
    """CPU seconds of this process's children that it has reaped so far."""
    used = os.times()
    return used.children_user + used.children_system


def cpu_per_task(cpu: dict[str, dict[str, float]], par: dict[str, list[tuple[int, float]]],
                 cores: int) -> dict[str, dict[str, float]]:
    """By ``system/W``: CPU ms per task by role and in all (``total``), the throughput that
    CPU allows on ``cores`` CPUs (``cpu_bound_per_s``) and the share of it reached."""
    out: dict[str, dict[str, float]] = {}
    for key, acc in cpu.items():
        tasks = acc.get("tasks", 0.0)
        if not tasks:
            continue
        row = {role: round(v / tasks * 1000, 3) for role, v in acc.items() if role != "tasks"}
        row["total"] = round(sum(v for r, v in acc.items() if r != "tasks") / tasks * 1000, 3)
        row["cpu_bound_per_s"] = round(cores * 1000 / row["total"], 1) if row["total"] else 0.0
        runs = par.get(key, [])
        rate = sum(n for n, _ in runs) / sum(t for _, t in runs) if runs else 0.0
        row["share_of_bound"] = round(rate / row["cpu_bound_per_s"], 2) if rate and \
            row["cpu_bound_per_s"] else 0.0
        out[key] = row
    return out


def split(total: int, rounds: int) -> list[int]:
    return [max(1, total // rounds + (i < total % rounds)) for i in range(rounds)]


def measure(systems: Systems, n: int, seq_n: int, rounds: int
            ) -> tuple[dict[str, list[float]], dict[str, list[tuple[int, float]]]]:
    """Sequential samples (seconds per task) and throughput runs (tasks, seconds), by
    ``system/W``, in interleaved rounds."""
    seq: dict[str, list[float]] = {}
    par: dict[str, list[tuple[int, float]]] = {}
    for k, (n_i, s_i) in enumerate(zip(split(n, rounds), split(seq_n, rounds),
                                       strict=True)):
        print(f"round {k + 1}/{rounds}: {s_i} sequential and {n_i} parallel tasks per system",
              file=sys.stderr)
        for system in dict.fromkeys(name for name, _ in [*systems.seq, *systems.batch,
                                                         *systems.par]):
            with systems.session(system):
                measure_round(systems, system, s_i, n_i, seq, par)
        if "fiber" not in systems.skipped:
            seq.setdefault("clone/call", []).extend(clone_round_trips(
                systems.site.socket, "call", s_i, grant=GRANT, warmup=1 if k == 0 else 0))
    return seq, par


def measure_round(systems: Systems, system: str, seq_n: int, n: int,
                  seq: dict[str, list[float]], par: dict[str, list[tuple[int, float]]]) -> None:
    """One round of ``system``: its sequential samples (``seq_n`` per workload) and its
    throughput runs (``n`` tasks each), added to ``seq`` and ``par``."""
    for (name, w), one in systems.seq.items():
        if name == system:
            samples = seq.setdefault(f"{name}/{w}", [])
            for i in range(seq_n):
                start = time.perf_counter()
                one(i)
                samples.append(time.perf_counter() - start)
    for (name, w), batch in systems.batch.items():
        if name == system:
            seq.setdefault(f"{name}/{w}", []).extend(batch(seq_n))
    for (name, w), many in systems.par.items():
        if name == system:
            start = time.perf_counter()
            took = many(n)
            wall = took if isinstance(took, float) else time.perf_counter() - start
            par.setdefault(f"{name}/{w}", []).append((n, wall))


def report(seq: dict[str, list[float]], par: dict[str, list[tuple[int, float]]],
           bound: list[float], jobs: int, skipped: dict[str, str]) -> dict[str, object]:
    """Figures per system and workload, and the ratios behind issue 14's targets."""
    systems: dict[str, dict[str, object]] = {}
    clone = seq.pop("clone/call", [])
    for key in sorted({*seq, *par}):
        name, w = key.split("/")
        row = systems.setdefault(name, {"fresh_process": FRESH[name]})
        entry: dict[str, object] = {}
        if key in seq:
            entry.update(percentiles(seq[key]))
        if key in par:
            tasks = sum(t for t, _ in par[key])
            wall = sum(s for _, s in par[key])
            entry["tasks_per_s"] = round(tasks / wall, 1)
        row[w] = entry
    for name, why in skipped.items():
        systems[name] = {"fresh_process": FRESH.get(name, "?"), "skipped": why}

    def fig(name: str, w: str, what: str) -> float | None:
        value = systems.get(name, {}).get(w, {})
        return value.get(what) if isinstance(value, dict) else None  # type: ignore[return-value]

    def over(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else round(a / b, 2)

    best_w2 = max(filter(None, (fig("fiber", "W2", "tasks_per_s"),
                                fig("fibermap", "W2", "tasks_per_s"))), default=None)
    targets = {
        "w2_throughput_fiber_over_dask": {
            "value": over(best_w2, fig("dask", "W2", "tasks_per_s")), "target": ">= 1"},
        "w2_seq_p50_executor_over_dask": {
            "value": over(fig("fiber", "W2", "p50_ms"), fig("dask", "W2", "p50_ms")),
            "target": "<= 0.3"},
        "w1_seq_p50_exec_over_subprocess": {
            "value": over(fig("fiber", "W1", "p50_ms"), fig("subprocess", "W1", "p50_ms")),
            "target": "<= 2.5"},
        "w1_throughput_map_over_parallel": {
            "value": over(fig("fibermap", "W1", "tasks_per_s"),
                          fig("parallel", "W1", "tasks_per_s")), "target": ">= 3"},
    }
    if "fibermap_tw" in systems and "W1" in systems["fibermap_tw"]:  # --window-path template
        targets["w1_throughput_map_tw_over_parallel"] = {
            "value": over(fig("fibermap_tw", "W1", "tasks_per_s"),
                          fig("parallel", "W1", "tasks_per_s")), "target": ">= 3"}
        targets["w1_throughput_map_tw_over_dask"] = {
            "value": over(fig("fibermap_tw", "W1", "tasks_per_s"),
                          fig("dask", "W1", "tasks_per_s")), "target": ">= 1"}
        targets["w1_throughput_map_tw_over_map"] = {
            "value": over(fig("fibermap_tw", "W1", "tasks_per_s"),
                          fig("fibermap", "W1", "tasks_per_s")), "target": ">= 1"}
    for name, key in (("fiber_tw", "fiber_tw"), ("fibermap_tw", "map_tw"),
                      ("executor_w", "executor_w")):  # --window-path template: W2
        if "W2" in systems.get(name, {}):
            targets[f"w2_throughput_{key}_over_dask"] = {
                "value": over(fig(name, "W2", "tasks_per_s"), fig("dask", "W2", "tasks_per_s")),
                "target": ">= 1"}
    for name in ("fiber_tw", "executor_w"):
        if "W2" in systems.get(name, {}):
            targets[f"w2_seq_p50_{name}_over_dask"] = {
                "value": over(fig(name, "W2", "p50_ms"), fig("dask", "W2", "p50_ms")),
                "target": "<= 0.3"}
    for t in targets.values():
        v, goal = t["value"], str(t["target"])
        limit = float(goal.split()[1])
        t["met"] = None if v is None else (v >= limit if goal.startswith(">") else v <= limit)
    bound_p50 = statistics.median(bound) * 1000 if bound else None
    clone_p50 = statistics.median(clone) * 1000 if clone else None
    bounds = {
        "pipeline_p50_ms": None if bound_p50 is None else round(bound_p50, 3),
        "pipeline_tasks_per_s_at_j": None if not bound_p50 else round(jobs * 1000 / bound_p50, 1),
        "clone_call_p50_ms": None if clone_p50 is None else round(clone_p50, 3),
        "clone_call_over_pipeline": over(clone_p50, bound_p50),
        "executor_w2_p50_over_clone_call": over(fig("fiber", "W2", "p50_ms"), clone_p50),
        "exec_w1_p50_over_clone_call": over(fig("fiber", "W1", "p50_ms"), clone_p50),
        "dask_w2_p50_over_pipeline": over(fig("dask", "W2", "p50_ms"), bound_p50),
    }
    return {"systems": systems, "targets": targets, "bound": bounds}


FLOOR_TASKS = 250  # per floor worker at least: CPU is read in clock ticks
FLOOR_OF = {"w1_throughput_map_over_parallel": ("W1", "parallel"),  # workload, the peer
            "w2_throughput_fiber_over_dask": ("W2", "dask")}


def floor_budgets(figures: dict[str, object]) -> dict[str, dict[str, object]]:
    """For each throughput target: the rate it asks for in this run (its goal times the
    peer's rate), the CPU per task that rate leaves on this machine's CPUs, what the
    confined floor (bench/confined_floor.py) reaches and spends of it, and what
    ``fiberctl map`` spends; the targets' other keys are kept."""
    cores = len(os.sched_getaffinity(0))
    targets, floor, systems = figures["targets"], figures["floor"], figures["systems"]
    cpu = figures["cpu_per_task_ms"]
    assert isinstance(targets, dict) and isinstance(floor, dict) and isinstance(cpu, dict)
    assert isinstance(systems, dict)
    out: dict[str, dict[str, object]] = {}
    for key, (w, peer) in FLOOR_OF.items():
        target = targets[key]
        goal = float(str(target["target"]).split()[1])
        peer_rate = systems[peer].get(w, {}).get("tasks_per_s")
        needed = goal * peer_rate if peer_rate else None
        out[key] = {**target, "needs_tasks_per_s": None if needed is None else round(needed, 1),
                    "needs_cpu_per_task_ms": None if not needed
                    else round(cores * 1000 / needed, 3),
                    "floor_tasks_per_s": floor[w]["tasks_per_s"],
                    "floor_cpu_per_task_ms": floor[w]["cpu_per_task_ms"],
                    "map_cpu_per_task_ms": cpu.get(f"fibermap/{w}", {}).get("total")}
    return out


def host_facts() -> dict[str, object]:
    """What the figures depend on beyond the code: the kernel, the host's cgroup mode and
    the cgroup2 mount's options (``favordynmods`` makes moves cheaper and outlives the
    experiment that set it), and fiberd's audit fsync as every row ran it."""
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    cgroup2 = [m for m in mounts if len(m) > 3 and m[2] == "cgroup2"]
    v1 = any(len(m) > 2 and m[2] == "cgroup" for m in mounts)
    mode = "hybrid" if cgroup2 and v1 else "unified" if cgroup2 else "legacy"
    return {"kernel": os.uname().release, "cgroup_mode": mode,
            "cgroup2_mounts": {m[1]: m[3] for m in cgroup2},
            "audit_fsync": "fiberd's default (always)"}


def install_peers() -> None:
    """Install the peers a fresh clone lacks, saying so: Dask distributed into this
    interpreter's environment (the ``bench`` extra's pin), GNU parallel from Debian (as
    root). Whatever cannot be installed is a stated skip of its rows, never a failure."""
    try:
        import distributed  # noqa: F401
    except ImportError:
        spec = next(r for r in BENCH_EXTRA if r.startswith("dask"))
        print(f"bench/tasks.py: installing {spec} (the peer Dask)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                        "--disable-pip-version-check", spec], check=False)
    if shutil.which("parallel") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        print("bench/tasks.py: installing Debian's parallel (the peer GNU parallel)",
              file=sys.stderr)
        subprocess.run(["apt-get", "install", "-y", "-q", "parallel"], check=False,
                       stdout=subprocess.DEVNULL)


def print_table(figures: dict[str, object]) -> None:
    systems = figures["systems"]
    assert isinstance(systems, dict)
    host = figures["host"]
    assert isinstance(host, dict)
    print(f"host: kernel {host['kernel']}, cgroups {host['cgroup_mode']}, cgroup2 mounts "
          + ", ".join(f"{where} ({opts})" for where, opts in host["cgroup2_mounts"].items())
          + f"; audit fsync: {host['audit_fsync']}")
    print(f"{'system':12}{'fresh proc':>14}{'W1 p50 ms':>11}{'W1 /s':>9}"
          f"{'W2 p50 ms':>11}{'W2 /s':>9}")
    for name, row in systems.items():
        if "skipped" in row:
            print(f"{name:12}{row['fresh_process']:>14}  skipped: {row['skipped']}")
            continue
        cells = []
        for w in ("W1", "W2"):
            entry = row.get(w, {})
            p50, rate = entry.get("p50_ms"), entry.get("tasks_per_s")
            cells.append(f"{'-' if p50 is None else f'{p50:.1f}':>11}"
                         f"{'-' if rate is None else f'{rate:.0f}':>9}")
        print(f"{name:12}{row['fresh_process']:>14}{''.join(cells)}")
    s = figures.get("slurm")
    if isinstance(s, dict):
        print(f"in a Slurm job {s['job']}: fiberctl run -- true p50 {s['fiberctl_run']['p50_ms']} "
              f"ms, srun step p50 {s['srun_step']['p50_ms']} ms, python -I -S -c pass p50 "
              f"{s['python_floor']['p50_ms']} ms; {s['tasks']} tasks of true at -j{s['jobs']}: "
              f"fiberctl map {s['map_wall_s']} s, srun steps {s['srun_steps_wall_s']} s; "
              f"the map under a fiberd with audit_fsync = never "
              f"{s['map_audit_fsync_never_wall_s']} s")
    for key, t in figures["targets"].items():  # type: ignore[union-attr]
        state = {None: "n/a", True: "meets", False: "MISSES"}[t["met"]]
        print(f"{key}: {t['value']} ({state} {t['target']})")
    b = figures["bound"]
    assert isinstance(b, dict)
    print(f"bound: pre-forked spare pipeline (no daemon work) p50 {b['pipeline_p50_ms']} ms "
          f"({b['pipeline_tasks_per_s_at_j']}/s at -j); bare call Clone p50 "
          f"{b['clone_call_p50_ms']} ms = {b['clone_call_over_pipeline']}x the bound "
          f"(fiberd's share); Executor W2 p50 = {b['executor_w2_p50_over_clone_call']}x, "
          f"exec W1 p50 = {b['exec_w1_p50_over_clone_call']}x the bare Clone")
    floor = figures["floor"]
    assert isinstance(floor, dict)
    where = f"its own leaf in {len(floor['hierarchies'])} cgroup hierarchies" \
        if floor["hierarchies"] else "no cgroup (fiberd runs uncarved)"
    for key in FLOOR_OF:
        t = figures["targets"][key]  # type: ignore[index]
        if t.get("needs_tasks_per_s") is None:
            continue
        w = FLOOR_OF[key][0]
        print(f"floor, {key}: it asks {t['needs_tasks_per_s']}/s, "
              f"{t['needs_cpu_per_task_ms']} ms CPU per task; a fresh {w} process in "
              f"{where}, no daemon: {t['floor_tasks_per_s']}/s, "
              f"{t['floor_cpu_per_task_ms']} ms CPU; fiberctl map: "
              f"{t['map_cpu_per_task_ms']} ms CPU")
    fork = floor.get("W1-fork")
    if isinstance(fork, dict):
        print(f"floor, W1 forked in {where} and exec'd (as a spare would, not spawned): "
              f"{fork['tasks_per_s']}/s, {fork['cpu_per_task_ms']} ms CPU")
    for key, row in figures.get("cpu_per_task_ms", {}).items():  # type: ignore[union-attr]
        parts = ", ".join(f"{role} {ms}" for role, ms in row.items()
                          if role not in ("total", "cpu_bound_per_s", "share_of_bound"))
        print(f"CPU per task, {key}: {row['total']} ms ({parts}): at most "
              f"{row['cpu_bound_per_s']}/s on {len(os.sched_getaffinity(0))} CPUs, "
              f"{row['share_of_bound']} of it reached")


def plot(figures: dict[str, object], seq: dict[str, list[float]], path: Path) -> None:
    """Throughput bars (W1, W2 per system) and sequential latency CDFs, as a PNG."""
    plt = plots.pyplot()
    systems = {k: v for k, v in figures["systems"].items()  # type: ignore[union-attr]
               if "skipped" not in v}
    fig, (bars, cdf) = plt.subplots(1, 2, figsize=(13, 5))
    names = list(systems)
    for offset, w in ((-0.2, "W1"), (0.2, "W2")):
        rates = [systems[s].get(w, {}).get("tasks_per_s") or 0 for s in names]
        bars.bar([i + offset for i in range(len(names))], rates, width=0.4, label=w)
    bars.set_xticks(range(len(names)), names, rotation=30)
    bars.set_yscale("log")
    bars.set_ylabel("tasks per second (log)")
    bars.set_title("throughput at the natural parallelism")
    bars.legend()
    plots.latency_cdfs(cdf, seq, xlabel="submit → result (ms, log)",
                       ylabel="fraction of tasks", title="sequential latency CDF",
                       legend_size=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=200, help="tasks per throughput run")
    parser.add_argument("--seq", type=int, help="sequential samples (default: n / 2)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    parser.add_argument("-j", "--jobs", type=int, default=len(os.sched_getaffinity(0)),
                        help="the natural parallelism (default: usable CPUs)")
    parser.add_argument("--skip", default="", help="comma-separated systems to leave out")
    parser.add_argument("--cgroup-root", default="delegate", help="fiberd's cgroup root")
    parser.add_argument("--cgroup-backend", default="auto", choices=BACKEND_CHOICES,
                        help="fiberd's cgroup backend (v2 vs hybrid: what v1 placement costs)")
    parser.add_argument("--window-path", default="fiberd",
                        help="fiberd, template or both (fiberd,template): with template, "
                        "also fibermap_tw (fiberctl map, W1 and W2) and fiber_tw "
                        "(Executor(windows=True), W2) against a second fiberd running "
                        "windows in its template (task_window = template), and executor_w "
                        "(Executor(windows=True) against the first), in the same "
                        "interleaved rounds")
    parser.add_argument("--plot", type=Path, metavar="FILE", help="write the PNG here")
    parser.add_argument("--slurm", action="store_true",
                        help="also fiberctl against srun steps in a job on the test cluster")
    parser.add_argument("--slurm-n", type=int, default=500,
                        help="tasks of the map against srun steps (default 500)")
    parser.add_argument("--no-install", action="store_true",
                        help="do not install missing peers (Dask, GNU parallel): skip them")
    parser.add_argument("--in-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    seq_n = opts.seq or max(1, opts.n // 2)
    rounds = max(1, min(opts.rounds, opts.n, seq_n))
    if opts.in_job:  # the --slurm job itself: -n is --slurm-n
        if opts.out is None or "SLURM_JOB_ID" not in os.environ:
            parser.error("--in-job runs inside the bench's own job, with --out")
        opts.out.write_text(json.dumps(slurm_in_job(opts.n, seq_n, opts.jobs, rounds)))
        return 0
    if not opts.no_install:
        install_peers()
    # Every process measured imports compiled bytecode, as from an installed package, even
    # where PYTHONDONTWRITEBYTECODE kept a checkout's stale: a fiberctl compiling fibermap
    # from source spent 15 ms of its start on it.
    for tree in (CHECKOUT / "slurm_fiber", CHECKOUT / "bench"):
        compileall.compile_dir(tree, quiet=1)
    preloads = tuple(DEFAULT_PRELOADS)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHECKOUT),
                                                             os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="slurm-fiber-bench-tasks-") as tmp:
        site = Site.create(Path(tmp), (*preloads, FNS))
        paths = set(opts.window_path.split(","))
        window_site = Site.create(Path(tmp) / "tw", (*preloads, FNS)) \
            if "template" in paths else None
        skip = {s for s in opts.skip.split(",") if s}
        if "fiberd" not in paths:
            skip |= {"fiber", "fibermap", "executor_w"}
        systems = None
        try:
            site.backend = opts.cgroup_backend
            site.start(opts.cgroup_root)
            site.wait_warm(120, lambda state, s: None)
            if window_site is not None:
                window_site.backend = opts.cgroup_backend
                window_site.options["task-window"] = "template"
                window_site.start(opts.cgroup_root)
                window_site.wait_warm(120, lambda state, s: None)
            status = site.request("status")
            mode = status.get("mode")
            cgroups = status.get("cgroups")
            backend = cgroups.get("backend") if isinstance(cgroups, dict) else None
            systems = Systems(opts.jobs, preloads, site, skip, window_site)
            seq, par = measure(systems, opts.n, seq_n, rounds)
            bound = spare_pipeline([*preloads, FNS], seq_n)
            skipped = dict(systems.skipped)
            cpu = cpu_per_task(systems.cpu, par, len(os.sched_getaffinity(0)))
        finally:
            if systems is not None:
                systems.close()
            site.stop()
            if window_site is not None:
                window_site.stop()
        left = site.leftovers() + (window_site.leftovers() if window_site else [])
    hierarchies = fiber_hierarchies(mode == "carved", backend)
    floor = {w: confined_floor(w, max(FLOOR_TASKS, opts.n // opts.jobs), opts.jobs,
                               [*preloads, FNS], hierarchies) for w in WORKLOADS}
    figures = {"bench": "tasks", "n": opts.n, "seq_n": seq_n, "jobs": opts.jobs,
               "rounds": rounds, "host": host_facts(), "cgroups": mode,
               "cgroup_backend": backend,
               **report(seq, par, bound, opts.jobs, skipped), "cpu_per_task_ms": cpu,
               "floor": {"hierarchies": hierarchies, **floor}, "left_running": left}
    figures["targets"].update(floor_budgets(figures))  # type: ignore[union-attr]
    if opts.slurm:
        try:
            with tempfile.TemporaryDirectory(prefix="sf-bench-tasks-slurm-") as tmp:
                os.chmod(tmp, 0o755)
                figures["slurm"] = in_job = slurm.run_job(
                    slurm.cluster_env(), 0, False, Path(tmp),
                    [str(Path(__file__).resolve()), "--in-job", "-n", str(opts.slurm_n),
                     "--seq", str(seq_n), "-j", str(opts.jobs), "--rounds", str(rounds)])
        except slurm.BenchFailed as failed:
            print(f"bench/tasks.py --slurm: {failed}", file=sys.stderr)
            return 1
        figures["targets"].update(slurm_targets(in_job))  # type: ignore[union-attr]
    print_table(figures)
    if opts.plot:
        plot(figures, seq, opts.plot)
        print(f"plot: {opts.plot}")
    print(json.dumps(figures))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
