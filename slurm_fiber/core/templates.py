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
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
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

from slurm_fiber.core import template_wire as wire
from slurm_fiber.core.cgroups import GrantCgroup, safe_name
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.devices import ALL_VISIBILITY_VARS, DeviceChannel
from slurm_fiber.core.fibers import Fiber, FiberExit, stop_all
from slurm_fiber.core.grant import TemplateSpec
from slurm_fiber.core.waiting import first_done, pidfd_wait

_FIBER_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


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
            if not self.target or ":" not in self.target:
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


def template_env(base: Mapping[str, str], spec: TemplateSpec,
                 channel: DeviceChannel) -> dict[str, str]:
    """The environment a template starts with: ``base``, the grant's env, then the
    channel's visibility variables, which always win (a grant cannot widen its devices)."""
    return {**base, **spec.env, **channel.env()}


@dataclass
class _Pending:
    future: asyncio.Future[Fiber]
    request: FiberRequest
    cgroup: Path | None
    result_sock: socket.socket


class Template:
    """One grant's warm template process and the fibers forked from it.

    Build with ``await Template.start(...)``. Read ``state``, ``warm_error``,
    ``pid``, ``fibers`` (id → running Fiber), ``restarts``. Not thread-safe.
    """

    def __init__(self, uid: str, spec: TemplateSpec, env: Mapping[str, str],
                 cgroup: GrantCgroup | None, *, state_dir: Path, clock: Clock,
                 python: str = sys.executable, backoff: Backoff | None = None) -> None:
        self.uid = uid
        self.spec = spec
        self.env = dict(env)
        self.cgroup = cgroup
        self.state_dir = state_dir
        self.clock = clock
        self.python = python
        self.backoff = backoff or Backoff()
        self.state = TemplateState.WARMING
        self.warm_error: WarmError | None = None
        self.pid: int | None = None
        self.restarts = 0
        self.fibers: dict[str, Fiber] = {}
        self._pending: dict[str, _Pending] = {}
        self._changed = asyncio.Event()
        self._sock: socket.socket | None = None
        self._pidfd: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @classmethod
    async def start(cls, uid: str, spec: TemplateSpec, env: Mapping[str, str],
                    cgroup: GrantCgroup | None = None, *, state_dir: Path, clock: Clock,
                    python: str = sys.executable,
                    backoff: Backoff | None = None) -> Template:
        """Spawn the template and return at once, ``warming``. Raises OSError if the
        process cannot be started (e.g. ``state_dir`` not writable)."""
        template = cls(uid, spec, env, cgroup, state_dir=state_dir, clock=clock,
                       python=python, backoff=backoff)
        (state_dir / "fibers").mkdir(parents=True, exist_ok=True)
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
        """Fork one fiber and return it running (its pid known, its pidfd open).

        Raises TemplateNotReady unless ``ready``, ValueError for a malformed
        request, ForkFailed when the template cannot fork or the fiber's
        cgroup cannot be made.
        """
        request.check()
        if self.state is not TemplateState.READY or self._sock is None:
            raise TemplateNotReady(self.state, self.warm_error)
        if request.id in self.fibers or request.id in self._pending:
            raise ForkFailed(f"fiber id {request.id} is in use")
        cgroup = self.cgroup.fiber(request.id) if self.cgroup else None
        if cgroup is not None:
            try:
                cgroup.mkdir()
            except OSError as e:
                raise ForkFailed(f"cannot create cgroup {cgroup}: {e.strerror}") from None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pending = _Pending(asyncio.get_running_loop().create_future(), request, cgroup, ours)
        self._pending[request.id] = pending
        try:
            await self._send(self._fork_message(request, cgroup),
                             [theirs.fileno(), *(fd for fd in request.stdio if fd is not None)])
            return await pending.future
        except BaseException:
            self._pending.pop(request.id, None)
            adopted = (pending.future.done() and not pending.future.cancelled()
                       and pending.future.exception() is None)
            if not adopted:  # (an adopted fiber runs on, in self.fibers, and owns both)
                ours.close()
                if cgroup is not None:
                    with contextlib.suppress(OSError):
                        cgroup.rmdir()
            raise
        finally:
            theirs.close()

    async def stop_fibers(self, grace: float, *,
                          before_epoch: int | None = None) -> list[FiberExit]:
        """Stop running fibers (all, or those of an epoch older than ``before_epoch``);
        returns once they are gone."""
        chosen = [f for f in self.fibers.values()
                  if before_epoch is None or f.epoch < before_epoch]
        return await stop_all(chosen, grace)

    async def stop(self, grace: float) -> None:
        """Stop every fiber (SIGTERM, grace, SIGKILL), then the template; returns once
        all are gone. The template is ``stopped`` for good (no re-warm)."""
        self._stopping = True
        await self.stop_fibers(grace)
        if self._sock is not None:
            with contextlib.suppress(OSError, wire.WireError):
                self._sock.send(wire.encode({"t": "stop"}))
        task = self._task
        if task is not None:
            if self.state is TemplateState.REWARMING:
                task.cancel()  # asleep in its backoff: no process to stop
            elif not await first_done(task, self.clock.sleep(grace)) and self._pidfd is not None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._set_state(TemplateState.STOPPED)

    def to_json(self) -> dict[str, object]:
        return {"uid": self.uid, "state": self.state.value, "pid": self.pid,
                "warm_error": self.warm_error.to_json() if self.warm_error else None,
                "restarts": self.restarts, "fibers": len(self.fibers),
                "cgroup": str(self.cgroup.path) if self.cgroup else None}

    # ------------------------------------------------------------ process

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log_path = self.state_dir / f"template-{safe_name(self.uid)}.log"
        with theirs, open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [self.python, "-m", "slurm_fiber.core.template_main",
                 "--fd", str(theirs.fileno()), "--parent", str(os.getpid())],
                env=self.env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                stdout=log, stderr=log, cwd=self.state_dir)
        ours.setblocking(False)
        self._sock = ours
        self._pidfd = os.pidfd_open(proc.pid)
        self.pid = proc.pid
        order = {"t": "warm", "preload": list(self.spec.preload), "warm": self.spec.warm,
                 "cgroup": str(self.cgroup.template) if self.cgroup else None}
        ours.send(wire.encode(order))
        self._set_state(TemplateState.WARMING)
        self._task = asyncio.ensure_future(self._watch(ours, proc, self._pidfd))

    async def _watch(self, sock: socket.socket, proc: subprocess.Popen[bytes],
                     pidfd: int) -> None:
        """Serve one template process's messages until it dies, then account and re-warm."""
        loop = asyncio.get_running_loop()
        try:
            while data := await loop.sock_recv(sock, wire.MAX_MESSAGE + 1):
                with contextlib.suppress(wire.WireError):
                    self._dispatch(wire.decode(data))
        except ConnectionError:
            pass
        await pidfd_wait(pidfd)
        status = proc.wait()
        os.close(pidfd)
        sock.close()
        self._sock = self._pidfd = None
        self._template_gone(status)
        if self.state is TemplateState.REWARMING:
            await self.clock.sleep(self.backoff.next())
            if not self._stopping:
                self.restarts += 1
                self._spawn()

    def _template_gone(self, status: int) -> None:
        for pending in list(self._pending.values()):
            pending.future.set_exception(ForkFailed("the template died during the fork"))
        for fiber in list(self.fibers.values()):
            fiber.template_lost()
        if self._stopping:
            self._set_state(TemplateState.STOPPED)
        elif self.state is TemplateState.WARMING:
            self.warm_error = WarmError("TemplateDied",
                                        f"the template exited ({status}) before it was warm")
            self._set_state(TemplateState.WARM_FAILED)
        elif self.state is TemplateState.READY:
            self._set_state(TemplateState.REWARMING)

    def _dispatch(self, msg: dict[str, object]) -> None:
        kind = msg["t"]
        if kind == "ready":
            self.backoff.reset()
            self._set_state(TemplateState.READY)
        elif kind == "warm_failed":
            self.warm_error = WarmError(str(msg.get("error")), str(msg.get("message")))
            self._set_state(TemplateState.WARM_FAILED)
        elif kind in ("forked", "fork_failed"):
            pending = self._pending.pop(str(msg.get("id")), None)
            if pending is None:
                return
            if kind == "fork_failed":
                pending.future.set_exception(ForkFailed(f"fork failed: {msg.get('message')}"))
            else:
                pending.future.set_result(self._adopt(pending, int(str(msg.get("pid")))))
        elif kind == "exit":
            fiber = self.fibers.get(str(msg.get("id")))
            if fiber is not None:
                fiber.reported_exit(msg)

    def _adopt(self, pending: _Pending, pid: int) -> Fiber:
        request = pending.request
        out = self._out_path(request)
        fiber = Fiber(
            id=request.id, pid=pid, uid=self.uid, jti=request.jti, epoch=request.epoch,
            deadline=request.deadline, started=self.clock.mono(), mode=request.mode,
            cgroup=pending.cgroup, clock=self.clock,
            stdout_path=out.with_suffix(".out") if request.stdio[1] is None else None,
            stderr_path=out.with_suffix(".err") if request.stdio[2] is None else None)
        fiber.attach(pending.result_sock)
        self.fibers[request.id] = fiber
        fiber.on_done(lambda f: self.fibers.pop(f.id, None))
        return fiber

    def _out_path(self, request: FiberRequest) -> Path:
        return self.state_dir / "fibers" / f"fiber-{request.id}"

    def _fork_message(self, request: FiberRequest, cgroup: Path | None) -> dict[str, object]:
        env = {k: v for k, v in request.env.items() if k not in ALL_VISIBILITY_VARS}
        return {"t": "fork", "id": request.id, "mode": request.mode, "target": request.target,
                "args": list(request.args), "kwargs": dict(request.kwargs),
                "argv": list(request.argv), "env": env, "cwd": request.cwd,
                "stdio": [fd is not None for fd in request.stdio],
                "out_dir": str(self.state_dir / "fibers"),
                "cgroup": str(cgroup) if cgroup else None}

    async def _send(self, msg: dict[str, object], fds: list[int]) -> None:
        """Send one message with fds, waiting for buffer room without blocking the loop."""
        data = wire.encode(msg)
        loop = asyncio.get_running_loop()
        while True:
            sock = self._sock
            if sock is None:
                raise ForkFailed("the template is gone")
            try:
                socket.send_fds(sock, [data], fds)
                return
            except BlockingIOError:
                room: asyncio.Future[None] = loop.create_future()
                loop.add_writer(sock.fileno(), lambda f=room: f.done() or f.set_result(None))
                try:
                    await room
                finally:
                    loop.remove_writer(sock.fileno())
            except OSError as e:
                raise ForkFailed(f"cannot reach the template: {e.strerror}") from None

    def _set_state(self, state: TemplateState) -> None:
        self.state = state
        self._changed.set()
        self._changed = asyncio.Event()
