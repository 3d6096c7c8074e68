"""Clocks for the core: the one place time is read.

Every rule about time (leases, fences, staleness, deadlines) takes a Clock,
so tests drive it with FakeClock instead of sleeping. A Clock has two
readings: ``wall()`` (Unix seconds, what token claims are written in) and
``mono()`` (seconds on the suspend-aware monotonic clock, CLOCK_BOOTTIME,
what deadlines are kept in). A wall-clock step moves ``wall()`` only, so a
deadline converted once to ``mono()`` never moves.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Protocol


class Clock(Protocol):
    """What the core reads time from. Implementations never block in wall/mono."""

    def wall(self) -> float:
        """Unix time in seconds."""
        ...

    def mono(self) -> float:
        """Seconds on a monotonic clock that keeps counting through suspend."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Suspend the calling task for ``seconds`` of this clock's time."""
        ...


class SystemClock:
    """The real clock: time.time() and CLOCK_BOOTTIME."""

    def wall(self) -> float:
        return time.time()

    def mono(self) -> float:
        return time.clock_gettime(time.CLOCK_BOOTTIME)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """A clock that moves only when a test says so.

    ``advance(d)`` moves both readings by ``d`` and wakes every sleeper whose
    time has come, in deadline order; ``step_wall(d)`` moves only the wall
    reading, as an NTP step or an admin's ``date -s`` would. Sleepers are
    woken by resolving their futures; call ``await settle()`` (or
    ``await advance_and_settle(d)``) to let the woken tasks run.
    """

    def __init__(self, wall: float = 1_800_000_000.0, mono: float = 1_000.0) -> None:
        self._wall = wall
        self._mono = mono
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def wall(self) -> float:
        return self._wall

    def mono(self) -> float:
        return self._mono

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._mono + seconds, next(self._order), fut))
        await fut

    def advance(self, seconds: float) -> None:
        """Move both readings forward by ``seconds`` and wake due sleepers."""
        if seconds < 0:
            raise ValueError("a FakeClock only moves forward; use step_wall for wall steps")
        self._wall += seconds
        self._mono += seconds
        while self._sleepers and self._sleepers[0][0] <= self._mono:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)

    def step_wall(self, seconds: float) -> None:
        """Step the wall reading alone (either direction); mono does not move."""
        self._wall += seconds

    @property
    def sleepers(self) -> int:
        """How many tasks are sleeping on this clock right now."""
        return sum(1 for _, _, fut in self._sleepers if not fut.done())

    @staticmethod
    async def settle(rounds: int = 20) -> None:
        """Yield to the event loop until woken tasks have had a chance to run."""
        for _ in range(rounds):
            await asyncio.sleep(0)

    async def advance_and_settle(self, seconds: float) -> None:
        """advance(seconds) then settle()."""
        self.advance(seconds)
        await self.settle()
