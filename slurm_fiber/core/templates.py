"""Warm templates, parent side: start, watch, re-warm with backoff, fork fibers, stop.

Usage (on fiberd's event loop; nothing here blocks it)::

    mgr = CgroupManager(root)                      # core/cgroups.py
    cg = mgr.carve_grant(uid, spec.limits)         # None when uncarved
    env = template_env(os.environ, spec.template, channel.narrowed(spec.devices))
    t = await Template.start(uid, spec.template, env, cg, state_dir=d, clock=clock)
    await t.wait_warm()                            # READY or WARM_FAILED
    fiber = await t.fork(FiberRequest(id="f1", mode="call", target="m:f", args=[1]))
    exit = await fiber.wait()                      # or: await fiber.stop(grace)
    await t.stop(grace)                            # fibers, then the template

A ready template keeps ``spares`` *spare* fiber processes forked ahead of
need: each already sits in its own cgroup leaf (``slot-<n>`` under the
grant's cgroup), tied to the template by its death signal, waiting on an
order channel whose other end fiberd holds. A fiber's leaf, once empty, is
kept for a later spare (unless it has a memory controller, whose
``memory.peak`` would carry over, or sub-cgroups), so a Clone creates and
removes no cgroup: both wait on the kernel's cgroup lock, which a
concurrent migration holds for an RCU grace period. ``fork`` hands a spare its
order directly (one message, no round trip through the template) and
forks a replacement in the background, so a Clone pays neither the fork
nor the cgroup move. With no spare at hand (a burst, ``spares=0``, a spare
that died) ``fork`` makes one on the spot and uses it. Spares are not
fibers: they run no user code and do not count toward ``fibers`` (a grant's
``pids`` limit, where enforced, does count them), and are killed (cgroup and
all) when the template stops or dies.

A template is one child process (``template_main``) started with exactly
the ``env`` given (build it with ``template_env``: the grant's env, then the
device channel's variables, which always win), in the grant's cgroup leaf
when carved, tied to fiberd by PR_SET_PDEATHSIG: a fiberd killed with
SIGKILL takes its templates, and through their death signal their fibers,
with it. Start templates from the event-loop thread: the death signal
follows the thread that forked.

States: ``warming`` → ``ready`` | ``warm_failed``; a ready template that
dies is ``rewarming`` (after a backoff on the injected Clock, doubling from
0.5 s to 30 s, reset on ready) and its running fibers are accounted as
``lost``; a template that dies while warming is ``warm_failed`` (a warm
that crashes the interpreter would crash again). ``stop()`` → ``stopped``.

Bounded waits: every wait on the template or a spare ends within
``timeout`` seconds on the injected Clock (``template_timeout``, default
10 s). A template that leaves a spare request unanswered that long, stays
stopped that long (SIGSTOP, a tracer; its state is looked at about once a
second; only time fiberd itself runs counts, see ``core/stall.py``), cannot
be written to, or takes no message that long, has stopped answering: it
is ``rewarming`` at once (not ready; ``last_fault`` says why), its fibers
and then it are killed (process group, and its cgroup leaf when carved),
and once it is gone it is re-warmed after the backoff, like a template that
died. A Clone waiting on it, or arriving meanwhile, gets TemplateNotReady
(the runtime answers the retryable ``cold``, with ``retry_after()``), never
a hang or ``internal``. Fiber exits are still seen while the template
stalls: each fiber's pidfd is watched (``core/fibers.py``). Warming itself
is not bounded (a grant's warm code may take minutes); a warming template
that stays stopped is re-warmed like a ready one.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from slurm_fiber.core import cgroups, stall, template_main
from slurm_fiber.core import template_wire as wire
from slurm_fiber.core.cgroups import GrantCgroup, safe_name
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.devices import ALL_VISIBILITY_VARS, DeviceChannel
from slurm_fiber.core.fibers import Fiber, FiberExit, stop_all
from slurm_fiber.core.grant import TemplateSpec
from slurm_fiber.core.waiting import first_done, pidfd_wait, set_done, stopped

_FIBER_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
DEFAULT_TIMEOUT = 10.0  # seconds a template or a spare may take to answer (template_timeout)
_WARM_GUESS = 1.0  # seconds a warm is expected to take before one has been measured
log = logging.getLogger(__name__)


class TemplateState(enum.StrEnum):
    WARMING = "warming"
    READY = "ready"
    WARM_FAILED = "warm_failed"
    REWARMING = "rewarming"
    STOPPED = "stopped"


@dataclass(frozen=True)
class WarmError:
    """Why a template failed to warm: the exception class and one line."""

    error: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"error": self.error, "message": self.message}


class TemplateNotReady(Exception):
    """``fork`` on a template that is not ready; ``state`` (and ``warm_error``) say why."""

    def __init__(self, state: TemplateState, warm_error: WarmError | None) -> None:
        self.state = state
        self.warm_error = warm_error
        detail = f": {warm_error.error}: {warm_error.message}" if warm_error else ""
        super().__init__(f"template is {state.value}{detail}")


class ForkFailed(Exception):
    """The template could not start the fiber (one-line reason)."""


@dataclass(frozen=True)
class FiberRequest:
    """One fiber to fork. ``mode`` "call" runs ``target`` ("module:function") with
    ``args``/``kwargs`` (JSON values) in the warm interpreter; "exec" execs ``argv``.

    ``stdio`` holds fds (in fiberd) for the fiber's stdin, stdout, stderr, or
    None for each: stdin then reads /dev/null and output goes to
    ``<state_dir>/fibers/fiber-<id>.out|.err``. fiberd keeps ownership of the
    fds (they are duplicated into the fiber). ``env`` is added to the
    template's env; device visibility variables in it are ignored.
    """

    id: str
    mode: Literal["call", "exec"] = "call"
    target: str | None = None
    args: tuple[object, ...] = ()
    kwargs: Mapping[str, object] = field(default_factory=dict)
    pickled: str | None = None  # a pickled call (CallTarget.pickled), passed on unread
    argv: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    stdio: tuple[int | None, int | None, int | None] = (None, None, None)
    jti: str = ""
    epoch: int = 0
    deadline: float | None = None

    def check(self) -> None:
        """Raise ValueError (one line) unless the request is well-formed."""
        if not _FIBER_ID.fullmatch(self.id):
            raise ValueError(f"fiber id {self.id!r} is not [A-Za-z0-9_-]{{1,64}}")
        if self.mode == "call":
            if self.pickled is None and (not self.target or ":" not in self.target):
                raise ValueError("call mode needs a target 'module:function'")
        elif self.mode == "exec":
            if not self.argv or not all(isinstance(a, str) and a for a in self.argv):
                raise ValueError("exec mode needs a non-empty argv of non-empty strings")
        else:
            raise ValueError(f"mode {self.mode!r} is not 'call' or 'exec'")


class Backoff:
    """Delays between re-warms: ``initial`` doubling up to ``cap``; ``reset()`` on success."""

    def __init__(self, initial: float = 0.5, factor: float = 2.0, cap: float = 30.0) -> None:
        self.initial, self.factor, self.cap = initial, factor, cap
        self._next = initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self.cap, self._next * self.factor)
        return delay

    def reset(self) -> None:
        self._next = self.initial

    def peek(self) -> float:
        """The delay ``next()`` would give, without taking it."""
        return self._next


def template_env(base: Mapping[str, str], spec: TemplateSpec,
                 channel: DeviceChannel) -> dict[str, str]:
    """The environment a template starts with: ``base``, the grant's env, then the
    channel's visibility variables, which always win (a grant cannot widen its devices)."""
    return {**base, **spec.env, **channel.env()}


