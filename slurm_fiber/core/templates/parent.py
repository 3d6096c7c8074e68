"""Warm templates, parent side: start, watch, re-warm with backoff, fork fibers, stop.

Usage (on fiberd's event loop; nothing here blocks it)::

    mgr = CgroupManager(root)                      # core/cgroups/manager.py
    cg = mgr.carve_grant(uid, spec.limits)         # None when uncarved
    env = template_env(os.environ, spec.template, channel.narrowed(spec.devices))
    t = await Template.start(uid, spec.template, env, cg, state_dir=d, clock=clock)
    await t.wait_warm()                            # READY or WARM_FAILED
    fiber = await t.fork(FiberRequest(id="f1", mode="call", target="m:f", args=[1]))
    exit = await fiber.wait()                      # or: await fiber.stop(grace)
    await t.stop(grace)                            # fibers, then the template

- A template is one child process (``child/main.py``) started with exactly the
  ``env`` given (``template_env``: the grant's env, then the device channel's
  variables, which win), in the grant's cgroup leaf when carved, tied to fiberd by
  PR_SET_PDEATHSIG, so a fiberd killed takes its templates and their fibers with
  it. Start templates from the event-loop thread (the death signal follows the
  thread that forked).
- A ready template keeps ``spares`` spare processes forked ahead of need, each in
  its own cgroup leaf and waiting on an order channel; ``fork`` hands a spare its
  order and replaces it in the background; with no spare at hand it makes one on
  the spot. An exec fiber may be spawned straight into a leaf instead
  (``exec_spawn``: with ``"hot"``, when this template moved a process within
  ``SPAWN_HOT`` seconds or has no idle spare). Spares run no user code, do not
  count toward ``fibers`` and are killed with the template.
- States: ``warming`` → ``ready`` | ``warm_failed``; a ready template that dies is
  ``rewarming`` (after a backoff on the injected Clock, doubling from 0.5 s to
  30 s, reset on ready) and its running fibers are ``lost``; one that dies while
  warming is ``warm_failed``. ``stop()`` → ``stopped``.
- Every wait on the template or a spare ends within ``timeout`` seconds on the
  injected Clock. A template that stops answering (a request unanswered, stopped
  by a signal or tracer: core/templates/stall.py) is ``rewarming`` at once, its
  fibers and then it are killed, and it is re-warmed after the backoff; a Clone
  meanwhile gets TemplateNotReady (the retryable ``cold``), never a hang. Fiber
  exits are still seen through each fiber's pidfd. Warming itself is not bounded.

The parts: this module does the process I/O; ``lifecycle.py`` decides, as a pure
transition table, what each event does; ``spares.py`` keeps the spares'
bookkeeping and ``core/cgroups/leaves.py`` the slot leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from slurm_fiber.core.cgroups.common import GrantCgroup, populated, safe_name
from slurm_fiber.core.cgroups.common import join as cgroup_join
from slurm_fiber.core.cgroups.groups import empty as cgroup_empty
from slurm_fiber.core.cgroups.groups import kill as cgroup_kill
from slurm_fiber.core.cgroups.leaves import LeafCreateFailed, LeafPool
from slurm_fiber.core.cgroups.v1 import mirrors as cgroup_mirrors
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.devices import ALL_VISIBILITY_VARS, DeviceChannel
from slurm_fiber.core.fibers.ends import LateReports
from slurm_fiber.core.fibers.fiber import Fiber, FiberEnd, stop_all
from slurm_fiber.core.runtime.identity import FiberIdentity
from slurm_fiber.core.templates import stall, wire
from slurm_fiber.core.templates.dirtrust import safe_path_entry
from slurm_fiber.core.templates.lifecycle import (
    Action,
    Backoff,
    Event,
    Lifecycle,
    Phase,
    TemplateState,
    WarmError,
)
from slurm_fiber.core.templates.spares import Kind, Spare, SparePool
from slurm_fiber.core.templates.window_parent import WindowLink
from slurm_fiber.core.trust.grant import TemplateSpec
from slurm_fiber.core.waiting import first_done, pidfd_exited, pidfd_wait, set_done, stopped

__all__ = ["DEFAULT_TIMEOUT", "Backoff", "FiberRequest", "ForkFailed", "Template",
           "TemplateNotReady", "TemplateState", "WarmError", "template_env"]

_FIBER_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
DEFAULT_TIMEOUT = 10.0  # seconds a template or a spare may take to answer (template_timeout)
SPAWN_HOT = 0.02  # seconds after a cgroup move of ours in which another is cheap (docs/benchmarks)
ExecSpawn = Literal["never", "hot", "always"]  # when an exec fiber is spawned (module doc)
log = logging.getLogger(__name__)


class TemplateNotReady(Exception):
    """``fork`` on a template that is not ready; ``state`` (and ``warm_error``) say why."""

    def __init__(self, state: TemplateState, warm_error: WarmError | None) -> None:
        self.state = state
        self.warm_error = warm_error
        detail = f": {warm_error.error}: {warm_error.message}" if warm_error else ""
        super().__init__(f"template is {state.value}{detail}")


class ForkFailed(Exception):
    """The template could not start the fiber (one-line reason; ``errno`` the cause's,
    when an OSError was: EMFILE/ENFILE make the Clone's answer ``busy``)."""

    def __init__(self, reason: str, errno: int | None = None) -> None:
        super().__init__(reason)
        self.errno = errno


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
    path: tuple[str, ...] = ()  # a call's import path (CallTarget.path), checked in the fiber
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


def template_env(base: Mapping[str, str], spec: TemplateSpec,
                 channel: DeviceChannel) -> dict[str, str]:
    """The environment a template starts with: ``base``, the grant's env, then the
    channel's visibility variables, which always win (a grant cannot widen its devices)."""
    return {**base, **spec.env, **channel.env()}


def template_command(python: str, env: Mapping[str, str], fd: int,
                     parent: int, no_new_privs: bool = False
                     ) -> tuple[list[str], dict[str, str], list[str]]:
    """The argv and env that start a template (``template_main``), and the PYTHONPATH entries
    left out as unsafe (one line each, for fiberd's log). ``no_new_privs``: the template
    sets it first thing (a root fiberd's, core/identity.py)."""
    env = dict(env)
    dropped = []
    if env.get("PYTHONPATH"):
        kept = []
        for entry in env["PYTHONPATH"].split(os.pathsep):
            why = safe_path_entry(entry)
            if why is None:
                kept.append(entry)
            else:
                dropped.append(f"PYTHONPATH entry {entry!r} left out: {why}")
        env["PYTHONPATH"] = os.pathsep.join(kept)
    argv = [python, "-P", "-m", "slurm_fiber.core.templates.child.main", "--fd", str(fd),
            "--parent", str(parent), *(["--no-new-privs"] if no_new_privs else [])]
    return argv, env, dropped


class Template:
    """One grant's warm template process, its spares, and the fibers forked from it.

    Build with ``await Template.start(...)``. Read ``state``, ``warm_error``,
    ``pid``, ``fibers`` (id → running Fiber), ``restarts``, ``last_fault``
    (why the last process was given up on, one line; None if none was).
    The process I/O is here; what happens when is ``core/lifecycle.py``'s
    table, the spares' bookkeeping ``core/spares.py``'s and the leaves'
    ``core/leaves.py``'s. Not thread-safe.
    """

    def __init__(self, uid: str, spec: TemplateSpec, env: Mapping[str, str],
                 cgroup: GrantCgroup | None, *, state_dir: Path, clock: Clock,
                 python: str = sys.executable, backoff: Backoff | None = None,
                 spares: int = 1, timeout: float = DEFAULT_TIMEOUT,
                 exec_spawn: ExecSpawn = "hot", spares_once_cloned: bool = False,
                 spares_idle: float | None = None,
                 identity: FiberIdentity | None = None) -> None:
        self.uid = uid
        self.identity = identity  # who it runs as (a root fiberd's fiber_user), else fiberd's
        self.spec = spec
        self.env = dict(env)
        self.cgroup = cgroup
        self.state_dir = state_dir
        self._out_dir = state_dir / "fibers"  # fibers' output files, when not passed
        self._out_text = str(self._out_dir)
        self.clock = clock
        self.python = python
        self.spares = spares
        self.spares_idle = spares_idle
        self._last_fork: float | None = None  # clock mono of the last fork asked
        self.timeout = timeout
        self._late = LateReports(clock, self._ask_reap)  # its fibers' lagging exit reports
        self.pid: int | None = None
        self.fibers: dict[str, Fiber] = {}
        self.life = Lifecycle(backoff)
        self._changed = asyncio.Event()
        self._sock: socket.socket | None = None
        self._pidfd: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._spare_ids = itertools.count(1)  # never reset: a leaf may outlive its process
        self.exec_spawn = exec_spawn
        self._moved_at: float | None = None  # clock mono of our last cgroup move (spawn, spare)
        # With ``spares_once_cloned``, spares are kept once the grant has run a fiber (a
        # grant never cloned holds its template only). Spawns are asked one per exec fiber,
        # never ahead: their pool only tracks them (target 0).
        self._pools = {Kind.FIBER: SparePool(Kind.FIBER, 0 if spares_once_cloned else spares),
                       Kind.SPAWN: SparePool(Kind.SPAWN, 0)}
        self._spawning: dict[str, _Spawn] = {}  # by spare id, until its Clone has it
        self._leaves = LeafPool(cgroup)
        self.windows: dict[str, WindowLink] = {}  # task windows running (window_parent.py)
        self._window_leaves = 0  # leaves they hold: kept free for the next window

    @classmethod
    async def start(cls, uid: str, spec: TemplateSpec, env: Mapping[str, str],
                    cgroup: GrantCgroup | None = None, *, state_dir: Path, clock: Clock,
                    python: str = sys.executable, backoff: Backoff | None = None,
                    spares: int = 1, timeout: float = DEFAULT_TIMEOUT,
                    exec_spawn: ExecSpawn = "hot", spares_once_cloned: bool = False,
                    spares_idle: float | None = None,
                    identity: FiberIdentity | None = None) -> Template:
        """Spawn the template and return at once, ``warming``; once ready it keeps
        ``spares`` spare processes (with ``spares_once_cloned``, from its first fiber on)
        until ``spares_idle`` clock seconds pass with no fork
        (``shed_idle_spares``; None: never); ``exec_spawn``: when an exec fiber is
        spawned rather than handed a spare (module doc). ``timeout``: seconds it and
        its spares may take to answer (module doc). ``identity``: the account it and
        its fibers run as (core/identity.py; None: fiberd's own). Raises OSError if the
        process cannot be started (e.g. ``state_dir`` not writable)."""
        template = cls(uid, spec, env, cgroup, state_dir=state_dir, clock=clock,
                       python=python, backoff=backoff, spares=spares, timeout=timeout,
                       exec_spawn=exec_spawn, spares_once_cloned=spares_once_cloned,
                       spares_idle=spares_idle, identity=identity)
        (state_dir / "fibers").mkdir(mode=0o700, parents=True, exist_ok=True)
        template._spawn()
        return template

    # ------------------------------------------------------------ public

    @property
    def state(self) -> TemplateState:
        return self.life.shown

    @property
    def warm_error(self) -> WarmError | None:
        return self.life.warm_error

    @property
    def last_fault(self) -> str | None:
        return self.life.last_fault

    @property
    def restarts(self) -> int:
        return self.life.restarts

    @property
    def backoff(self) -> Backoff:
        return self.life.backoff

    @backoff.setter
    def backoff(self, backoff: Backoff) -> None:
        self.life.backoff = backoff

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

        An exec request may be spawned straight into a leaf (``exec_spawn``), or, when its
        program cannot start so, and for a call, runs in an idle spare, else one
        made now (waiting at most ``timeout`` for it). Raises TemplateNotReady
        unless ``ready``, also when the template dies, stops answering or is
        stopped meanwhile; ValueError for a malformed request; ForkFailed when
        the template cannot fork or the fiber's cgroup cannot be made.
        """
        request.check()
        self._last_fork = self.clock.mono()
        self._pools[Kind.FIBER].target = self.spares  # a first fiber: keep spares from now on
        if request.mode == "exec" and self._spawns():
            with contextlib.suppress(_SpawnRefused):  # a spare's fork then says why
                fiber = await self._spawn_exec(request)
                self._refill()
                return fiber
        gone = ""
        for _ in range(2):  # an idle spare may have died unseen: then one made now
            if not self.life.ready or self._sock is None:
                raise self._not_ready()
            if request.id in self.fibers:
                raise ForkFailed(f"fiber id {request.id} is in use")
            try:
                # Not another idle one: the spares may have died with the template, unseen
                # yet; asking the template tells (not ready) instead of failing the Clone.
                spare = await self._take_spare(self._pools[Kind.FIBER], idle=not gone)
            except _NoAnswer:
                raise self._not_ready() from None
            self._refill_unless_idle(self._pools[Kind.FIBER])
            try:
                return await self._hand_over(spare, request)
            except _SpareGone as err:
                gone = str(err)
        if not self.life.ready:
            raise self._not_ready()
        raise ForkFailed(gone)

    def retry_after(self) -> float:
        """Seconds until this template is expected ready again: the rest of its backoff and
        the last warm's duration (a guess of 1 s before any was measured)."""
        return self.life.retry_after(self.clock.mono())

    async def stop_fibers(self, grace: float, *,
                          before_epoch: int | None = None) -> list[FiberEnd]:
        """Stop running fibers (all, or those of an epoch older than ``before_epoch``);
        returns once they are gone."""
        chosen = [f for f in self.fibers.values()
                  if before_epoch is None or f.epoch < before_epoch]
        return await stop_all(chosen, grace)

    async def stop(self, grace: float) -> None:
        """Stop every fiber (SIGTERM, grace, SIGKILL: carved, one ``cgroup.kill`` of the
        grant's ``fibers`` cgroup, which holds only fibers and spares), the spares, then
        the template; returns once all are gone. The template is ``stopped`` for good
        (no re-warm)."""
        self._on(Event.STOP)
        fibers = self.cgroup.fibers if self.cgroup is not None else None
        await stop_all(list(self.fibers.values()), grace,
                       functools.partial(cgroup_kill, fibers) if fibers is not None else None)
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
        await self._leaves.settle()
        self._on(Event.STOPPED)

    @property
    def idle_spares(self) -> list[int]:
        """Pids of the (fiber) spares waiting for an order now."""
        return [s.spared.result() for s in self._pools[Kind.FIBER].idle]

    def to_json(self) -> dict[str, object]:
        return {"uid": self.uid, "state": self.state.value, "pid": self.pid,
                "warm_error": self.warm_error.to_json() if self.warm_error else None,
                "restarts": self.restarts, "last_fault": self.last_fault,
                "fibers": len(self.fibers), "spares": len(self._pools[Kind.FIBER].idle),
                "cgroup": str(self.cgroup.path) if self.cgroup else None}

    # ------------------------------------------------------------ lifecycle

    def _on(self, event: Event, detail: str = "", *, status: int = 0,
            warm_error: WarmError | None = None) -> None:
        """Feed ``event`` to the lifecycle and perform the actions it gives (but REWARM,
        which ``_watch`` performs: it is the one that waits)."""
        seen = self.life.shown
        actions = self.life.on(event, self.clock.mono(), detail, status=status,
                               warm_error=warm_error)
        if self.life.shown is not seen or event is Event.STOPPED:
            self._changed.set()
            self._changed = asyncio.Event()
        for action in actions:
            if action is Action.REFILL:
                self._refill()
            elif action is Action.DISMISS_SPARES:
                self._dismiss_spares()
            elif action is Action.KILL_FIBERS:
                for fiber in list(self.fibers.values()):
                    fiber.note_reason("template_lost",
                                      f"its template stopped answering ({detail}) "
                                      "and was killed, and the fiber with it")
                    fiber.kill()  # they would die by their death signal; this takes groups
            elif action is Action.KILL_PROCESS:
                self._kill_process()
            elif action is Action.FIBERS_LOST:
                fault = None if self.life.stopping else self.last_fault
                for fiber in list(self.fibers.values()):
                    fiber.template_lost(fault)

    # ------------------------------------------------------------ spares

    async def _take_spare(self, pool: SparePool, *, idle: bool = True) -> Spare:
        """An idle spare of ``pool`` (when ``idle``), else a new one once the template has
        made it."""
        kept = pool.take() if idle else None
        if kept is not None:
            return kept
        spare = await self._ask_spare(pool)
        try:
            await asyncio.shield(spare.spared)
        except asyncio.CancelledError:
            # The Clone was cancelled: the spare, when it comes, waits for the next one.
            spare.spared.add_done_callback(lambda _: self._keep_idle(pool, spare))
            raise
        return spare

    async def _ask_spare(self, pool: SparePool) -> Spare:
        """Ask the template for one more spare of ``pool``'s kind (its ``spared`` future
        tells when it is made; the template has ``timeout`` to answer, see ``_guard``).
        Raises ForkFailed when its cgroup leaf fails, _NoAnswer when the template cannot
        take the request (it is then given up on)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            ours.setblocking(False)
            try:
                return await self._ask(pool, ours, {}, [theirs.fileno()])
            except BaseException:
                ours.close()
                raise

    async def _ask(self, pool: SparePool, orders: socket.socket | None,
                   extra: dict[str, object], fds: list[int]) -> Spare:
        """Take a leaf and send the template ``pool``'s request for it (``extra`` fields
        added, ``fds`` riding along); the spare it is about, asked. Raises ForkFailed when
        the leaf fails, _NoAnswer when the template cannot take the request (it is then
        given up on)."""
        spare_id = str(next(self._spare_ids))
        try:
            leaf = await self._leaves.take(spare_id)
        except LeafCreateFailed as err:
            raise ForkFailed(str(err), err.errno) from None
        spare = Spare(spare_id, pool.kind, leaf, orders,
                      asyncio.get_running_loop().create_future(), asked=self.clock.mono())
        pool.asked(spare)
        try:
            await _send(self._sock, {"t": pool.kind.value, "id": spare_id,
                                     "cgroup": str(leaf) if leaf else None,
                                     "also": [str(m) for m in cgroup_mirrors(leaf)]
                                     if leaf else [], **extra},
                        fds, "the template", self.clock, self.timeout)
        except BaseException as err:
            self._bury(pool, spare)
            if isinstance(err, ForkFailed):
                self._on(Event.STALLED, str(err))
                raise _NoAnswer(str(err)) from None
            raise
        return spare

    # ------------------------------------------------------------ task windows

    async def window_leaves(self, window_id: str, count: int) -> list[Path | None]:
        """``count`` free leaves for a task window (None each when uncarved). Raises
        LeafCreateFailed (those taken are given back)."""
        leaves: list[Path | None] = []
        try:
            for n in range(count):
                leaves.append(await self._leaves.take(f"{window_id}-{n}"))
        except LeafCreateFailed:
            self.give_back_window(leaves)
            raise
        self._window_leaves += count
        return leaves

    def give_back_window(self, leaves: list[Path | None]) -> None:
        """A window's leaves, empty now (killed, or all its tasks ended): kept for the next
        window (as many as windows take at most) rather than removed and made again. Their
        memory figures are not renewed (the window path reads no peak)."""
        for leaf in leaves:
            if leaf is not None:
                self._give_back(leaf, None, None)
        self._window_leaves = max(0, self._window_leaves - len(leaves))

    async def open_window(self, link: WindowLink, msg: dict[str, object],
                          fds: list[int]) -> None:
        """Send a task window's order (core/templates/child/window_run.py); its reports
        go to ``link``. Raises TemplateNotReady."""
        if not self.life.ready or self._sock is None:
            raise self._not_ready()
        self.windows[link.id] = link
        try:
            await _send(self._sock, msg, fds, "the template", self.clock, self.timeout)
        except ForkFailed:
            self.windows.pop(link.id, None)
            raise self._not_ready() from None
        self._moved_at = self.clock.mono()

    def window_order(self, window_id: str, kind: str, **fields: object) -> None:
        """``window_close``, ``window_extend`` (``left``) or ``window_ack`` to the template;
        best effort: fiberd's kill through the leaves does not depend on it."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.send(wire.encode({"t": kind, "id": window_id, **fields}))

    def _spawns(self) -> bool:
        """Whether an exec Clone now is spawned rather than handed an idle spare."""
        if self.exec_spawn != "hot":
            return self.exec_spawn == "always"
        moved = self._moved_at
        return (moved is not None and self.clock.mono() - moved < SPAWN_HOT) \
            or not self._pools[Kind.FIBER].has_idle()

    async def _spawn_exec(self, request: FiberRequest) -> Fiber:
        """Have the template start exec ``request``'s program straight into a leaf
        (core/exec_spawn.py); the fiber, running. Raises as ``fork``, and _SpawnRefused
        when the program cannot start so (its leaf is given back)."""
        if not self.life.ready or self._sock is None:
            raise self._not_ready()
        if request.id in self.fibers or any(
                s.request.id == request.id for s in self._spawning.values()):
            raise ForkFailed(f"fiber id {request.id} is in use")
        pool = self._pools[Kind.SPAWN]
        order, fds, opened = self._order_fds(request)
        try:
            spare = await self._ask(pool, None, {"order": order}, fds)
        except _NoAnswer:
            raise self._not_ready() from None
        finally:
            _close_all(opened)
        spawn = self._spawning[spare.id] = _Spawn(request)
        try:
            await asyncio.shield(spare.spared)
        except _NoAnswer:
            raise self._not_ready() from None
        except asyncio.CancelledError:
            # Nobody will hear of the fiber: once started, it is killed at once.
            spare.spared.add_done_callback(lambda f: self._unwanted(f, spare.id))
            raise
        finally:
            self._spawning.pop(spare.id, None)
        assert spawn.fiber is not None
        return spawn.fiber  # perhaps ended already: a fast program's exit came with it

    def _give_back(self, leaf: Path, peak: int | None, oom_kills: int | None) -> None:
        """An ended fiber's empty leaf: kept for a later spare or spawn, or removed. As many
        are kept as spares are wanted, plus one per spawned fiber still running: a map of
        exec fibers finds its next leaf free, rather than making one and removing one
        per task."""
        wanted = sum(p.target for p in self._pools.values()) + self._pools[Kind.SPAWN].running() \
            + self._window_leaves
        self._leaves.give_back(leaf, peak, oom_kills, keep=self.life.ready,
                               limit=max(wanted, 1))

    def _refill(self) -> None:
        """Make spares in the background until each pool's target is idle or being made."""
        for pool in self._pools.values():
            if (pool.filling is None or pool.filling.done()) and self._short(pool):
                pool.filling = asyncio.ensure_future(self._fill(pool))

    def _refill_unless_idle(self, pool: SparePool) -> None:
        """After a Clone took a spare of ``pool`` (forked from the template): refill now
        when none is left idle, else when that fiber ends (``_hand_over``), so the
        template's fork does not hold up the fiber's exit."""
        if not pool.has_idle():
            self._refill()

    def _short(self, pool: SparePool) -> bool:
        return self.life.ready and pool.short()

    async def _fill(self, pool: SparePool) -> None:
        while self._short(pool):
            try:
                spare = await self._ask_spare(pool)
                await asyncio.shield(spare.spared)
            except _NoAnswer:
                return  # the template is gone or given up on: no spares until re-warmed
            except ForkFailed as err:
                log.warning("template %s: no spare made: %s", self.uid, err)
                return
            self._keep_idle(pool, spare)

    def _keep_idle(self, pool: SparePool, spare: Spare) -> None:
        """A spared spare nobody took: keep it for the next Clone (or bury it)."""
        if spare.spared.cancelled() or spare.spared.exception() is not None:
            return
        if self.life.ready:
            pool.keep(spare)
        else:
            self._bury(pool, spare)

    async def _hand_over(self, spare: Spare, request: FiberRequest) -> Fiber:
        """Send ``spare`` its order; the fiber it becomes (its result comes back on the
        same channel). Raises _SpareGone if it died."""
        pool = self._pools[spare.kind]
        order, fds, opened = self._order_fds(request)
        try:
            await _send(spare.orders, order, fds, "the spare fiber process", self.clock,
                        self.timeout)
        except BaseException as err:
            self._bury(pool, spare)
            if isinstance(err, ForkFailed):
                raise _SpareGone(str(err)) from None
            raise
        finally:
            _close_all(opened)
        return self._become(pool, spare, request)

    def _become(self, pool: SparePool, spare: Spare, request: FiberRequest) -> Fiber:
        """Make ``spare``, handed ``request`` and its pid known, the running fiber it is
        now (in ``fibers``; its exit report reaches it by spare id)."""
        fiber = Fiber(
            id=request.id, pid=spare.pid, uid=self.uid, jti=request.jti,
            epoch=request.epoch, deadline=request.deadline, started=self.clock.mono(),
            mode=request.mode, cgroup=spare.cgroup, clock=self.clock,
            stdout_path=self._out_file(request, ".out") if request.stdio[1] is None else None,
            stderr_path=self._out_file(request, ".err") if request.stdio[2] is None else None,
            report_timeout=self.timeout, parent=self.pid, late=self._late)
        fiber.attach(spare.orders, spare.pidfd)
        self.fibers[request.id] = fiber
        pool.use(spare, fiber)

        def gone(f: Fiber) -> None:
            self.fibers.pop(f.id, None)
            pool.used(spare.id)
            if f.cgroup is not None:
                end = f.exit
                self._give_back(f.cgroup, end.memory_peak if end else None,
                                end.oom_kills if end else None)
            self._refill()  # its replacement, if it waited (``_refill_unless_idle``)

        fiber.on_done(gone)
        return fiber

    def shed_idle_spares(self) -> bool:
        """When no fork was asked for ``spares_idle`` clock seconds, dismiss the spares
        (idle or being made) and keep none until the next fork, which forks on the spot
        and restores them; whether it did now. Called by the core's upkeep."""
        pools = self._pools.values()
        if (self.spares_idle is None or self._last_fork is None
                or self.clock.mono() - self._last_fork < self.spares_idle
                or not any(p.target for p in pools)):
            return False
        for pool in pools:
            pool.target = 0
        self._dismiss_spares()
        return True

    def _dismiss_spares(self) -> None:
        """Bury every spare not yet handed an order (idle or being made); remove the free
        leaves."""
        for pool in self._pools.values():
            if pool.filling is not None:
                pool.filling.cancel()
            for spare in pool.dismiss():
                self._bury(pool, spare)
        self._leaves.clear()

    def _bury(self, pool: SparePool, spare: Spare) -> None:
        """Kill an unused spare and remove its leaf, in the background (``stop`` waits)."""
        pool.drop(spare)
        if spare.orders is not None:
            spare.orders.close()
        if not spare.spared.done():
            spare.spared.set_exception(_NoAnswer("the template is gone"))
        if not spare.spared.cancelled():
            spare.spared.exception()  # retrieved: nobody may be waiting for it
        self._leaves.track(asyncio.ensure_future(_kill_spare(spare, self._leaves)))

    # ------------------------------------------------------------ process

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log_path = self.state_dir / f"template-{safe_name(self.uid)}.log"
        identity = self.identity
        argv, env, dropped = template_command(self.python, self.env, theirs.fileno(),
                                              os.getpid(), no_new_privs=identity is not None)
        for line in dropped:
            log.warning("template of %s: %s", self.uid, line)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        with theirs, open(os.open(log_path, flags, 0o600), "ab") as log_file:
            # Another account starts in "/": fiberd's state dir is not its to read.
            proc = subprocess.Popen(
                argv, env=env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                stdout=log_file, stderr=log_file,
                cwd="/" if self._other_account else self.state_dir,
                **(identity.spawn_args() if identity is not None else {}))
        if self._other_account and self.cgroup is not None:
            self._place(proc)
        ours.setblocking(False)
        self._sock = ours
        self._pidfd = os.pidfd_open(proc.pid)
        self.pid = proc.pid
        order = {"t": "warm", "preload": list(self.spec.preload), "warm": self.spec.warm,
                 "cgroup": str(self.cgroup.template) if self.cgroup else None,
                 "also": [str(m) for m in cgroup_mirrors(self.cgroup.template)]
                 if self.cgroup else []}
        ours.send(wire.encode(order))
        self._on(Event.SPAWNED)
        self._task = asyncio.ensure_future(self._watch(ours, proc, self._pidfd))

    def _place(self, proc: subprocess.Popen[bytes]) -> None:
        """Move a template of another account into its leaf (and v1 mirrors) before it
        is told to warm: its own join from fiberd's cgroup would need write access
        where only root has it. Its join then finds it there. A failed move is left to
        that join, which reports it as the warm's failure."""
        assert self.cgroup is not None
        for group in (*cgroup_mirrors(self.cgroup.template), self.cgroup.template):
            try:
                cgroup_join(group, proc.pid)
            except OSError as err:
                log.warning("template of %s: cannot place it in %s: %s", self.uid, group,
                            err.strerror)
                return

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
                while True:
                    data, fds, _, _ = socket.recv_fds(sock, wire.MAX_MESSAGE + 1, 1,
                                                      socket.MSG_CMSG_CLOEXEC)
                    if not data:
                        break
                    try:
                        msg = wire.decode(data)
                    except wire.WireError:
                        msg = {"t": "unreadable"}
                    self._dispatch(msg, fds)
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
                    self._on(Event.STALLED, f"still running {self.timeout:g} s after "
                             "closing its socket")
                    self._kill_process()  # also when it was not ready (a failed warm)
                await dying
        finally:
            loop.remove_reader(sock.fileno())
            guard.cancel()
        await pidfd_wait(pidfd)
        self._kill_process()  # what it left in its process group or cgroup leaf
        for link in list(self.windows.values()):
            link.gone()  # its windows' leaves killed, what no report told learnt from them
        self.windows.clear()
        status = proc.wait()
        os.close(pidfd)
        sock.close()
        self._sock = self._pidfd = None
        self._on(Event.EXITED, status=status)
        while self.life.phase is Phase.REWARMING:
            await self.clock.sleep(self.life.delay)
            if self.life.phase is not Phase.REWARMING:
                return  # stopped meanwhile
            try:
                self._spawn()
                return
            except OSError as err:
                self._on(Event.SPAWN_FAILED, str(err))
                log.error("template %s: %s", self.uid, self.last_fault)

    async def _guard(self, pid: int) -> None:
        """Give the template process up (STALLED) once ``stall.judge`` says it stalled:
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
            asked = min((t for p in self._pools.values()
                         if (t := p.oldest_ask()) is not None), default=None)
            seen = stall.Seen(asked, stopped_since, watching)
            verdict = stall.judge(seen, now, self.timeout, every)
            if verdict.reason is not None:
                self._on(Event.STALLED, verdict.reason)
                return
            await self.clock.sleep(verdict.recheck)

    def _kill_process(self) -> None:
        """SIGKILL the template process, its process group (it leads one) and, carved, all
        in its cgroup leaf. Its spares and fibers die by their death signal. Never raises."""
        if self._pidfd is None or self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # unreaped, its pid cannot be reused
        if self.cgroup is not None and populated(self.cgroup.template):
            with contextlib.suppress(OSError):
                cgroup_kill(self.cgroup.template)

    def _ask_reap(self, pid: int) -> None:
        """Ask the template process to reap fiber ``pid`` now: its exit outran its report
        (``LateReports``). Best effort: a full socket or a gone template drops the ask,
        and the template's own walk of its children still finds the fiber."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.send(wire.encode({"t": "reap", "pid": pid}))

    def _not_ready(self) -> TemplateNotReady:
        state = TemplateState.STOPPED if self.life.stopping else self.state
        return TemplateNotReady(state, self.warm_error)

    def _dispatch(self, msg: dict[str, object], fds: list[int]) -> None:
        """Act on one message from the template; its ``fds`` are taken (used or closed)."""
        kind = msg["t"]
        if kind == "window_report":
            _close_all(fds)
            link = self.windows.get(str(msg.get("id")))
            if link is not None:
                link.reported(msg)
                if link.finished:
                    del self.windows[link.id]
            return
        spawn = self._pools[Kind.SPAWN]
        spare = spawn.answered(str(msg.get("id"))) if kind in ("spawned", "spawn_failed") \
            else None
        if spare is not None and self.life.phase is not Phase.REWARMING:
            self._spawned(spawn, spare, msg, fds)
            return
        for fd in fds:
            if kind == "spawned":  # nobody waits for it (given up on, stopping): kill it
                _kill_by_pidfd(fd, msg.get("pid"))
            os.close(fd)
        if self.life.phase is Phase.REWARMING and kind != "exit":
            return  # given up on: only its fibers' exits still count
        if kind == "ready":
            self._on(Event.READY)
        elif kind == "warm_failed":
            self._on(Event.WARM_FAILED, warm_error=WarmError(str(msg.get("error")),
                                                             str(msg.get("message"))))
        elif kind in ("spared", "fork_failed"):
            for pool in self._pools.values():
                spare = pool.answered(str(msg.get("id")))
                if spare is not None:
                    self._spared(pool, spare, msg)
        elif kind == "exit":
            spare_id = str(msg.get("id"))
            for pool in self._pools.values():
                if (fiber := pool.fiber(spare_id)) is not None:
                    fiber.reported_exit(msg)
                    return
            for pool in self._pools.values():
                if (idle := pool.idle_one(spare_id)) is not None:
                    self._bury(pool, idle)  # it died idle (killed, or its set-up failed)

    def _spawned(self, pool: SparePool, spare: Spare, msg: dict[str, object],
                 fds: list[int]) -> None:
        """The template's answer to a spawn: the fiber, made here and now (its exit may
        be the next message), or the refusal (its leaf back to the pool)."""
        spawn = self._spawning.get(spare.id)
        if msg["t"] == "spawn_failed" or len(fds) != 1 or spawn is None:
            for fd in fds:
                os.close(fd)
            if spare.cgroup is not None:
                self._give_back(spare.cgroup, None, None)
            spare.spared.set_exception(_SpawnRefused(str(msg.get("message"))))
            return
        spare.pid, spare.pidfd = int(str(msg.get("pid"))), fds[0]
        self._moved_at = self.clock.mono()
        spawn.fiber = self._become(pool, spare, spawn.request)
        spare.spared.set_result(spare.pid)

    def _unwanted(self, answer: asyncio.Future[int], spare_id: str) -> None:
        """The ``answer`` to a spawn whose Clone was cancelled: kill the fiber it started."""
        if answer.cancelled() or answer.exception() is not None:
            return
        fiber = self._pools[Kind.SPAWN].fiber(spare_id)
        if fiber is not None:
            fiber.note_reason("cancelled", "its Clone was cancelled while it started")
            fiber.kill()

    def _spared(self, pool: SparePool, spare: Spare, msg: dict[str, object]) -> None:
        if msg["t"] == "fork_failed":
            spare.spared.set_exception(ForkFailed(f"fork failed: {msg.get('message')}"))
            self._bury(pool, spare)
            return
        pid = int(str(msg.get("pid")))
        try:
            spare.pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._bury(pool, spare)
            return
        spare.pid = pid
        self._moved_at = self.clock.mono()  # it joins its leaf now
        spare.spared.set_result(pid)

    def _out_file(self, request: FiberRequest, suffix: str) -> Path:
        """Where the fiber's stdout (``.out``) or stderr (``.err``) goes when not passed."""
        return self._out_dir / f"fiber-{request.id}{suffix}"

    @property
    def _other_account(self) -> bool:
        """Whether the template runs as an account other than fiberd's (fiber_user)."""
        return self.identity is not None and self.identity.uid != os.geteuid()

    def _order_fds(self, request: FiberRequest) -> tuple[dict[str, object], list[int],
                                                         list[int]]:
        """The run order for ``request``, the fds that go with it, and those of them fiberd
        opened here (the caller closes them once sent). A fiber of another account
        (fiber_user) cannot reach fiberd's state dir: fiberd opens its output files itself
        and passes them, so the files are where they always are, and fiberd's."""
        stdio = list(request.stdio)
        opened: list[int] = []
        if self._other_account:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                for target, suffix in ((1, ".out"), (2, ".err")):
                    if stdio[target] is None:
                        fd = os.open(self._out_file(request, suffix), flags, 0o600)
                        opened.append(fd)
                        stdio[target] = fd
            except OSError as err:
                _close_all(opened)
                raise ForkFailed(f"cannot open the fiber's output file: {err}",
                                 err.errno) from None
        order = self._order(request)
        order["stdio"] = [fd is not None for fd in stdio]
        return order, [fd for fd in stdio if fd is not None], opened

    def run_order(self, request: FiberRequest) -> dict[str, object]:
        """The run order the template gets for ``request`` (a task window's task's)."""
        return self._order(request)

    def _order(self, request: FiberRequest) -> dict[str, object]:
        env = {k: v for k, v in request.env.items() if k not in ALL_VISIBILITY_VARS}
        return {"t": "run", "id": request.id, "mode": request.mode, "target": request.target,
                "args": list(request.args), "kwargs": dict(request.kwargs),
                "pickled": request.pickled, "path": list(request.path),
                "argv": list(request.argv), "env": env, "cwd": request.cwd,
                "stdio": [fd is not None for fd in request.stdio],
                "out_dir": self._out_text}


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


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
            raise ForkFailed(f"cannot reach {peer}: {e.strerror}", e.errno) from None


