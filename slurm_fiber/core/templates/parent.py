"""Warm templates, parent side: one grant's template, its spares and the fibers forked from it.

Usage (on fiberd's event loop; nothing here blocks it)::

    mgr = CgroupManager(root)                      # core/cgroups/manager.py
    cg = mgr.carve_grant(uid, spec.limits)         # None when uncarved
    env = template_env(os.environ, spec.template, channel.narrowed(spec.devices))
    t = await Template.start(uid, spec.template, env, cg, state_dir=d, clock=clock)
    await t.wait_warm()                            # READY or WARM_FAILED
    fiber = await t.fork(FiberRequest(id="f1", mode="call", target="m:f", args=[1]))
    exit = await fiber.wait()                      # or: await fiber.stop(grace)
    await t.stop(grace)                            # fibers, then the template

``Template`` is the façade and the lifecycle: it feeds each event to
templates/lifecycle.py's transition table (states, backoff) and performs the actions
it gives, and it stops everything. Its parts have one job each: ``TemplateProcess``
(process.py: start, serve, guard, kill, re-warm), ``SpareKeeper`` (sparing.py: spares
forked ahead of need, their leaves), ``Conversation`` (conversation.py: what the
template says), ``Orders`` (orders.py: a fiber's order and its hand-over). Task
windows (``task_window = "template"``, core/runtime/task_window.py) take their leaves
from the keeper and their orders and reports through the conversation. The child side
is templates/child/.

States: ``warming`` → ``ready`` | ``warm_failed``; a ready template that dies is
``rewarming`` (after a backoff on the injected Clock, doubling from 0.5 s to 30 s, reset
on ready) and its running fibers are accounted as ``lost``; a template that dies while
warming is ``warm_failed`` (a warm that crashes the interpreter would crash again).
``stop()`` → ``stopped``. Bounded waits: every wait on the template or a spare ends
within ``timeout`` seconds on the clock; a template that stops answering is
``rewarming`` at once, its fibers and then it are killed, and it is re-warmed after the
backoff. A Clone meanwhile gets TemplateNotReady (the runtime answers the retryable
``cold``), never a hang. Fiber exits are seen through each fiber's pidfd even then.
Warming itself is not bounded (a grant's warm code may take minutes). Not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from slurm_fiber.core.cgroups.common import GrantCgroup
from slurm_fiber.core.cgroups.groups import kill as cgroup_kill
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.devices import DeviceChannel
from slurm_fiber.core.fibers.ends import LateReports
from slurm_fiber.core.fibers.fiber import Fiber, FiberEnd, stop_all
from slurm_fiber.core.runtime.identity import FiberIdentity
from slurm_fiber.core.templates import wire
from slurm_fiber.core.templates.conversation import Conversation
from slurm_fiber.core.templates.faults import ForkFailed, TemplateNotReady
from slurm_fiber.core.templates.lifecycle import (
    Action,
    Backoff,
    Event,
    Lifecycle,
    TemplateState,
    WarmError,
)
from slurm_fiber.core.templates.orders import FiberRequest, Orders
from slurm_fiber.core.templates.process import TemplateProcess
from slurm_fiber.core.templates.spares import Kind
from slurm_fiber.core.templates.sparing import SpareKeeper
from slurm_fiber.core.templates.window_parent import WindowLink
from slurm_fiber.core.trust.grant import TemplateSpec
from slurm_fiber.core.waiting import first_done

__all__ = ["DEFAULT_TIMEOUT", "Backoff", "FiberRequest", "ForkFailed", "Template",
           "TemplateNotReady", "TemplateState", "WarmError", "template_env"]

DEFAULT_TIMEOUT = 10.0  # seconds a template or a spare may take to answer (template_timeout)
ExecSpawn = Literal["never", "hot", "always"]  # when an exec fiber is spawned (orders.py)


def template_env(base: Mapping[str, str], spec: TemplateSpec,
                 channel: DeviceChannel) -> dict[str, str]:
    """The environment a template starts with: ``base``, the grant's env, then the
    channel's visibility variables, which always win (a grant cannot widen its devices)."""
    return {**base, **spec.env, **channel.env()}