@dataclass
class _Spare:
    """A spare fiber process: asked of the template, then (``spared``) waiting for its order."""

    id: str
    cgroup: Path | None
    orders: socket.socket  # fiberd's end of the spare's order channel
    spared: asyncio.Future[int]  # its pid, once the template has forked it
    asked: float = 0.0  # when it was asked of the template (clock mono)
    pidfd: int | None = None


class Template:
    """One grant's warm template process, its spares, and the fibers forked from it.

    Build with ``await Template.start(...)``. Read ``state``, ``warm_error``,
    ``pid``, ``fibers`` (id → running Fiber), ``restarts``, ``last_fault``
    (why the last process was given up on, one line; None if none was).
    Not thread-safe.
    """

    def __init__(self, uid: str, spec: TemplateSpec, env: Mapping[str, str],
                 cgroup: GrantCgroup | None, *, state_dir: Path, clock: Clock,
                 python: str = sys.executable, backoff: Backoff | None = None,
                 spares: int = 1, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.uid = uid
        self.spec = spec
        self.env = dict(env)
        self.cgroup = cgroup
        self.state_dir = state_dir
        self.clock = clock
        self.python = python
        self.backoff = backoff or Backoff()
        self.spares = spares
        self.timeout = timeout
        self.state = TemplateState.WARMING
        self.warm_error: WarmError | None = None
        self.pid: int | None = None
        self.restarts = 0
        self.last_fault: str | None = None
        self.fibers: dict[str, Fiber] = {}
        self._changed = asyncio.Event()
        self._sock: socket.socket | None = None
        self._pidfd: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._spare_ids = itertools.count(1)  # never reset: a leaf may outlive its process
        self._forking: dict[str, _Spare] = {}  # asked of the template, not yet spared
        self._idle: deque[_Spare] = deque()  # spared, waiting for an order
        self._in_use: dict[str, Fiber] = {}  # spare id -> the fiber it became
        self._filling: asyncio.Task[None] | None = None
        self._free_leaves: list[Path] = []  # empty slot leaves, for the next spares
        self._burying: set[asyncio.Future[None]] = set()  # leaves being removed
        self._lost = False  # the current process was given up on (it is being killed)
        self._spawned_at = 0.0  # clock mono of the current process's start
        self._warm_took: float | None = None  # seconds the last warm took
        self._respawn_at: float | None = None  # clock mono the next re-warm starts at

    @classmethod
    async def start(cls, uid: str, spec: TemplateSpec, env: Mapping[str, str],
                    cgroup: GrantCgroup | None = None, *, state_dir: Path, clock: Clock,
                    python: str = sys.executable, backoff: Backoff | None = None,
                    spares: int = 1, timeout: float = DEFAULT_TIMEOUT) -> Template:
        """Spawn the template and return at once, ``warming``; once ready it keeps
        ``spares`` spare processes. ``timeout``: seconds it and its spares may take to
        answer (module doc). Raises OSError if the process cannot be started
        (e.g. ``state_dir`` not writable)."""
        template = cls(uid, spec, env, cgroup, state_dir=state_dir, clock=clock,
                       python=python, backoff=backoff, spares=spares, timeout=timeout)
        (state_dir / "fibers").mkdir(mode=0o700, parents=True, exist_ok=True)
        template._spawn()
        return template

    # ------------------------------------------------------------ public

    async def wait_warm(self) -> TemplateState:
        """Block until the template is ready, failed to warm, or stopped; that state."""
        settled = {TemplateState.READY, TemplateState.WARM_FAILED, TemplateState.STOPPED}
        while self.state not in settled:
            await self._changed.wait()
        return self.state

    async def wait_change(self, seen: TemplateState) -> TemplateState:
        """Block until the state is no longer ``seen``; the new state (at once if it differs)."""
        while self.state is seen:
            await self._changed.wait()
        return self.state

    async def fork(self, request: FiberRequest) -> Fiber:
        """Start one fiber and return it running (its pid known, its pidfd open).

        Uses an idle spare, else makes one (waiting at most ``timeout`` for
        it). Raises TemplateNotReady unless ``ready``, also when the template
        dies, stops answering or is stopped meanwhile; ValueError for a
        malformed request; ForkFailed when the template cannot fork or the
        fiber's cgroup cannot be made.
        """
        request.check()
        gone = ""
        for _ in range(2):  # an idle spare may have died unseen: then one made now
            if self.state is not TemplateState.READY or self._sock is None or self._lost:
                raise self._not_ready()
            if request.id in self.fibers:
                raise ForkFailed(f"fiber id {request.id} is in use")
            try:
                spare = await self._take_spare()
            except _NoAnswer:
                raise self._not_ready() from None
            self._refill()
            try:
                return await self._hand_over(spare, request)
            except _SpareGone as err:
                gone = str(err)
        if self.state is not TemplateState.READY or self._lost:
            raise self._not_ready()
        raise ForkFailed(gone)

    def retry_after(self) -> float:
        """Seconds until this template is expected ready again: the rest of its backoff and
        the last warm's duration (a guess of 1 s before any was measured)."""
        now = self.clock.mono()
        warm = self._warm_took if self._warm_took is not None else _WARM_GUESS
        if self.state is TemplateState.WARMING:
            return max(0.1, self._spawned_at + warm - now)
        if self._respawn_at is not None:
            return max(0.1, self._respawn_at - now + warm)
        return self.backoff.peek() + warm  # the process is still going: no backoff yet

    async def stop_fibers(self, grace: float, *,
                          before_epoch: int | None = None) -> list[FiberExit]:
        """Stop running fibers (all, or those of an epoch older than ``before_epoch``);
        returns once they are gone."""
        chosen = [f for f in self.fibers.values()
                  if before_epoch is None or f.epoch < before_epoch]
        return await stop_all(chosen, grace)

    async def stop(self, grace: float) -> None:
        """Stop every fiber (SIGTERM, grace, SIGKILL), the spares, then the template;
        returns once all are gone. The template is ``stopped`` for good (no re-warm)."""
        self._stopping = True
        await self.stop_fibers(grace)
        self._dismiss_spares()
        if self._sock is not None:
            with contextlib.suppress(OSError, wire.WireError):
                self._sock.send(wire.encode({"t": "stop"}))
        task = self._task
        if task is not None:
            if self._pidfd is None:
                task.cancel()  # asleep in its backoff: no process to stop
            elif not await first_done(task, self.clock.sleep(grace)):
                self._kill_process()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        while self._burying:
            await asyncio.gather(*list(self._burying))
        self._set_state(TemplateState.STOPPED)

    @property
    def idle_spares(self) -> list[int]:
        """Pids of the spares waiting for an order now."""
        return [s.spared.result() for s in self._idle]

    def to_json(self) -> dict[str, object]:
        return {"uid": self.uid, "state": self.state.value, "pid": self.pid,
                "warm_error": self.warm_error.to_json() if self.warm_error else None,
                "restarts": self.restarts, "last_fault": self.last_fault,
                "fibers": len(self.fibers), "spares": len(self._idle),
                "cgroup": str(self.cgroup.path) if self.cgroup else None}

    # ------------------------------------------------------------ spares

    async def _take_spare(self) -> _Spare:
        """An idle spare, else a new one once the template has forked it."""
        if self._idle:
            return self._idle.popleft()
        spare = await self._ask_spare()
        try:
            await asyncio.shield(spare.spared)
        except asyncio.CancelledError:
            # The Clone was cancelled: the spare, when it comes, waits for the next one.
            spare.spared.add_done_callback(lambda _: self._keep_idle(spare))
            raise
        return spare

    async def _ask_spare(self) -> _Spare:
        """Ask the template for one more spare (its ``spared`` future tells when it is
        forked; the template has ``timeout`` to answer, see ``_guard``). Raises
        ForkFailed when its cgroup leaf fails, _NoAnswer when the template cannot take
        the request (it is then given up on)."""
        spare_id = str(next(self._spare_ids))
        leaf = await self._leaf(spare_id)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        spare = _Spare(spare_id, leaf, ours, asyncio.get_running_loop().create_future(),
                       asked=self.clock.mono())
        self._forking[spare_id] = spare
        try:
            await _send(self._sock, {"t": "spare", "id": spare_id,
                                     "cgroup": str(leaf) if leaf else None,
                                     "also": [str(m) for m in cgroups.mirrors(leaf)]
                                     if leaf else []},
                        [theirs.fileno()], "the template", self.clock, self.timeout)
        except BaseException as err:
            self._forking.pop(spare_id, None)
            self._bury(spare)
            if isinstance(err, ForkFailed):
                self._lose(str(err))
                raise _NoAnswer(str(err)) from None
            raise
        finally:
            theirs.close()
        return spare

    async def _leaf(self, spare_id: str) -> Path | None:
        """A free slot leaf, else a new one (None when uncarved). Raises ForkFailed."""
        if self.cgroup is None:
            return None
        if self._free_leaves:
            return self._free_leaves.pop()
        leaf = self.cgroup.slot(spare_id)
        try:  # off the loop: it waits while a migration holds the kernel's cgroup lock
            await asyncio.to_thread(cgroups.mkdir, leaf)  # and its v1 mirrors
        except OSError as e:
            raise ForkFailed(f"cannot create cgroup {leaf}: {e.strerror}") from None
        return leaf

    def _give_back(self, leaf: Path, peak: int | None) -> None:
        """An ended fiber's empty leaf: keep it for a later spare, or remove it."""
        keep = (peak is None and not self._stopping and self.state is TemplateState.READY
                and len(self._free_leaves) < max(self.spares, 1) and _bare(leaf))
        if keep:
            self._free_leaves.append(leaf)
        else:
            self._track(asyncio.ensure_future(_remove_leaf(leaf)))

    def _refill(self) -> None:
        """Make spares in the background until ``spares`` are idle or being made."""
        if (self._filling is None or self._filling.done()) and self._short():
            self._filling = asyncio.ensure_future(self._fill())

    def _short(self) -> bool:
        return (self.state is TemplateState.READY and not self._stopping
                and len(self._idle) + len(self._forking) < self.spares)

    async def _fill(self) -> None:
        while self._short():
            try:
                spare = await self._ask_spare()
                await asyncio.shield(spare.spared)
            except _NoAnswer:
                return  # the template is gone or given up on: no spares until re-warmed
            except ForkFailed as err:
                log.warning("template %s: no spare made: %s", self.uid, err)
                return
            self._keep_idle(spare)

    def _keep_idle(self, spare: _Spare) -> None:
        """A spared spare nobody took: keep it for the next Clone (or bury it)."""
        if spare.spared.cancelled() or spare.spared.exception() is not None:
            return
        if self.state is TemplateState.READY and not self._stopping:
            self._idle.append(spare)
        else:
            self._bury(spare)

    async def _hand_over(self, spare: _Spare, request: FiberRequest) -> Fiber:
        """Send ``spare`` its order; the fiber it becomes (its result comes back on the
        same channel). Raises _SpareGone if it died."""
        try:
            await _send(spare.orders, self._order(request),
                        [fd for fd in request.stdio if fd is not None],
                        "the spare fiber process", self.clock, self.timeout)
        except BaseException as err:
            self._bury(spare)
            if isinstance(err, ForkFailed):
                raise _SpareGone(str(err)) from None
            raise
        out = self._out_path(request)
        fiber = Fiber(
            id=request.id, pid=spare.spared.result(), uid=self.uid, jti=request.jti,
            epoch=request.epoch, deadline=request.deadline, started=self.clock.mono(),
            mode=request.mode, cgroup=spare.cgroup, clock=self.clock,
            stdout_path=out.with_suffix(".out") if request.stdio[1] is None else None,
            stderr_path=out.with_suffix(".err") if request.stdio[2] is None else None,
            report_timeout=self.timeout, parent=self.pid)
        fiber.attach(spare.orders, spare.pidfd)
        self.fibers[request.id] = fiber
        self._in_use[spare.id] = fiber

        def gone(f: Fiber) -> None:
            self.fibers.pop(f.id, None)
            self._in_use.pop(spare.id, None)
            if f.cgroup is not None:
                self._give_back(f.cgroup, f.exit.memory_peak if f.exit else None)

        fiber.on_done(gone)
        return fiber

    def _dismiss_spares(self) -> None:
        """Bury every spare not yet handed an order (idle or being made); remove the free
        leaves."""
        if self._filling is not None:
            self._filling.cancel()
        for spare in [*self._idle, *self._forking.values()]:
            self._bury(spare)
        self._idle.clear()
        self._forking.clear()
        for leaf in self._free_leaves:
            self._track(asyncio.ensure_future(_remove_leaf(leaf)))
        self._free_leaves.clear()

    def _bury(self, spare: _Spare) -> None:
        """Kill an unused spare and remove its leaf, in the background (``stop`` waits)."""
        with contextlib.suppress(ValueError):
            self._idle.remove(spare)
        spare.orders.close()
        if not spare.spared.done():
            spare.spared.set_exception(_NoAnswer("the template is gone"))
        if not spare.spared.cancelled():
            spare.spared.exception()  # retrieved: nobody may be waiting for it
        self._track(asyncio.ensure_future(_kill_spare(spare)))

    def _track(self, task: asyncio.Future[None]) -> None:
        """Keep a leaf's removal in view: ``stop`` returns only once it is done."""
        self._burying.add(task)
        task.add_done_callback(self._burying.discard)

    # ------------------------------------------------------------ process

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log_path = self.state_dir / f"template-{safe_name(self.uid)}.log"
        argv, env, dropped = template_main.command(self.python, self.env, theirs.fileno(),
                                                   os.getpid())
        for line in dropped:
            log.warning("template of %s: %s", self.uid, line)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        with theirs, open(os.open(log_path, flags, 0o600), "ab") as log_file:
            proc = subprocess.Popen(
                argv, env=env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                stdout=log_file, stderr=log_file, cwd=self.state_dir)
        ours.setblocking(False)
        self._sock = ours
        self._pidfd = os.pidfd_open(proc.pid)
        self.pid = proc.pid
        self._lost = False
        self._spawned_at = self.clock.mono()
        self._respawn_at = None
        order = {"t": "warm", "preload": list(self.spec.preload), "warm": self.spec.warm,
                 "cgroup": str(self.cgroup.template) if self.cgroup else None,
                 "also": [str(m) for m in cgroups.mirrors(self.cgroup.template)]
                 if self.cgroup else []}
        ours.send(wire.encode(order))
        self._set_state(TemplateState.WARMING)
        self._task = asyncio.ensure_future(self._watch(ours, proc, self._pidfd))

    async def _watch(self, sock: socket.socket, proc: subprocess.Popen[bytes],
                     pidfd: int) -> None:
        """Serve one template process's messages until it dies, then account and re-warm.

        Guarded meanwhile (``_guard``). Its death is its pidfd's: a descendant that
        inherited the socket cannot keep fiberd waiting for end of file.
        """
        loop = asyncio.get_running_loop()
        closed: asyncio.Future[None] = loop.create_future()

        def readable() -> None:  # every message waiting, in order, then back to the loop
            try:
                while data := sock.recv(wire.MAX_MESSAGE + 1):
                    with contextlib.suppress(wire.WireError):
                        self._dispatch(wire.decode(data))
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionError:
                pass
            if not closed.done():
                closed.set_result(None)

        loop.add_reader(sock.fileno(), readable)
        guard = asyncio.ensure_future(self._guard(proc.pid))
        try:
            if not await first_done(closed, pidfd_wait(pidfd)):
                readable()  # it died: take what it sent before
            else:  # it closed its end: it is exiting, or must be made to
                dying = asyncio.ensure_future(pidfd_wait(pidfd))
                if not await first_done(dying, self.clock.sleep(self.timeout)):
                    self._lose(f"still running {self.timeout:g} s after closing its socket")
                    self._kill_process()  # also when it was not ready (a failed warm)
                await dying
        finally:
            loop.remove_reader(sock.fileno())
            guard.cancel()
        await pidfd_wait(pidfd)
        self._kill_process()  # what it left in its process group or cgroup leaf
        status = proc.wait()
        os.close(pidfd)
        sock.close()
        self._sock = self._pidfd = None
        self._template_gone(status)
        while self.state is TemplateState.REWARMING and not self._stopping:
            delay = self.backoff.next()
            self._respawn_at = self.clock.mono() + delay
            await self.clock.sleep(delay)
            if self._stopping:
                return
            self.restarts += 1
            try:
                self._spawn()
                return
            except OSError as err:
                self.last_fault = f"cannot start the template: {err}"
                log.error("template %s: %s", self.uid, self.last_fault)

    async def _guard(self, pid: int) -> None:
        """Give the template process up (``_lose``) once ``stall.judge`` says it stalled:
        a spare request unanswered, or the process stopped, for ``timeout`` seconds on
        the clock while fiberd was watching. Runs until cancelled (by ``_watch``) or it
        gives up on it."""
        every = stall.look_every(self.timeout)
        stopped_since: float | None = None
        watching = last_look = self.clock.mono()
        while True:
            now = self.clock.mono()
            if stall.gap(last_look, now, every):
                watching = now
            last_look = now
            if not stopped(pid):
                stopped_since = None
            elif stopped_since is None:
                stopped_since = now
            asked = min((s.asked for s in self._forking.values()), default=None)
            seen = stall.Seen(asked, stopped_since, watching)
            verdict = stall.judge(seen, now, self.timeout, every)
            if verdict.reason is not None:
                self._lose(verdict.reason)
                return
            await self.clock.sleep(verdict.recheck)

    def _lose(self, reason: str) -> None:
        """Give up on the current process, which stopped answering (``reason``, one line):
        it is not ready from now (``rewarming``), Clones waiting on it get TemplateNotReady,
        its fibers and then it are killed; ``_watch`` re-warms once it is gone."""
        live = (TemplateState.WARMING, TemplateState.READY)
        if self._lost or self._stopping or self._pidfd is None or self.state not in live:
            return
        self._lost = True
        self.last_fault = reason
        log.warning("template %s (pid %s) stopped answering: %s; killing it and re-warming",
                    self.uid, self.pid, reason)
        self._set_state(TemplateState.REWARMING)
        self._dismiss_spares()
        for fiber in list(self.fibers.values()):
            fiber.note_reason("template_lost", f"its template stopped answering ({reason}) "
                              "and was killed, and the fiber with it")
            fiber.kill()  # they would die by their death signal; this takes their groups too
        self._kill_process()

    def _kill_process(self) -> None:
        """SIGKILL the template process, its process group (it leads one) and, carved, all
        in its cgroup leaf. Its spares and fibers die by their death signal. Never raises."""
        if self._pidfd is None or self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # unreaped, its pid cannot be reused
        if self.cgroup is not None and cgroups.populated(self.cgroup.template):
            with contextlib.suppress(OSError):
                cgroups.kill(self.cgroup.template)

    def _not_ready(self) -> TemplateNotReady:
        state = TemplateState.STOPPED if self._stopping else self.state
        return TemplateNotReady(state, self.warm_error)

    def _template_gone(self, status: int) -> None:
        if self._stopping:
            self._set_state(TemplateState.STOPPED)
        elif self._lost:
            pass  # rewarming since it was given up on
        elif self.state is TemplateState.WARMING:
            self.warm_error = WarmError("TemplateDied",
                                        f"the template exited ({status}) before it was warm")
            self._set_state(TemplateState.WARM_FAILED)
        elif self.state is TemplateState.READY:
            self.last_fault = f"the template exited ({_how(status)})"
            self._set_state(TemplateState.REWARMING)
        self._dismiss_spares()  # they die with it (their death signal); reap their leaves
        for fiber in list(self.fibers.values()):
            fiber.template_lost(None if self._stopping else self.last_fault)

    def _dispatch(self, msg: dict[str, object]) -> None:
        kind = msg["t"]
        if self._lost and kind != "exit":
            return  # given up on: only its fibers' exits still count
        if kind == "ready":
            self.backoff.reset()
            self._warm_took = self.clock.mono() - self._spawned_at
            self._set_state(TemplateState.READY)
            self._refill()
        elif kind == "warm_failed":
            self.warm_error = WarmError(str(msg.get("error")), str(msg.get("message")))
            self._set_state(TemplateState.WARM_FAILED)
        elif kind in ("spared", "fork_failed"):
            spare = self._forking.pop(str(msg.get("id")), None)
            if spare is not None:
                self._spared(spare, msg)
        elif kind == "exit":
            spare_id = str(msg.get("id"))
            fiber = self._in_use.get(spare_id)
            if fiber is not None:
                fiber.reported_exit(msg)
            else:  # an idle spare died (killed by someone, or its set-up failed)
                idle = next((s for s in self._idle if s.id == spare_id), None)
                if idle is not None:
                    self._bury(idle)

    def _spared(self, spare: _Spare, msg: dict[str, object]) -> None:
        if msg["t"] == "fork_failed":
            spare.spared.set_exception(ForkFailed(f"fork failed: {msg.get('message')}"))
            self._bury(spare)
            return
        pid = int(str(msg.get("pid")))
        try:
            spare.pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._bury(spare)
            return
        spare.spared.set_result(pid)

    def _out_path(self, request: FiberRequest) -> Path:
        return self.state_dir / "fibers" / f"fiber-{request.id}"

    def _order(self, request: FiberRequest) -> dict[str, object]:
        env = {k: v for k, v in request.env.items() if k not in ALL_VISIBILITY_VARS}
        return {"t": "run", "id": request.id, "mode": request.mode, "target": request.target,
                "args": list(request.args), "kwargs": dict(request.kwargs),
                "pickled": request.pickled,
                "argv": list(request.argv), "env": env, "cwd": request.cwd,
                "stdio": [fd is not None for fd in request.stdio],
                "out_dir": str(self.state_dir / "fibers")}

    def _set_state(self, state: TemplateState) -> None:
        self.state = state
        self._changed.set()
        self._changed = asyncio.Event()


async def _send(sock: socket.socket | None, msg: dict[str, object], fds: list[int],
                peer: str, clock: Clock, timeout: float) -> None:
    """Send one message with fds on a non-blocking SEQPACKET socket, waiting for buffer
    room without blocking the loop, at most ``timeout`` seconds on ``clock``. Raises
    ForkFailed (naming ``peer``) when it is gone or took nothing in that time."""
    data = wire.encode(msg)
    loop = asyncio.get_running_loop()
    while True:
        if sock is None or sock.fileno() < 0:
            raise ForkFailed(f"{peer} is gone")
        try:
            socket.send_fds(sock, [data], fds)
            return
        except BlockingIOError:
            room: asyncio.Future[None] = loop.create_future()
            loop.add_writer(sock.fileno(), set_done, room)
            try:
                if not await first_done(room, clock.sleep(timeout)):
                    raise ForkFailed(f"{peer} took no message for {timeout:g} s") from None
            finally:
                loop.remove_writer(sock.fileno())
        except OSError as e:
            raise ForkFailed(f"cannot reach {peer}: {e.strerror}") from None


class _SpareGone(Exception):
    """The spare died before it took its order (one line)."""


class _NoAnswer(ForkFailed):
    """The template cannot serve a spare request: it is gone, stopped answering or is
    stopping (it is no longer ready; ``fork`` turns this into TemplateNotReady)."""


def _how(returncode: int) -> str:
    """A Popen return code in words: "exit code 1", "signal 9 (SIGKILL)"."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"
    return f"signal {-returncode} ({name})"


def _bare(leaf: Path) -> bool:
    """Whether ``leaf`` exists and holds no sub-cgroup (a fiber may have made some)."""
    try:
        with os.scandir(leaf) as entries:
            return not any(e.is_dir(follow_symlinks=False) for e in entries)
    except OSError:
        return False


async def _remove_leaf(leaf: Path) -> None:
    try:
        await asyncio.to_thread(cgroups.remove_tree, leaf)
    except OSError as e:
        log.warning("cannot remove the fiber cgroup %s: %s", leaf, e.strerror)


async def _kill_spare(spare: _Spare) -> None:
    """SIGKILL a spare that never ran user code and wait until it and its leaf are gone."""
    if spare.cgroup is not None:
        await cgroups.kill_and_remove(spare.cgroup)
    elif spare.pidfd is not None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(spare.pidfd, signal.SIGKILL)
        await pidfd_wait(spare.pidfd)
    if spare.pidfd is not None:
        os.close(spare.pidfd)
        spare.pidfd = None
