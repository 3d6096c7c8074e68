"""What a clause works with: the stage, the harness's issuer, fiberd, and bounded waits.

``Context`` gives a clause unique grant UIDs, a fiberd of its own (whose
grants are withdrawn before it stops), token delivery through the stage,
and the waits every clause shares: warm, removed, health settled, processes
gone. ``expect_miss``, ``stopped_by_signal`` and ``holds`` are the checks
clauses phrase their sentences with. Every wait is bounded by
``Context.settle`` (what a home and the core may take to act on a lever) or
by what real time must pass (a stale TTL); each failure is one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from slurm_fiber import procs
from slurm_fiber.conform.issuer import ConformIssuer
from slurm_fiber.conform.live import POLL, ClauseFailed, Live, launched, until
from slurm_fiber.conform.stage import Stage
from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.fibers.handles import FiberView


@dataclass
class Context:
    """What a clause works with: the stage, the harness's issuer and its time bounds."""

    stage: Stage
    issuer: ConformIssuer
    clause: str
    settle: float  # seconds a home and the core may take to act on a lever
    stale_ttl: float  # the configured seconds of silence before the source is stale
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _delivered: set[str] = field(default_factory=set)

    def uid(self) -> str:
        """A grant UID no other clause or run uses."""
        slug = self.clause.replace("_", "-").replace(".", "-")
        return f"cf-{self.issuer.mark[:8]}-{slug}-{next(self._ids)}"[:128]

    @contextlib.asynccontextmanager
    async def fiberd(self) -> AsyncIterator[Live]:
        """A fiberd for this clause, started from the stage's launch and stopped after.

        Before it stops, every grant the clause delivered is removed again
        (and, when the clause passed, waited for, bounded), so the next
        clause's fiberd finds none of them.
        """
        async with launched(self.stage.launch()) as live:
            try:
                yield live
            except BaseException:
                await self._withdraw(live, wait=False)  # fiberd's stop ends the rest
                raise
            await self._withdraw(live, wait=True)

    async def grant(self, live: Live, uid: str, *, ttl: float = 3600.0,
                    devices: tuple[str, ...] = ()) -> str:
        """Mint a token for ``uid`` and have the control plane deliver it; returns it."""
        token = self.issuer.token(uid, live.audience, ttl=ttl, devices=devices)
        self._delivered.add(uid)
        await self.stage.deliver(uid, token)
        return token

    async def _withdraw(self, live: Live, *, wait: bool) -> None:
        """Remove the clause's grants; with ``wait``, until fiberd carried it out (bounded).

        It waits for the grants' processes to be gone too: fiberd stopped
        while a removal is still stopping a template can leave that template
        running (a core issue, not the home's).
        """
        for uid in sorted(self._delivered):
            await self.stage.remove(uid)
        if not wait:
            return

        def withdrawn() -> bool:
            return all(live.held(uid) is None for uid in self._delivered) and \
                not procs.marked(self.issuer.mark)

        with contextlib.suppress(ClauseFailed):
            await until(withdrawn, self.settle, "grants withdrawn after the clause")

    async def processes_gone(self, why: str) -> None:
        """Wait until no template or fiber of this run is left, after ``why``."""
        await until(lambda: not procs.marked(self.issuer.mark), self.settle,
                    f"template and fibers gone after {why}")

    async def warm(self, live: Live, uid: str) -> None:
        """Wait until fiberd holds ``uid`` with a ready template."""
        await until(lambda: live.template_state(uid) == "ready", self.settle,
                    f"delivered grant {uid} warm in fiberd")

    async def removed(self, live: Live, uid: str) -> None:
        """Wait until fiberd no longer holds ``uid``."""
        await until(lambda: live.held(uid) is None, self.settle,
                    f"removed grant {uid} gone from fiberd")

    async def settled_health(self, live: Live, fresh: bool) -> None:
        """Wait until the source health reads fresh (or, with ``fresh`` False, not fresh)."""
        bound = self.settle + (0.0 if fresh else self.stale_ttl)
        want = "fresh" if fresh else "stale"
        await until(lambda: (live.core.health()["state"] == "fresh") == fresh, bound,
                    f"source health {want}")


def expect_miss(outcome: FiberView | Miss, code: MissCode, when: str) -> Miss:
    """The miss ``outcome`` is, when it is ``code``; ClauseFailed otherwise."""
    if isinstance(outcome, Miss) and outcome.code is code:
        return outcome
    seen = f"{outcome.code}: {outcome.reason}" if isinstance(outcome, Miss) else \
        f"a fiber ({outcome.id})"
    raise ClauseFailed(f"{when}: expected miss {code}, got {seen}")


async def stopped_by_signal(ctx: Context, fiber: FiberView, why: str) -> None:
    """Wait (bounded) for ``fiber`` to end, and fail unless fiberd killed it."""
    try:
        async with asyncio.timeout(ctx.settle):
            end = await fiber.wait()
    except TimeoutError:
        raise ClauseFailed(f"fiber {fiber.id} still running {ctx.settle:g} s after {why}") \
            from None
    if end.signal is None:
        raise ClauseFailed(f"fiber {fiber.id} was not stopped after {why}: {end.to_json()}")


async def holds(predicate: Callable[[], bool], during: float, what: str) -> None:
    """Check ``predicate`` stays true for ``during`` seconds (polled); ClauseFailed if not."""
    end = time.monotonic() + during
    while time.monotonic() < end:
        if not predicate():
            raise ClauseFailed(f"{what}: broke after "
                               f"{during - (end - time.monotonic()):.2f} s")
        await asyncio.sleep(POLL)
