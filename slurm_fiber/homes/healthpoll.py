"""HealthPoll: a home's control-plane rounds turned into the issuer health.

A round that answers marks the health sync at the clock's now, unless the
poll is paused. A round that fails leaves the health alone, so the health
goes stale on its own once the control plane has been silent for the stale
TTL. Rounds are serial and each gets one interval (on the injected clock) to
answer; then its task is cancelled with a ``RoundTimeout`` as the cancel
message, and the poll reports ``RoundTimeout``. The poll does not log: it
calls ``on_error`` once per distinct error message and ``on_recovered`` once
when a round answers after errors, so a home logs each transition once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from slurm_fiber.core.book.health import SourceHealth
from slurm_fiber.core.clock import Clock


class RoundTimeout(TimeoutError):
    """A poll round did not answer within one interval (the seed's ErrRoundTimeout)."""

    def __init__(self) -> None:
        super().__init__("poll round timed out")


ErrRoundTimeout = RoundTimeout

Round = Callable[[], Awaitable[None]]


def error_message(err: BaseException) -> str:
    """The message two errors are compared by: their text, or their type when it is empty."""
    return str(err) or type(err).__name__


@dataclass
class HealthPoll:
    """Runs ``round`` every ``every`` seconds of ``clock`` and marks ``health`` on answers.

    ``round`` asks the control plane once: it returns on an answer and raises
    on failure. A round that honours cancellation simply lets the
    CancelledError (whose ``args[0]`` is a ``RoundTimeout``) propagate.
    ``on_error(err)`` and ``on_recovered()`` report transitions; either may be
    None and neither may block. Use one HealthPoll per control plane, on one
    event loop.
    """

    health: SourceHealth
    every: float
    clock: Clock
    round: Round
    on_error: Callable[[BaseException], None] | None = None
    on_recovered: Callable[[], None] | None = None
    _paused: bool = field(default=False, init=False)
    _mark_lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _failing: bool = field(default=False, init=False)
    _last_error: str | None = field(default=None, init=False)
    _running: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.every <= 0:
            raise ValueError("HealthPoll.every must be a positive number of seconds")

    async def once(self) -> BaseException | None:
        """Run one round now, mark or report it, and return its error (None: answered).

        Blocks for as long as the round runs: at most one interval for a round
        that honours cancellation, longer for one that ignores it. ``run``
        calls it on every tick; a test can call it directly. Cancelling the
        caller cancels the round and waits for it before re-raising.
        """
        err = await self._ask()
        self._settle(err)
        return err

    async def run(self) -> None:
        """Run a round at once, then one every interval, until cancelled. Called once.

        A round that overruns its interval (ignoring cancellation) delays the
        next one, which then starts as soon as it returns.
        """
        if self._running:
            raise RuntimeError("HealthPoll.run is called once")
        self._running = True
        while True:
            started = self.clock.mono()
            await self.once()
            await self.clock.sleep(self.every - (self.clock.mono() - started))

    def set_paused(self, paused: bool) -> None:
        """Stop (or resume) answered rounds marking the health; rounds keep running.

        Safe from any thread. Returns only after a mark in progress has
        finished, and the pause is checked in the same step as the mark, so a
        health set right after the pause is never marked over by a round
        that answered just before it.
        """
        with self._mark_lock:
            self._paused = paused

    async def _ask(self) -> BaseException | None:
        task = asyncio.ensure_future(self.round())
        timer = asyncio.ensure_future(self.clock.sleep(self.every))
        timed_out = False
        try:
            await asyncio.wait({task, timer}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                timed_out = True
                task.cancel(RoundTimeout())
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
            await asyncio.wait({task})
            raise
        finally:
            timer.cancel()
        if task.cancelled():
            return RoundTimeout() if timed_out else asyncio.CancelledError()
        return task.exception()

    def _settle(self, err: BaseException | None) -> None:
        if err is not None:
            self._failing = True
            message = error_message(err)
            if message != self._last_error:
                self._last_error = message
                if self.on_error is not None:
                    self.on_error(err)
            return
        with self._mark_lock:
            if not self._paused:
                self.health.mark_sync()
        if self._failing:
            self._failing = False
            self._last_error = None
            if self.on_recovered is not None:
                self.on_recovered()