class Template:
    """One grant's warm template process, its spares, and the fibers forked from it.

    Build with ``await Template.start(...)``. Read ``state``, ``warm_error``,
    ``pid``, ``fibers`` (id → running Fiber), ``restarts``, ``last_fault``
    (why the last process was given up on, one line; None if none was).
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
        self.clock = clock
        self.python = python
        self.spares = spares
        self.spares_idle = spares_idle
        self.timeout = timeout
        self.exec_spawn = exec_spawn
        self.fibers: dict[str, Fiber] = {}
        self.windows: dict[str, WindowLink] = {}  # task windows running (window_parent.py)
        self.life = Lifecycle(backoff)
        self._changed = asyncio.Event()
        self.process = TemplateProcess(self)
        self.keeper = SpareKeeper(self, spares_once_cloned)
        self.talk = Conversation(self)
        self.orders = Orders(self)
        self.late = LateReports(clock, self.process.ask_reap)  # its fibers' lagging exit reports

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
        template.process.spawn()
        return template

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

    @property
    def pid(self) -> int | None:
        """The template process's pid (None before the first start)."""
        return self.process.pid

    async def fork(self, request: FiberRequest) -> Fiber:
        """Start one fiber and return it running (orders.py: ``Orders.fork``)."""
        return await self.orders.fork(request)

    @property
    def idle_spares(self) -> list[int]:
        """Pids of the (fiber) spares waiting for an order now."""
        return self.keeper.idle_spares

    def shed_idle_spares(self) -> bool:
        """Dismiss the spares when no fork was asked for ``spares_idle`` clock seconds
        (``SpareKeeper.shed_idle``); whether it did now. Called by the core's upkeep."""
        return self.keeper.shed_idle()

    # ------------------------------------------------------------ task windows

    async def window_leaves(self, window_id: str, count: int) -> list[Path | None]:
        """``count`` free leaves for a task window (``SpareKeeper.window_leaves``)."""
        return await self.keeper.window_leaves(window_id, count)

    def give_back_window(self, leaves: list[Path | None]) -> None:
        """A window's leaves, empty now (``SpareKeeper.give_back_window``)."""
        self.keeper.give_back_window(leaves)

    async def open_window(self, link: WindowLink, msg: dict[str, object],
                          fds: list[int]) -> None:
        """Send a task window's order (``Conversation.open_window``)."""
        await self.talk.open_window(link, msg, fds)

    def window_order(self, window_id: str, kind: str, **fields: object) -> None:
        """``window_close``, ``window_extend`` or ``window_ack`` to the template
        (``Conversation``)."""
        self.talk.window_order(window_id, kind, **fields)

    def run_order(self, request: FiberRequest) -> dict[str, object]:
        """The run order the template gets for ``request`` (a task window's task's)."""
        return self.orders.run_order(request)

    def _ask_reap(self, pid: int) -> None:
        """Ask the template process to reap fiber ``pid`` now (``TemplateProcess.ask_reap``)."""
        self.process.ask_reap(pid)

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
        self.on(Event.STOP)
        fibers = self.cgroup.fibers if self.cgroup is not None else None
        await stop_all(list(self.fibers.values()), grace,
                       functools.partial(cgroup_kill, fibers) if fibers is not None else None)
        self.keeper.dismiss()
        if self.process.sock is not None:
            with contextlib.suppress(OSError, wire.WireError):
                self.process.sock.send(wire.encode({"t": "stop"}))
        task = self.process.task
        if task is not None:
            if self.process.pidfd is None:
                task.cancel()  # asleep in its backoff: no process to stop
            elif not await first_done(task, self.clock.sleep(grace)):
                self.process.kill()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.keeper.leaves.settle()
        self.on(Event.STOPPED)

    def to_json(self) -> dict[str, object]:
        return {"uid": self.uid, "state": self.state.value, "pid": self.process.pid,
                "warm_error": self.warm_error.to_json() if self.warm_error else None,
                "restarts": self.restarts, "last_fault": self.last_fault,
                "fibers": len(self.fibers), "spares": len(self.keeper.pools[Kind.FIBER].idle),
                "cgroup": str(self.cgroup.path) if self.cgroup else None}

    def on(self, event: Event, detail: str = "", *, status: int = 0,
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
                self.keeper.refill()
            elif action is Action.DISMISS_SPARES:
                self.keeper.dismiss()
            elif action is Action.KILL_FIBERS:
                for fiber in list(self.fibers.values()):
                    fiber.note_reason("template_lost",
                                      f"its template stopped answering ({detail}) "
                                      "and was killed, and the fiber with it")
                    fiber.kill()  # they would die by their death signal; this takes groups
            elif action is Action.KILL_PROCESS:
                self.process.kill()
            elif action is Action.FIBERS_LOST:
                fault = None if self.life.stopping else self.last_fault
                for fiber in list(self.fibers.values()):
                    fiber.template_lost(fault)

    def not_ready(self) -> TemplateNotReady:
        state = TemplateState.STOPPED if self.life.stopping else self.state
        return TemplateNotReady(state, self.warm_error)
