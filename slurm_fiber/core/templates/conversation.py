"""The wire conversation with a template process: what it says, and sending it orders in time.

``send`` puts one message, with its file descriptors, on a non-blocking SEQPACKET socket,
waiting for buffer room without blocking the loop and at most ``timeout`` seconds on the
clock: a peer gone or taking nothing in that time is ``ForkFailed`` naming it.
``Conversation.dispatch`` acts on each message from the template (templates/wire.py
frames them): ready and a failed warm go to the lifecycle, a spare made or refused to
its pool, a spawned exec fiber to the Clone waiting for it (or is killed when nobody
waits), a fiber's exit to that fiber, a task window's report to its link; every file
descriptor that rides along is used or closed. A template given up on (re-warming) is
heard only for its fibers' exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from typing import TYPE_CHECKING

from slurm_fiber.core.clock import Clock
from slurm_fiber.core.templates import wire
from slurm_fiber.core.templates.faults import ForkFailed, SpawnRefused
from slurm_fiber.core.templates.lifecycle import Event, Phase, WarmError
from slurm_fiber.core.templates.spares import Kind, Spare, SparePool
from slurm_fiber.core.waiting import first_done, pidfd_exited, set_done

if TYPE_CHECKING:
    from slurm_fiber.core.templates.parent import Template
    from slurm_fiber.core.templates.window_parent import WindowLink


async def send(sock: socket.socket | None, msg: dict[str, object], fds: list[int],
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


class Conversation:
    """Acts on what one template process says (see the module doc)."""

    def __init__(self, template: Template) -> None:
        self.t = template

    def dispatch(self, msg: dict[str, object], fds: list[int]) -> None:
        """Act on one message from the template; its ``fds`` are taken (used or closed)."""
        kind = msg["t"]
        if kind == "window_report":
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            link = self.t.windows.get(str(msg.get("id")))
            if link is not None:
                link.reported(msg)
                if link.finished:
                    del self.t.windows[link.id]
            return
        spawn = self.t.keeper.pools[Kind.SPAWN]
        spare = spawn.answered(str(msg.get("id"))) if kind in ("spawned", "spawn_failed") \
            else None
        if spare is not None and self.t.life.phase is not Phase.REWARMING:
            self._spawned(spawn, spare, msg, fds)
            return
        for fd in fds:
            if kind == "spawned":  # nobody waits for it (given up on, stopping): kill it
                kill_by_pidfd(fd, msg.get("pid"))
            os.close(fd)
        if self.t.life.phase is Phase.REWARMING and kind != "exit":
            return  # given up on: only its fibers' exits still count
        if kind == "ready":
            self.t.on(Event.READY)
        elif kind == "warm_failed":
            self.t.on(Event.WARM_FAILED, warm_error=WarmError(str(msg.get("error")),
                                                             str(msg.get("message"))))
        elif kind in ("spared", "fork_failed"):
            for pool in self.t.keeper.pools.values():
                spare = pool.answered(str(msg.get("id")))
                if spare is not None:
                    self._spared(pool, spare, msg)
        elif kind == "exit":
            spare_id = str(msg.get("id"))
            for pool in self.t.keeper.pools.values():
                if (fiber := pool.fiber(spare_id)) is not None:
                    fiber.reported_exit(msg)
                    return
            for pool in self.t.keeper.pools.values():
                if (idle := pool.idle_one(spare_id)) is not None:
                    self.t.keeper.bury(pool, idle)  # it died idle (killed, or its set-up failed)

    def _spawned(self, pool: SparePool, spare: Spare, msg: dict[str, object],
                 fds: list[int]) -> None:
        """The template's answer to a spawn: the fiber, made here and now (its exit may
        be the next message), or the refusal (its leaf back to the pool)."""
        spawn = self.t.orders.spawning.get(spare.id)
        if msg["t"] == "spawn_failed" or len(fds) != 1 or spawn is None:
            for fd in fds:
                os.close(fd)
            if spare.cgroup is not None:
                self.t.keeper.give_back(spare.cgroup, None, None)
            spare.spared.set_exception(SpawnRefused(str(msg.get("message"))))
            return
        spare.pid, spare.pidfd = int(str(msg.get("pid"))), fds[0]
        self.t.keeper.moved_at = self.t.clock.mono()
        spawn.fiber = self.t.orders.become(pool, spare, spawn.request)
        spare.spared.set_result(spare.pid)

    async def open_window(self, link: WindowLink, msg: dict[str, object],
                          fds: list[int]) -> None:
        """Send a task window's order (core/templates/child/window_run.py); its reports
        go to ``link``. Raises TemplateNotReady."""
        t = self.t
        if not t.life.ready or t.process.sock is None:
            raise t.not_ready()
        t.windows[link.id] = link
        try:
            await send(t.process.sock, msg, fds, "the template", t.clock, t.timeout)
        except ForkFailed:
            t.windows.pop(link.id, None)
            raise t.not_ready() from None
        t.keeper.moved_at = t.clock.mono()

    def window_order(self, window_id: str, kind: str, **fields: object) -> None:
        """``window_close``, ``window_extend`` (``left``) or ``window_ack`` to the template;
        best effort: fiberd's kill through the leaves does not depend on it."""
        sock = self.t.process.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.send(wire.encode({"t": kind, "id": window_id, **fields}))

    def unwanted(self, answer: asyncio.Future[int], spare_id: str) -> None:
        """The ``answer`` to a spawn whose Clone was cancelled: kill the fiber it started."""
        if answer.cancelled() or answer.exception() is not None:
            return
        fiber = self.t.keeper.pools[Kind.SPAWN].fiber(spare_id)
        if fiber is not None:
            fiber.note_reason("cancelled", "its Clone was cancelled while it started")
            fiber.kill()

    def _spared(self, pool: SparePool, spare: Spare, msg: dict[str, object]) -> None:
        if msg["t"] == "fork_failed":
            spare.spared.set_exception(ForkFailed(f"fork failed: {msg.get('message')}"))
            self.t.keeper.bury(pool, spare)
            return
        pid = int(str(msg.get("pid")))
        try:
            spare.pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.t.keeper.bury(pool, spare)
            return
        spare.pid = pid
        self.t.keeper.moved_at = self.t.clock.mono()  # it joins its leaf now
        spare.spared.set_result(pid)


def kill_by_pidfd(pidfd: int, pid: object) -> None:
    """SIGKILL the process ``pidfd`` names and the process group it leads (``pid``, while
    it is unreaped). Never raises."""
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    if isinstance(pid, int) and not pidfd_exited(pidfd):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
