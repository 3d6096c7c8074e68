"""A fiber's order: what fiberd asks a template for (``FiberRequest``) and how it is handed over.

``Orders.fork`` starts one fiber and returns it running: an exec request is spawned
straight into a leaf when the keeper says so (templates/child/exec_spawn.py: the
program starts from no copy of the template), else a call or exec is handed to an idle
spare, else to one made now. A spare that died unseen is replaced once. The order
carries the request's env without device visibility variables (a fiber cannot widen
its devices) and says which of stdin, stdout, stderr ride along; a fiber of another
account (a root fiberd's ``fiber_user``) gets its output files opened by fiberd, in
fiberd's state dir. ``become`` makes the spare that took an order the running ``Fiber``
whose end gives its leaf back. Raises ``TemplateNotReady`` unless the template is
ready, ``ForkFailed`` when it cannot fork, ValueError for a malformed request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from slurm_fiber.core.devices import ALL_VISIBILITY_VARS
from slurm_fiber.core.fibers.fiber import Fiber
from slurm_fiber.core.templates.conversation import send
from slurm_fiber.core.templates.faults import ForkFailed, NoAnswer, SpareGone, SpawnRefused
from slurm_fiber.core.templates.spares import Kind, Spare, SparePool

if TYPE_CHECKING:
    from slurm_fiber.core.templates.parent import Template


_FIBER_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


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


@dataclass
class Spawn:
    """An exec fiber asked of the template (``request``), and the fiber once started."""

    request: FiberRequest
    fiber: Fiber | None = None


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class Orders:
    """A template's fiber orders and their hand-over (see the module doc)."""

    def __init__(self, template: Template) -> None:
        self.t = template
        self._out_dir = template.state_dir / "fibers"  # fibers' output files, when not passed
        self._out_text = str(self._out_dir)
        self.spawning: dict[str, Spawn] = {}  # by spare id, until its Clone has it

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
        keeper = self.t.keeper
        keeper.last_fork = self.t.clock.mono()
        keeper.pools[Kind.FIBER].target = self.t.spares  # a first fiber: keep spares from now on
        if request.mode == "exec" and keeper.spawns():
            with contextlib.suppress(SpawnRefused):  # a spare's fork then says why
                fiber = await self.spawn_exec(request)
                keeper.refill()
                return fiber
        gone = ""
        for _ in range(2):  # an idle spare may have died unseen: then one made now
            if not self.t.life.ready or self.t.process.sock is None:
                raise self.t.not_ready()
            if request.id in self.t.fibers:
                raise ForkFailed(f"fiber id {request.id} is in use")
            try:
                # Not another idle one: the spares may have died with the template, unseen
                # yet; asking the template tells (not ready) instead of failing the Clone.
                spare = await keeper.take(keeper.pools[Kind.FIBER], idle=not gone)
            except NoAnswer:
                raise self.t.not_ready() from None
            keeper.refill_unless_idle(keeper.pools[Kind.FIBER])
            try:
                return await self._hand_over(spare, request)
            except SpareGone as err:
                gone = str(err)
        if not self.t.life.ready:
            raise self.t.not_ready()
        raise ForkFailed(gone)

    async def spawn_exec(self, request: FiberRequest) -> Fiber:
        """Have the template start exec ``request``'s program straight into a leaf
        (core/exec_spawn.py); the fiber, running. Raises as ``fork``, and SpawnRefused
        when the program cannot start so (its leaf is given back)."""
        if not self.t.life.ready or self.t.process.sock is None:
            raise self.t.not_ready()
        if request.id in self.t.fibers or any(
                s.request.id == request.id for s in self.spawning.values()):
            raise ForkFailed(f"fiber id {request.id} is in use")
        pool = self.t.keeper.pools[Kind.SPAWN]
        order, fds, opened = self.order_fds(request)
        try:
            spare = await self.t.keeper.ask(pool, None, {"order": order}, fds)
        except NoAnswer:
            raise self.t.not_ready() from None
        finally:
            close_all(opened)
        spawn = self.spawning[spare.id] = Spawn(request)
        try:
            await asyncio.shield(spare.spared)
        except NoAnswer:
            raise self.t.not_ready() from None
        except asyncio.CancelledError:
            # Nobody will hear of the fiber: once started, it is killed at once.
            spare.spared.add_done_callback(lambda f: self.t.talk.unwanted(f, spare.id))
            raise
        finally:
            self.spawning.pop(spare.id, None)
        assert spawn.fiber is not None
        return spawn.fiber  # perhaps ended already: a fast program's exit came with it

    async def _hand_over(self, spare: Spare, request: FiberRequest) -> Fiber:
        """Send ``spare`` its order; the fiber it becomes (its result comes back on the
        same channel). Raises SpareGone if it died."""
        pool = self.t.keeper.pools[spare.kind]
        order, fds, opened = self.order_fds(request)
        try:
            await send(spare.orders, order, fds, "the spare fiber process", self.t.clock,
                        self.t.timeout)
        except BaseException as err:
            self.t.keeper.bury(pool, spare)
            if isinstance(err, ForkFailed):
                raise SpareGone(str(err)) from None
            raise
        finally:
            close_all(opened)
        return self.become(pool, spare, request)

    def become(self, pool: SparePool, spare: Spare, request: FiberRequest) -> Fiber:
        """Make ``spare``, handed ``request`` and its pid known, the running fiber it is
        now (in ``fibers``; its exit report reaches it by spare id)."""
        fiber = Fiber(
            id=request.id, pid=spare.pid, uid=self.t.uid, jti=request.jti,
            epoch=request.epoch, deadline=request.deadline, started=self.t.clock.mono(),
            mode=request.mode, cgroup=spare.cgroup, clock=self.t.clock,
            stdout_path=self.out_file(request, ".out") if request.stdio[1] is None else None,
            stderr_path=self.out_file(request, ".err") if request.stdio[2] is None else None,
            report_timeout=self.t.timeout, parent=self.t.process.pid, late=self.t.late)
        fiber.attach(spare.orders, spare.pidfd)
        self.t.fibers[request.id] = fiber
        pool.use(spare, fiber)

        def gone(f: Fiber) -> None:
            self.t.fibers.pop(f.id, None)
            pool.used(spare.id)
            if f.cgroup is not None:
                end = f.exit
                self.t.keeper.give_back(f.cgroup, end.memory_peak if end else None,
                                end.oom_kills if end else None)
            self.t.keeper.refill()  # its replacement, if it waited (``_refill_unless_idle``)

        fiber.on_done(gone)
        return fiber

    def out_file(self, request: FiberRequest, suffix: str) -> Path:
        """Where the fiber's stdout (``.out``) or stderr (``.err``) goes when not passed."""
        return self._out_dir / f"fiber-{request.id}{suffix}"

    @property
    def other_account(self) -> bool:
        """Whether the template runs as an account other than fiberd's (fiber_user)."""
        return self.t.identity is not None and self.t.identity.uid != os.geteuid()

    def order_fds(self, request: FiberRequest) -> tuple[dict[str, object], list[int],
                                                         list[int]]:
        """The run order for ``request``, the fds that go with it, and those of them fiberd
        opened here (the caller closes them once sent). A fiber of another account
        (fiber_user) cannot reach fiberd's state dir: fiberd opens its output files itself
        and passes them, so the files are where they always are, and fiberd's."""
        stdio = list(request.stdio)
        opened: list[int] = []
        if self.other_account:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                for target, suffix in ((1, ".out"), (2, ".err")):
                    if stdio[target] is None:
                        fd = os.open(self.out_file(request, suffix), flags, 0o600)
                        opened.append(fd)
                        stdio[target] = fd
            except OSError as err:
                close_all(opened)
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
