"""What thousands of fibers ending at once share, so a mass stop costs fiberd little per fiber.

A fiber's end (core/fibers/fiber.py) waits for its template's exit report and,
carved, reads its cgroup and tidies its output files. In a mass stop (grant
removal, shutdown: thousands of fibers killed by one ``cgroup.kill``) that work
is shared:

- a fiber waits for its report or its exit with ``waiting.pidfd_wait``'s
  one future and loop reader, no task;
- ``LateReports`` keeps the waits of fibers whose exit came before their
  report on one heap, with one task sleeping on the injected clock until the
  earliest timeout (only while any wait);
- ``end_reading`` reads a carved fiber's cgroup and tidies its output files
  with raw reads, emptying the cgroup first only when something still runs there;
- ``survivors_frozen`` keeps the cyclic garbage collector off the objects alive
  when a mass stop starts (``gc.freeze``); they are still freed by reference
  counting, and cycles among them wait for the first collection after the last
  such stop ends.

None of them raises into the loop; each is used from fiberd's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import heapq
import itertools
import os
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_fiber.core.cgroups.groups import empty as cgroup_empty
from slurm_fiber.core.cgroups.memory import memory_peak
from slurm_fiber.core.cgroups.memory import oom_kills as cgroup_oom_kills
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.waiting import set_done


class LateReports:
    """Fibers whose exit their pidfd showed before their template's report came, each
    waiting for that report until a timeout on the clock: one heap, and one task sleeping
    until the earliest timeout while any wait, not a sleep task per fiber (in a mass stop
    thousands of exits outrun their reports). ``ask(pid)``, when given, is called a loop
    step after a wait starts, unless the report came meanwhile: it asks the template to
    reap that fiber now (best effort, never raises;
    its SIGCHLD may have coalesced with another's, core/child_exits.py). Use on one event
    loop; never raises."""

    def __init__(self, clock: Clock, ask: Callable[[int], None] | None = None) -> None:
        self.clock = clock
        self.ask = ask
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._waiting = 0
        self._task: asyncio.Task[None] | None = None

    async def wait(self, reported: asyncio.Future[Any], timeout: float,
                   pid: int | None = None) -> bool:
        """Block until ``reported`` (fiber ``pid``'s report) is done (True) or ``timeout``
        clock seconds have passed (False, unless it is done by then)."""
        if reported.done():
            return True
        if self.ask is not None and pid is not None:
            # Asked a loop step later, and only if the report has not come by then: a
            # report sent as the exit came is often read in that same step, right after
            # this wait began (an ask then cost fiberd a send and the template a wake-up).
            asyncio.get_running_loop().call_soon(self._ask_unless, reported, pid)
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake(_: object) -> None:
            set_done(woken)

        due = self.clock.mono() + timeout
        earlier = bool(self._heap) and due < self._heap[0][0]
        heapq.heappush(self._heap, (due, next(self._order), woken))
        reported.add_done_callback(wake)
        self._waiting += 1
        if earlier or self._task is None:
            self._restart(self._run())
        try:
            await woken
        finally:
            reported.remove_done_callback(wake)
            self._waiting -= 1
            if not self._waiting:  # every entry left is stale: nobody waits on it
                self._heap.clear()
                self._restart(None)
        return reported.done()

    def _ask_unless(self, reported: asyncio.Future[Any], pid: int) -> None:
        if not reported.done() and self.ask is not None:
            self.ask(pid)

    def _restart(self, run: Coroutine[Any, Any, None] | None) -> None:
        if self._task is not None:
            self._task.cancel()
        self._task = asyncio.ensure_future(run) if run is not None else None

    async def _run(self) -> None:
        """Wake each wait whose timeout has come, sleeping until the earliest."""
        while self._heap:
            due, _, woken = self._heap[0]
            now = self.clock.mono()
            if woken.done() or due <= now:
                heapq.heappop(self._heap)
                set_done(woken)
                continue
            await self.clock.sleep(due - now)


@dataclass(frozen=True)
class EndReading:
    """What a carved fiber's end found once its process had exited: ``peak`` memory
    (bytes, None: unknown), OOM kills counted in its cgroup (None: unknown), and its
    output files, each None once removed as empty."""

    peak: int | None
    oom_kills: int | None
    stdout: Path | None
    stderr: Path | None


async def end_reading(cgroup: Path, stdout: Path | None, stderr: Path | None) -> EndReading:
    """A carved fiber's end, once its process has exited: its peak, then, once nothing
    runs in ``cgroup`` (``cgroup_empty`` kills what still does and waits; at once when
    nothing does), its OOM count and its output files (an empty one is removed: nothing
    in the cgroup is left to write to it)."""
    peak = memory_peak(cgroup)
    await cgroup_empty(cgroup)
    return EndReading(peak, cgroup_oom_kills(cgroup), unless_empty(stdout),
                      unless_empty(stderr))


def unless_empty(path: Path | None) -> Path | None:
    """``path``, or None after removing it when it is empty or gone (never raises: a file
    that cannot be checked or removed is kept and named)."""
    if path is None:
        return None
    try:
        if os.stat(path).st_size:
            return path
        os.unlink(path)
    except FileNotFoundError:
        return None
    except OSError:
        return path
    return None


_FROZEN = [0]  # mass stops under way, each with the survivors frozen


@contextlib.contextmanager
def survivors_frozen() -> Iterator[None]:
    """The objects alive now are out of the cyclic collector's sight until the last of the
    mass stops entered this way has ended (nested and concurrent stops share one freeze).
    The end thaws every frozen object: nothing else in fiberd may rely on ``gc.freeze``."""
    if not _FROZEN[0]:
        gc.freeze()
    _FROZEN[0] += 1
    try:
        yield
    finally:
        _FROZEN[0] -= 1
        if not _FROZEN[0]:
            gc.unfreeze()
