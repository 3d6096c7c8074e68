"""A template's spares: fiber processes forked ahead of need, each waiting in its own leaf.

A ready template keeps ``spares`` spare processes: each already sits in its own cgroup
leaf (``slot-<n>`` under the grant's ``fibers`` cgroup), tied to the template by its
death signal, waiting on an order channel whose other end fiberd holds, so a Clone
neither forks nor moves a process into a cgroup. ``SpareKeeper`` asks the template for
spares (``ask``, answered within ``timeout`` or the template is given up on), keeps the
idle ones, refills in the background (a spare's replacement waits for the fiber's end
while another spare is idle, so the template's fork does not hold that exit up),
dismisses them all when the grant was not cloned for ``spares_idle`` (``shed_idle``)
and kills the unused ones with their leaves (``bury``). An ended fiber's empty leaf is
kept for a later spare or removed (``give_back``; cgroups/leaves.py). Spares run no user
code and do not count toward ``fibers``; the bookkeeping is templates/spares.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_fiber.core.cgroups.groups import empty as cgroup_empty
from slurm_fiber.core.cgroups.leaves import LeafCreateFailed, LeafPool
from slurm_fiber.core.cgroups.v1 import mirrors as cgroup_mirrors
from slurm_fiber.core.templates.conversation import send
from slurm_fiber.core.templates.faults import ForkFailed, NoAnswer
from slurm_fiber.core.templates.lifecycle import Event
from slurm_fiber.core.templates.spares import Kind, Spare, SparePool
from slurm_fiber.core.waiting import pidfd_wait

if TYPE_CHECKING:
    from slurm_fiber.core.templates.parent import Template

log = logging.getLogger("slurm_fiber.core.templates.parent")


SPAWN_HOT = 0.02  # seconds after a cgroup move of ours in which another is cheap (``spawns``)


class SpareKeeper:
    """One template's spares and their leaves (see the module doc)."""

    def __init__(self, template: Template, spares_once_cloned: bool) -> None:
        self.t = template
        self.last_fork: float | None = None  # clock mono of the last fork asked
        self._spare_ids = itertools.count(1)  # never reset: a leaf may outlive its process
        self.moved_at: float | None = None  # clock mono of our last cgroup move (spawn, spare)
        # With ``spares_once_cloned``, spares are kept once the grant has run a fiber (a
        # grant never cloned holds its template only). Spawns are asked one per exec fiber,
        # never ahead: their pool only tracks them (target 0).
        spares = template.spares
        self.pools = {Kind.FIBER: SparePool(Kind.FIBER, 0 if spares_once_cloned else spares),
                      Kind.SPAWN: SparePool(Kind.SPAWN, 0)}
        self.leaves = LeafPool(template.cgroup)
        self.window_leaves_held = 0  # leaves task windows hold: kept free for the next window

    async def take(self, pool: SparePool, *, idle: bool = True) -> Spare:
        """An idle spare of ``pool`` (when ``idle``), else a new one once the template has
        made it."""
        kept = pool.take() if idle else None
        if kept is not None:
            return kept
        spare = await self.ask_spare(pool)
        try:
            await asyncio.shield(spare.spared)
        except asyncio.CancelledError:
            # The Clone was cancelled: the spare, when it comes, waits for the next one.
            spare.spared.add_done_callback(lambda _: self.keep_idle(pool, spare))
            raise
        return spare

    async def ask_spare(self, pool: SparePool) -> Spare:
        """Ask the template for one more spare of ``pool``'s kind (its ``spared`` future
        tells when it is made; the template has ``timeout`` to answer, see ``_guard``).
        Raises ForkFailed when its cgroup leaf fails, NoAnswer when the template cannot
        take the request (it is then given up on)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            ours.setblocking(False)
            try:
                return await self.ask(pool, ours, {}, [theirs.fileno()])
            except BaseException:
                ours.close()
                raise

    async def ask(self, pool: SparePool, orders: socket.socket | None,
                   extra: dict[str, object], fds: list[int]) -> Spare:
        """Take a leaf and send the template ``pool``'s request for it (``extra`` fields
        added, ``fds`` riding along); the spare it is about, asked. Raises ForkFailed when
        the leaf fails, NoAnswer when the template cannot take the request (it is then
        given up on)."""
        spare_id = str(next(self._spare_ids))
        try:
            leaf = await self.leaves.take(spare_id)
        except LeafCreateFailed as err:
            raise ForkFailed(str(err), err.errno) from None
        spare = Spare(spare_id, pool.kind, leaf, orders,
                      asyncio.get_running_loop().create_future(), asked=self.t.clock.mono())
        pool.asked(spare)
        try:
            await send(self.t.process.sock, {"t": pool.kind.value, "id": spare_id,
                                     "cgroup": str(leaf) if leaf else None,
                                     "also": [str(m) for m in cgroup_mirrors(leaf)]
                                     if leaf else [], **extra},
                        fds, "the template", self.t.clock, self.t.timeout)
        except BaseException as err:
            self.bury(pool, spare)
            if isinstance(err, ForkFailed):
                self.t.on(Event.STALLED, str(err))
                raise NoAnswer(str(err)) from None
            raise
        return spare

    def spawns(self) -> bool:
        """Whether an exec Clone now is spawned rather than handed an idle spare."""
        if self.t.exec_spawn != "hot":
            return self.t.exec_spawn == "always"
        moved = self.moved_at
        return (moved is not None and self.t.clock.mono() - moved < SPAWN_HOT) \
            or not self.pools[Kind.FIBER].has_idle()

    def give_back(self, leaf: Path, peak: int | None, oom_kills: int | None) -> None:
        """An ended fiber's empty leaf: kept for a later spare or spawn, or removed. As many
        are kept as spares are wanted, plus one per spawned fiber still running: a map of
        exec fibers finds its next leaf free, rather than making one and removing one
        per task."""
        wanted = sum(p.target for p in self.pools.values()) + self.pools[Kind.SPAWN].running() \
            + self.window_leaves_held
        self.leaves.give_back(leaf, peak, oom_kills, keep=self.t.life.ready,
                               limit=max(wanted, 1))

    async def window_leaves(self, window_id: str, count: int) -> list[Path | None]:
        """``count`` free leaves for a task window (None each when uncarved). Raises
        LeafCreateFailed (those taken are given back)."""
        leaves: list[Path | None] = []
        try:
            for n in range(count):
                leaves.append(await self.leaves.take(f"{window_id}-{n}"))
        except LeafCreateFailed:
            self.give_back_window(leaves)
            raise
        self.window_leaves_held += count
        return leaves

    def give_back_window(self, leaves: list[Path | None]) -> None:
        """A window's leaves, empty now (killed, or all its tasks ended): kept for the next
        window (as many as windows take at most) rather than removed and made again. Their
        memory figures are not renewed (the window path reads no peak)."""
        for leaf in leaves:
            if leaf is not None:
                self.give_back(leaf, None, None)
        self.window_leaves_held = max(0, self.window_leaves_held - len(leaves))

    def refill(self) -> None:
        """Make spares in the background until each pool's target is idle or being made."""
        for pool in self.pools.values():
            if (pool.filling is None or pool.filling.done()) and self._short(pool):
                pool.filling = asyncio.ensure_future(self._fill(pool))

    def refill_unless_idle(self, pool: SparePool) -> None:
        """After a Clone took a spare of ``pool`` (forked from the template): refill now
        when none is left idle, else when that fiber ends (``_hand_over``), so the
        template's fork does not hold up the fiber's exit."""
        if not pool.has_idle():
            self.refill()

    def _short(self, pool: SparePool) -> bool:
        return self.t.life.ready and pool.short()

    async def _fill(self, pool: SparePool) -> None:
        while self._short(pool):
            try:
                spare = await self.ask_spare(pool)
                await asyncio.shield(spare.spared)
            except NoAnswer:
                return  # the template is gone or given up on: no spares until re-warmed
            except ForkFailed as err:
                log.warning("template %s: no spare made: %s", self.t.uid, err)
                return
            self.keep_idle(pool, spare)

    def keep_idle(self, pool: SparePool, spare: Spare) -> None:
        """A spared spare nobody took: keep it for the next Clone (or bury it)."""
        if spare.spared.cancelled() or spare.spared.exception() is not None:
            return
        if self.t.life.ready:
            pool.keep(spare)
        else:
            self.bury(pool, spare)

    def shed_idle(self) -> bool:
        """When no fork was asked for ``spares_idle`` clock seconds, dismiss the spares
        (idle or being made) and keep none until the next fork, which forks on the spot
        and restores them; whether it did now. Called by the core's upkeep."""
        pools = self.pools.values()
        if (self.t.spares_idle is None or self.last_fork is None
                or self.t.clock.mono() - self.last_fork < self.t.spares_idle
                or not any(p.target for p in pools)):
            return False
        for pool in pools:
            pool.target = 0
        self.dismiss()
        return True

    def dismiss(self) -> None:
        """Bury every spare not yet handed an order (idle or being made); remove the free
        leaves."""
        for pool in self.pools.values():
            if pool.filling is not None:
                pool.filling.cancel()
            for spare in pool.dismiss():
                self.bury(pool, spare)
        self.leaves.clear()

    def bury(self, pool: SparePool, spare: Spare) -> None:
        """Kill an unused spare and remove its leaf, in the background (``stop`` waits)."""
        pool.drop(spare)
        if spare.orders is not None:
            spare.orders.close()
        if not spare.spared.done():
            spare.spared.set_exception(NoAnswer("the template is gone"))
        if not spare.spared.cancelled():
            spare.spared.exception()  # retrieved: nobody may be waiting for it
        self.leaves.track(asyncio.ensure_future(kill_spare(spare, self.leaves)))

    @property
    def idle_spares(self) -> list[int]:
        """Pids of the (fiber) spares waiting for an order now."""
        return [s.spared.result() for s in self.pools[Kind.FIBER].idle]


async def kill_spare(spare: Spare, leaves: LeafPool) -> None:
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
