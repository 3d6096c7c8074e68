"""Fibers as fiberd sees them: records, waiting, signals, stopping, deadlines.

A ``Fiber`` is created by ``Template.fork`` (never directly). It holds the record
DESIGN §4 asks for (id, pid, grant UID, jti, epoch, deadline, state, exit status, cpu
time, peak memory) and a pidfd on the process, so signals are race-free.

- ``wait()`` returns once the template's report (wait status, rusage) is in *and* the
  fiber's cgroup is empty, so "returned" means "nothing of it runs". Its pidfd is
  watched too: a fiber that exited while its template stops answering is accounted
  with the kernel's status after at most ``report_timeout`` seconds (``lost`` if that
  is unreadable), so ``wait()`` never hangs on a stalled template. A fiber whose
  template dies dies with it and is ``lost``.
- Output: a fiber given no stdout or stderr writes to files under the template's state
  dir (named in the record); carved, a file still empty at the end is removed; a file
  with output is never removed here; uncarved, every file is kept.
- ``stop(grace)`` sends SIGTERM, waits ``grace`` seconds on the injected Clock, then
  SIGKILLs (``cgroup.kill`` when carved, else the pidfd and the process group) and
  returns once the fiber is gone; ``stop_all`` does it for many at once.
  ``DeadlineTimer`` keeps every fiber's deadline (the core's, which may move) on one
  heap and one timer task; ``enforce_deadline`` does it for one fiber. A running fiber
  costs fiberd no wake-up while nothing happens to it.
- Reasons: whoever makes fiberd end a fiber says why first (``note_reason``; the first
  note wins) and the exit carries it as a ``StopReason``; one that died with its
  template is ``template_lost``; one fiberd did not stop that died by SIGKILL is ``oom``
  when its cgroup counts an ``oom_kill``, else ``signal`` saying whether out of memory
  is ruled out. Any other exit has no reason: the fiber ended by itself.

All coroutines run on fiberd's event loop; none block it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import heapq
import itertools
import json
import logging
import os
import signal
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from slurm_fiber.core.cgroups.common import populated
from slurm_fiber.core.cgroups.groups import kill as cgroup_kill
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.fibers.ends import LateReports, end_reading, survivors_frozen
from slurm_fiber.core.waiting import first_done, pidfd_exited, pidfd_wait, set_done, zombie_exit
from slurm_fiber.protocol.limits import MAX_RESULT

log = logging.getLogger(__name__)


class FiberState(enum.StrEnum):
    RUNNING = "running"
    STOPPING = "stopping"
    EXITED = "exited"  # reaped by the template: status known
    LOST = "lost"  # died with its template: no status


@dataclass(frozen=True)
class StopReason:
    """Why a fiber ended when fiberd (or the kernel's OOM killer) ended it: ``code`` is one
    of deadline, lease_end, fence, removed, epoch, stopped, fiberd_shutdown,
    template_lost, oom, signal; ``message`` one line for a person."""

    code: str
    message: str

    def to_json(self) -> dict[str, object]:
        return {"code": self.code, "message": self.message}


@dataclass(frozen=True)
class FiberEnd:
    """How a fiber ended. ``status`` is the raw wait status (None when lost).

    ``exit_code`` is set for a normal exit, ``signal`` for death by signal;
    ``cpu_time`` (user+system seconds) and ``maxrss`` (bytes) come from
    rusage, ``memory_peak`` (bytes) from the cgroup's memory.peak where the
    memory controller provides it. ``result`` is the call-mode record
    (``{"ok": true, "result": ...}`` or ``{"ok": false, "error": {...}}``),
    None in exec mode or when the fiber died before writing it.
    """

    state: FiberState
    status: int | None = None
    cpu_time: float | None = None
    maxrss: int | None = None
    memory_peak: int | None = None
    oom_kills: int | None = None  # processes the kernel OOM-killed in its cgroup (None: unknown)
    result: dict[str, object] | None = None
    stopped: bool = False  # fiberd stopped it (stop/deadline), vs. it ended by itself
    reason: StopReason | None = None  # why, when fiberd (or the OOM killer) ended it

    @property
    def exit_code(self) -> int | None:
        if self.status is None or not os.WIFEXITED(self.status):
            return None
        return os.WEXITSTATUS(self.status)

    @property
    def signal(self) -> int | None:
        if self.status is None or not os.WIFSIGNALED(self.status):
            return None
        return os.WTERMSIG(self.status)

    def to_json(self) -> dict[str, object]:
        return {"state": self.state.value, "exit_code": self.exit_code, "signal": self.signal,
                "cpu_time": self.cpu_time, "maxrss": self.maxrss,
                "memory_peak": self.memory_peak, "oom_kills": self.oom_kills,
                "stopped": self.stopped,
                "reason": self.reason.to_json() if self.reason else None,
                "result": self.result}


@dataclass
class Fiber:
    """One running (or ended) fiber. Built by ``Template.fork``; read by everyone.

    ``deadline`` is monotonic seconds on the core's clock (None: none set);
    ``started`` is the clock's ``mono()`` at fork. ``stdout_path`` and
    ``stderr_path`` name the output files (None: passed stdio, or, once
    ended, an empty file removed). ``report_timeout``: clock seconds the
    template's exit report may lag the fiber's exit; ``parent``: the
    template's pid (see the module doc).
    """

    id: str
    pid: int
    uid: str
    jti: str
    epoch: int
    deadline: float | None
    started: float
    mode: str
    cgroup: Path | None
    clock: Clock
    stdout_path: Path | None = None
    stderr_path: Path | None = None
    report_timeout: float = 10.0
    parent: int | None = None
    late: LateReports | None = field(default=None, repr=False)  # the template's, shared
    state: FiberState = FiberState.RUNNING
    exit: FiberEnd | None = None
    pidfd: int | None = field(default=None, repr=False)
    _reported: asyncio.Future[tuple[FiberState, dict[str, object]]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future(), repr=False)
    _result: ResultReader | None = field(default=None, repr=False)
    _finished: asyncio.Task[FiberEnd] | None = field(default=None, repr=False)
    _stopped: bool = field(default=False, repr=False)
    _cause: StopReason | None = field(default=None, repr=False)
    _killed_after: float | None = field(default=None, repr=False)

    # ------------------------------------------------------------ set-up (Template only)

    def attach(self, result_sock: socket.socket | None, pidfd: int | None) -> None:
        """Start reading the result socket (stream or datagrams, joined until end of file,
        bounded by what one reply can carry; None: a program spawned straight from the
        template, which writes no record).

        The fiber owns the socket and ``pidfd`` (opened before the process
        could exit, or None) from now on. Called once by Template.fork.
        """
        self.pidfd = pidfd
        if result_sock is not None:
            result_sock.setblocking(False)
            self._result = ResultReader(result_sock, limit=MAX_RESULT)
        self._finished = asyncio.ensure_future(self._finish())

    def reported_exit(self, msg: dict[str, object]) -> None:
        """The template reaped this fiber (its ``exit`` message)."""
        if not self._reported.done():
            self._reported.set_result((FiberState.EXITED, msg))

    def template_lost(self, why: str | None = None) -> None:
        """The template died (``why``: its last fault): this fiber dies with it; account it
        once its pid is gone."""
        self.note_reason("template_lost", "its template was lost"
                         f"{f' ({why})' if why else ''}, and the fiber with it")
        if not self._reported.done():
            self._reported.set_result((FiberState.LOST, {}))

    # ------------------------------------------------------------ public

    @property
    def running(self) -> bool:
        return self.exit is None

    def note_reason(self, code: str, message: str) -> None:
        """Say why fiberd is ending this fiber, before it does (``StopReason``'s codes). The
        first note of a running fiber counts; later ones are ignored."""
        if self._cause is None and self.exit is None:
            self._cause = StopReason(code, message)

    async def wait(self) -> FiberEnd:
        """Block until the fiber and its cgroup are gone; its exit. Never raises."""
        assert self._finished is not None, "Fiber.attach was not called"
        return await asyncio.shield(self._finished)

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to the fiber and its process group (Ctrl-C forwarding).

        False if the fiber has ended. Each process gets the signal once (a
        second SIGINT would interrupt the fiber's own handling of the first):
        ``killpg`` on the group the fiber leads (it exists once the fork is
        answered, and its id cannot be reused while the unreaped leader
        holds it), the pidfd when the group is gone.
        """
        if self.exit is not None or self.pidfd is None or pidfd_exited(self.pidfd):
            return False
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except ProcessLookupError:
                return False
        return True

    async def stop(self, grace: float) -> FiberEnd:
        """SIGTERM, ``grace`` seconds on the clock, then SIGKILL; returns once it is gone.

        Carved, "gone" includes every descendant (the cgroup is empty).
        Uncarved, the fiber's process group gets the signals, only
        the fiber itself is waited for, and the template SIGKILLs what is
        left in the group when it reaps the fiber; a descendant that left
        the group (setsid) is out of reach. Safe to call twice or on an ended
        fiber (returns its exit at once).
        """
        if self.exit is not None:
            return self.exit
        self._terminate()
        waiter = asyncio.ensure_future(self.wait())
        if not await first_done(waiter, self.clock.sleep(grace)):
            self._kill_after(grace)
        return await waiter

    def _terminate(self) -> None:
        """The start of a stop: marked stopping, SIGTERM to it and its group."""
        self._stopped = True
        if self.state is FiberState.RUNNING:
            self.state = FiberState.STOPPING
        self.signal(signal.SIGTERM)

    def _kill_after(self, grace: float, cgroup_killed: bool = False) -> None:
        """The end of a stop's grace: SIGKILL unless it has ended meanwhile
        (``cgroup_killed``: the caller killed a cgroup holding this fiber's; the fiber
        and its process group still get theirs, in case the fiber left that cgroup)."""
        if self.exit is None:
            self._killed_after = grace
            if cgroup_killed:
                self._kill_leader()
            else:
                self.kill()

    def kill(self) -> None:
        """SIGKILL now: the whole cgroup when carved, and the pidfd and process group.
        An emptied cgroup is left alone (``cgroup.kill`` waits on the kernel's cgroup lock,
        which thousands of fibers ending at once contend for)."""
        if self.cgroup is not None and populated(self.cgroup):
            cgroup_kill(self.cgroup)
        self._kill_leader()

    def _kill_leader(self) -> None:
        """SIGKILL the fiber's process (by its pidfd) and the process group it leads."""
        if self.pidfd is not None and not pidfd_exited(self.pidfd):
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    def to_json(self) -> dict[str, object]:
        """The fiber record, for the socket API and the audit log."""
        return {"id": self.id, "pid": self.pid, "uid": self.uid, "jti": self.jti,
                "epoch": self.epoch, "deadline": self.deadline, "started": self.started,
                "mode": self.mode, "state": self.state.value,
                "cgroup": str(self.cgroup) if self.cgroup else None,
                "stdout": str(self.stdout_path) if self.stdout_path else None,
                "stderr": str(self.stderr_path) if self.stderr_path else None,
                "exit": self.exit.to_json() if self.exit else None}

    async def written(self) -> dict[str, object] | None:
        """The call-mode record once the fiber has written all of it (its result channel
        at end of file, which may be before its exit is known), or at its end; None when
        it wrote none. Never raises."""
        assert self._finished is not None, "Fiber.attach was not called"
        if self._result is None:
            return None
        await asyncio.shield(self._result.complete)
        return self._result.record()

    def on_done(self, callback: Callable[[Fiber], None]) -> None:
        """Call ``callback(self)`` once the fiber is gone (after ``wait()`` would return)."""
        assert self._finished is not None, "Fiber.attach was not called"
        self._finished.add_done_callback(lambda _: callback(self))

    # ------------------------------------------------------------ internals

    async def _outcome(self) -> tuple[FiberState, dict[str, object]]:
        """How the fiber ended: the template's report; else, when none comes within
        ``report_timeout`` of the fiber's exit (a stalled template), the kernel's record;
        ``lost`` when neither is known. Returns once the fiber process has exited.

        Thousands end at once in a mass stop, so the common path creates no task: one
        future woken by the report or the pidfd, and the kernel's record read only when
        the report has not come with the exit."""
        pidfd = self.pidfd
        if pidfd is None:
            return await self._reported
        await pidfd_wait(pidfd, or_done=self._reported)
        if self._reported.done():
            state, msg = self._reported.result()
            if state is FiberState.LOST:  # its template died: it dies by its death signal
                if not pidfd_exited(pidfd):
                    self.kill()  # and by ours, with its process group or cgroup
                await pidfd_wait(pidfd)
            return state, msg
        # Read now (reaped once the template is gone), and only while the template's child:
        # one that died after its template did died with it (lost).
        kernel = zombie_exit(self.pid, pidfd, self.parent)
        late = self.late if self.late is not None else LateReports(self.clock)
        if await late.wait(self._reported, self.report_timeout, self.pid):
            state, msg = self._reported.result()
            if state is FiberState.EXITED or kernel is None:
                return state, msg
        if kernel is not None:
            return FiberState.EXITED, kernel
        return FiberState.LOST, {}

    async def _finish(self) -> FiberEnd:
        state, msg = await self._outcome()
        peak = ooms = None
        if self.cgroup is not None:
            found = await end_reading(self.cgroup, self.stdout_path, self.stderr_path)
            peak, ooms = found.peak, found.oom_kills
            self.stdout_path, self.stderr_path = found.stdout, found.stderr
        result = self._result.finish() if self._result is not None else None
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        status = msg.get("status")
        status = status if isinstance(status, int) else None
        cpu = msg.get("cpu")
        maxrss = msg.get("maxrss")
        self.exit = FiberEnd(
            state=state, status=status,
            cpu_time=float(cpu) if isinstance(cpu, int | float) else None,
            maxrss=maxrss if isinstance(maxrss, int) else None,
            memory_peak=peak, oom_kills=ooms, result=result, stopped=self._stopped,
            reason=self._reason(state, status, ooms))
        self.state = state
        return self.exit

    def _reason(self, state: FiberState, status: int | None,
                kills: int | None) -> StopReason | None:
        """Why it ended (see the module doc), from its cgroup's OOM count ``kills`` (None:
        unknown) once it is gone."""
        cause = self._cause
        if cause is None and state is FiberState.LOST:
            cause = StopReason("template_lost", "its template was lost, and the fiber with it")
        if cause is not None:
            if self._killed_after is not None:
                return StopReason(cause.code, f"{cause.message}, killed after "
                                  f"{self._killed_after:g} s grace")
            if self._stopped:
                on_term = (status is not None and os.WIFSIGNALED(status)
                           and os.WTERMSIG(status) == signal.SIGTERM)
                how = "ended on SIGTERM" if on_term else "exited within the grace after SIGTERM"
                return StopReason(cause.code, f"{cause.message}, {how}")
            return cause
        if status is None or not os.WIFSIGNALED(status) or os.WTERMSIG(status) != signal.SIGKILL:
            return None
        if kills:
            return StopReason("oom", "out of memory: the kernel's OOM killer killed it "
                              "(its cgroup counts an oom_kill)")
        if kills is None:
            return StopReason("signal", "killed by SIGKILL, not by fiberd (whether out of "
                              "memory is not known: no memory controller in its cgroup)")
        return StopReason("signal", "killed by SIGKILL, not by fiberd and not out of memory")


async def stop_all(fibers: Iterable[Fiber], grace: float,
                   kill_all: Callable[[], None] | None = None) -> list[FiberEnd]:
    """Stop every fiber at once, as ``Fiber.stop`` does one: SIGTERM to each, one grace on
    the clock for all (one timer, not one per fiber), SIGKILL to those still running;
    returns their exits (in order) once all are gone. ``kill_all``, when given, kills
    all their cgroups in one call (the ``cgroup.kill`` of a cgroup holding every one,
    and nothing that must live), instead of a ``cgroup.kill`` per fiber; each fiber's
    own process and group are still signalled (a fiber may have left its cgroup)."""
    chosen = list(fibers)
    running = [f for f in chosen if f.exit is None]
    frozen = survivors_frozen() if len(running) >= MASS_STOP else contextlib.nullcontext()
    if running:
        with frozen:
            for fiber in running:
                fiber._terminate()
            # Their own end tasks (which never raise, and this wait does not cancel them),
            # not a wait() task per fiber on top.
            ends = [f._finished for f in running if f._finished is not None]
            everyone = asyncio.ensure_future(asyncio.wait(ends))
            if not await first_done(everyone, running[0].clock.sleep(grace)):
                if kill_all is not None:
                    kill_all()
                for fiber in running:
                    fiber._kill_after(grace, cgroup_killed=kill_all is not None)
            await everyone
    return [f.exit for f in chosen if f.exit is not None]


MASS_STOP = 100  # fibers stopped at once from which the collector is kept off the survivors


Deadline = Callable[[], float | None]


@dataclass(eq=False)
class _Bound:
    """One fiber under a DeadlineTimer: its live deadline and its place in the heap."""

    fiber: Fiber
    deadline: Deadline
    at: float | None = None  # the last answer (clock mono); None: none now
    seq: int = -1  # the heap entry that is current (older ones are skipped)


class DeadlineTimer:
    """Every fiber's deadline kept by one timer: a heap on the injected clock and one task
    that sleeps until the earliest deadline, so idle fibers cost no wake-ups.

    ``add(fiber, deadline)`` bounds a running fiber by ``deadline``, a callable
    (the core's decision) asked when the fiber is added, whenever the clock
    reaches its last answer (a deadline moved later, by a renewal or a fence
    extended by a sync, is found then), and for every fiber on ``rearm()``
    (call it when a lease, fence or epoch changes in a way that may move a
    deadline earlier). An answer at or before the clock's ``mono()`` stops the
    fiber (``Fiber.stop(grace)``, on its own task); None means no deadline
    until the next ``rearm()``. An ended fiber is dropped without a wake-up.
    ``close()`` cancels the timer and the stops it started. Runs on the event
    loop that called ``add`` first; never raises into it (a failed stop is
    logged).
    """

    def __init__(self, clock: Clock, grace: float) -> None:
        self.clock = clock
        self.grace = grace
        self._bounds: dict[int, _Bound] = {}  # id(fiber) -> its bound, while it runs
        self._heap: list[tuple[float, int, _Bound]] = []
        self._order = itertools.count()
        self._changed: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._stops: set[asyncio.Task[FiberEnd]] = set()

    def __len__(self) -> int:
        """Fibers bounded now."""
        return len(self._bounds)

    def add(self, fiber: Fiber, deadline: Deadline) -> None:
        """Bound ``fiber`` (running, attached) by ``deadline``; asks it now."""
        if not fiber.running:
            return
        bound = _Bound(fiber, deadline)
        self._bounds[id(fiber)] = bound
        fiber.on_done(self._drop)
        self._ask(bound)
        self._start()

    def rearm(self) -> None:
        """Ask every bounded fiber's deadline again now (a lease, fence or epoch changed)."""
        for bound in list(self._bounds.values()):
            self._ask(bound)
        self._compact()

    def close(self) -> None:
        """Stop keeping deadlines; cancel the timer and the stops it started."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for task in list(self._stops):
            task.cancel()
        self._bounds.clear()
        self._heap.clear()

    async def wait_closed(self) -> None:
        """Return once the stops it started have ended (after ``close()``)."""
        await asyncio.gather(*self._stops, return_exceptions=True)

    # ------------------------------------------------------------ internals

    def _ask(self, bound: _Bound) -> None:
        """Ask ``bound``'s deadline: stop its fiber when due, else (re)place it in the heap."""
        if id(bound.fiber) not in self._bounds:
            return
        at = bound.deadline()
        bound.at = at
        bound.seq = next(self._order)
        if at is not None and at <= self.clock.mono():
            self._due(bound)
            return
        if at is not None:
            earliest = self._heap[0][0] if self._heap else None
            heapq.heappush(self._heap, (at, bound.seq, bound))
            if (earliest is None or at < earliest) and self._changed is not None:
                self._changed.set()

    def _due(self, bound: _Bound) -> None:
        self._bounds.pop(id(bound.fiber), None)
        task = asyncio.ensure_future(bound.fiber.stop(self.grace))
        self._stops.add(task)
        task.add_done_callback(self._stopped)

    def _stopped(self, task: asyncio.Task[FiberEnd]) -> None:
        self._stops.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a deadline stop failed: %s", task.exception())

    def _drop(self, fiber: Fiber) -> None:
        """An ended fiber: forget it (its heap entry is skipped when it comes up)."""
        self._bounds.pop(id(fiber), None)
        self._compact()

    def _compact(self) -> None:
        """Rebuild the heap once most of its entries are stale (fibers that ended long
        before their deadline), so it stays proportional to the running fibers."""
        if len(self._heap) > 64 and len(self._heap) > 2 * len(self._bounds):
            self._heap = [e for e in self._heap if e[2].seq == e[1]
                          and id(e[2].fiber) in self._bounds]
            heapq.heapify(self._heap)

    def _start(self) -> None:
        if self._task is None:
            self._changed = asyncio.Event()
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        """The one timer: sleep until the earliest deadline or a change, ask the due ones."""
        assert self._changed is not None
        changed = self._changed
        while True:
            now = self.clock.mono()
            while self._heap and self._heap[0][0] <= now:
                _, seq, bound = heapq.heappop(self._heap)
                if seq == bound.seq:
                    self._ask(bound)
            changed.clear()
            if not self._heap:
                await changed.wait()
                continue
            waiting = asyncio.ensure_future(changed.wait())
            try:
                await first_done(waiting, self.clock.sleep(self._heap[0][0] - now))
            finally:  # the sleep won: no wait on ``changed`` may outlive this pass
                waiting.cancel()


async def enforce_deadline(fiber: Fiber, deadline: Deadline, clock: Clock, grace: float, *,
                           nudge: asyncio.Event | None = None) -> FiberEnd:
    """Let one fiber run until ``clock.mono() >= deadline()``, then ``stop(grace)``.

    A DeadlineTimer of its own (see there for when ``deadline`` is asked);
    ``nudge``, when set, rearms it. Returns the fiber's exit, whether it
    ended by itself or was stopped.
    """
    timer = DeadlineTimer(clock, grace)
    timer.add(fiber, deadline)
    nudged = asyncio.ensure_future(_rearm_on(nudge, timer)) if nudge is not None else None
    try:
        return await fiber.wait()
    finally:
        if nudged is not None:
            nudged.cancel()
        timer.close()


async def _rearm_on(nudge: asyncio.Event, timer: DeadlineTimer) -> None:
    while True:
        await nudge.wait()
        nudge.clear()
        timer.rearm()


class ResultReader:
    """Collects what a fiber writes to its result socket (call mode's record).

    Reads while the fiber runs (so a large record never blocks the fiber);
    ``finish()`` after the fiber exited takes what is buffered without
    waiting for EOF, since a descendant might still hold the socket open.
    At EOF it closes the socket at once: nothing more can come, and an exec
    fiber's end is closed as soon as it execs, so a running exec fiber costs
    fiberd one fd (its pidfd), not two (10,000 of them fit in 20,000). With a
    ``limit``, a record longer than that many bytes is dropped as it passes it (the
    socket closed, the record a ``ResultTooLarge`` error): what fiberd holds of it
    is bounded. Also used by a task window's call fibers (core/runtime/task_window.py).
    """

    def __init__(self, sock: socket.socket, limit: int | None = None) -> None:
        self.sock = sock
        self.chunks: list[bytes] = []
        self.limit = limit  # bytes a record may have (None: no bound); past it, dropped
        self.size = 0
        self.too_large = False
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(sock.fileno(), self._take)
        self.reading = True
        self.complete: asyncio.Future[None] = self.loop.create_future()  # EOF, or finish()

    def _take(self) -> None:
        """Move what is buffered into ``chunks``; stop watching and close at EOF.

        A reset (the fiber closed its end with an order datagram unread) is
        reported once, by the kernel, before what is still queued: read on.
        """
        if self.sock.fileno() < 0:
            return  # closed at EOF
        resets = 0
        while True:
            try:
                chunk = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionError:
                resets += 1
                if resets > 1:
                    break
                continue
            if not chunk:
                break
            self.chunks.append(chunk)
            self.size += len(chunk)
            if self.limit is not None and self.size > self.limit:
                self.too_large, self.chunks = True, []  # the writer gets a broken pipe
                break
        self._stop_reading()
        self.sock.close()
        set_done(self.complete)

    def _stop_reading(self) -> None:
        if self.reading:
            self.loop.remove_reader(self.sock.fileno())
            self.reading = False

    def finish(self) -> dict[str, object] | None:
        """The record, once the writer has exited. Closes the socket."""
        self._take()
        self._stop_reading()
        self.sock.close()
        set_done(self.complete)
        return self.record()

    def record(self) -> dict[str, object] | None:
        """The record read so far (whole once ``complete``); None when there is none; a
        ``ResultTooLarge`` error once it passed ``limit``."""
        if self.too_large:
            return {"ok": False, "error": {"type": "ResultTooLarge", "message":
                                           f"the fiber's result passed {self.limit} bytes, "
                                           "more than a reply carries: pass bigger data "
                                           "by file name"}}
        if not self.chunks:
            return None
        try:
            record = json.loads(b"".join(self.chunks))
        except ValueError:
            return {"ok": False, "error": {"type": "BadResult",
                                           "message": "the fiber wrote an unreadable result"}}
        return record if isinstance(record, dict) else None