@dataclass
class _Spawn:
    """An exec fiber asked of the template (``request``), and the fiber once started."""

    request: FiberRequest
    fiber: Fiber | None = None


class _SpareGone(Exception):
    """The spare died before it took its order (one line)."""


class _SpawnRefused(Exception):
    """The template could not start an exec fiber's program straight into a leaf (one
    line): a forked spare will run it and say why."""


class _NoAnswer(ForkFailed):
    """The template cannot serve a spare request: it is gone, stopped answering or is
    stopping (it is no longer ready; ``fork`` turns this into TemplateNotReady)."""


def _kill_by_pidfd(pidfd: int, pid: object) -> None:
    """SIGKILL the process ``pidfd`` names and the process group it leads (``pid``, while
    it is unreaped). Never raises."""
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    if isinstance(pid, int) and not pidfd_exited(pidfd):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


async def _kill_spare(spare: Spare, leaves: LeafPool) -> None:
    """SIGKILL a spare that never ran user code and wait until it is gone; its leaf goes
    back to ``leaves`` for removal."""
    if spare.cgroup is not None:
        await cgroup_empty(spare.cgroup)
        leaves.discard(spare.cgroup)
    elif spare.pidfd is not None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(spare.pidfd, signal.SIGKILL)
        await pidfd_wait(spare.pidfd)
    if spare.pidfd is not None:
        os.close(spare.pidfd)
        spare.pidfd = None
