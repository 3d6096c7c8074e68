"""HealthPoll: every seed sentence, on a FakeClock, without sleeps."""

from __future__ import annotations

import asyncio
import threading

import pytest

from slurm_fiber.core.book.health import HealthState, SourceHealth
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.homes import ErrRoundTimeout, HealthPoll, RoundTimeout

EVERY = 10.0


class Rounds:
    """A scripted control plane: each round awaits a future the test resolves."""

    def __init__(self) -> None:
        self.pending: list[asyncio.Future[None]] = []
        self.started = 0
        self.active = 0
        self.max_active = 0
        self.cancel_messages: list[object] = []

    async def __call__(self) -> None:
        self.started += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending.append(fut)
        try:
            await fut
        except asyncio.CancelledError as err:
            self.cancel_messages.append(err.args[0] if err.args else None)
            raise
        finally:
            self.active -= 1

    def answer(self, err: Exception | None = None) -> None:
        fut = self.pending.pop(0)
        if err is None:
            fut.set_result(None)
        else:
            fut.set_exception(err)


def make_poll(clock: FakeClock, round_, **kw) -> HealthPoll:
    return HealthPoll(SourceHealth(clock, stale_after=30.0), EVERY, clock, round_, **kw)


def test_err_round_timeout_is_the_round_timeout_exception() -> None:
    assert ErrRoundTimeout is RoundTimeout
    assert str(RoundTimeout()) == "poll round timed out"
    assert isinstance(RoundTimeout(), TimeoutError)


def test_an_answered_round_marks_the_health_at_the_clocks_now(clock: FakeClock) -> None:
    async def answer() -> None:
        return None

    poll = make_poll(clock, answer)
    assert poll.health.read().state is HealthState.NEVER
    clock.advance(5)
    assert asyncio.run(poll.once()) is None
    assert poll.health.last_sync == clock.mono()


def test_a_failed_round_leaves_the_health_alone_so_it_goes_stale(clock: FakeClock) -> None:
    results: list[Exception | None] = [None, ConnectionError("refused")]

    async def round_() -> None:
        err = results.pop(0)
        if err:
            raise err

    poll = make_poll(clock, round_)
    asyncio.run(poll.once())
    synced = poll.health.last_sync
    clock.advance(31)
    assert isinstance(asyncio.run(poll.once()), ConnectionError)
    assert poll.health.last_sync == synced
    assert poll.health.read().state is HealthState.STALE


def test_a_round_gets_one_interval_then_is_cancelled_with_round_timeout(
    clock: FakeClock,
) -> None:
    rounds = Rounds()
    poll = make_poll(clock, rounds)

    async def main() -> BaseException | None:
        once = asyncio.create_task(poll.once())
        await clock.settle()
        await clock.advance_and_settle(EVERY - 1)
        assert not once.done(), "the round still has time"
        await clock.advance_and_settle(1)
        return await once

    err = asyncio.run(main())
    assert isinstance(err, RoundTimeout)
    assert len(rounds.cancel_messages) == 1
    assert isinstance(rounds.cancel_messages[0], RoundTimeout)
    assert poll.health.last_sync is None


def test_an_own_error_is_reported_as_is_even_after_the_interval_ran_out(
    clock: FakeClock,
) -> None:
    async def round_() -> None:
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            raise PermissionError("forbidden: pods is not allowed") from None

    poll = make_poll(clock, round_)

    async def main() -> BaseException | None:
        once = asyncio.create_task(poll.once())
        await clock.settle()
        await clock.advance_and_settle(EVERY)
        return await once

    err = asyncio.run(main())
    assert isinstance(err, PermissionError)
    assert "forbidden" in str(err)


def test_rounds_are_serial_and_an_ignoring_round_delays_the_next(clock: FakeClock) -> None:
    released: list[bool] = []
    started: list[float] = []

    async def stubborn() -> None:
        started.append(clock.mono())
        while not released:
            try:
                await clock.sleep(1)
            except asyncio.CancelledError:
                continue  # ignores its context

    poll = make_poll(clock, stubborn)

    async def main() -> None:
        task = asyncio.create_task(poll.run())
        await clock.settle()
        for _ in range(35):  # 3.5 intervals while the first round runs
            await clock.advance_and_settle(1)
        assert len(started) == 1, "no round starts while one runs"
        released.append(True)
        await clock.advance_and_settle(1)
        assert len(started) == 2, "the next round starts as soon as the late one returns"
        assert started[1] - started[0] == 36
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_run_rounds_at_once_then_every_interval_never_overlapping(clock: FakeClock) -> None:
    rounds = Rounds()
    poll = make_poll(clock, rounds)

    async def main() -> None:
        task = asyncio.create_task(poll.run())
        await clock.settle()
        assert rounds.started == 1, "a round at once"
        await clock.advance_and_settle(3)
        rounds.answer()
        await clock.settle()
        assert poll.health.last_sync == clock.mono()
        await clock.advance_and_settle(EVERY - 3 - 0.5)
        assert rounds.started == 1
        await clock.advance_and_settle(0.5)
        assert rounds.started == 2, "the next round one interval after the last began"
        await clock.advance_and_settle(EVERY)  # times out, then the third starts at once
        assert rounds.started == 3
        assert rounds.max_active == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert rounds.active == 0, "cancelling run cancels the round in progress"

    asyncio.run(main())


def test_run_is_called_once(clock: FakeClock) -> None:
    poll = make_poll(clock, Rounds())

    async def main() -> None:
        task = asyncio.create_task(poll.run())
        await clock.settle()
        with pytest.raises(RuntimeError, match="once"):
            await poll.run()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_on_error_once_per_distinct_message_and_on_recovered_once(clock: FakeClock) -> None:
    script: list[Exception | None] = [
        ConnectionError("refused"),
        ConnectionError("refused"),
        ConnectionError("reset"),
        ConnectionError("reset"),
        None,
        None,
        ConnectionError("refused"),
    ]
    seen: list[str] = []

    async def round_() -> None:
        err = script.pop(0)
        if err:
            raise err

    poll = make_poll(
        clock,
        round_,
        on_error=lambda e: seen.append(f"error {e}"),
        on_recovered=lambda: seen.append("recovered"),
    )

    async def main() -> None:
        for _ in range(7):
            await poll.once()

    asyncio.run(main())
    assert seen == ["error refused", "error reset", "recovered", "error refused"]


def test_a_paused_poll_keeps_running_rounds_but_does_not_mark(clock: FakeClock) -> None:
    script: list[Exception | None] = [None, ConnectionError("down"), None, None]
    seen: list[str] = []

    async def round_() -> None:
        err = script.pop(0)
        if err:
            raise err

    poll = make_poll(clock, round_, on_error=lambda e: seen.append(str(e)),
                     on_recovered=lambda: seen.append("recovered"))

    async def main() -> None:
        await poll.once()
        marked = poll.health.last_sync
        poll.set_paused(True)
        clock.advance(1)
        await poll.once()
        await poll.once()
        assert poll.health.last_sync == marked, "paused: answers do not mark"
        poll.set_paused(False)
        clock.advance(1)
        await poll.once()
        assert poll.health.last_sync == clock.mono()

    asyncio.run(main())
    assert seen == ["down", "recovered"], "transitions are reported while paused"


def test_a_round_that_answered_just_before_the_pause_does_not_mark_over_it(
    clock: FakeClock,
) -> None:
    rounds = Rounds()
    poll = make_poll(clock, rounds)

    async def main() -> None:
        once = asyncio.create_task(poll.once())
        await clock.settle()
        clock.advance(2)
        rounds.answer()  # answered; the poll has not resumed yet
        poll.set_paused(True)  # the home pauses and sets its own health view
        assert await once is None
        assert poll.health.last_sync is None

    asyncio.run(main())


class BlockingHealth(SourceHealth):
    """A health whose mark takes as long as the test wants, to widen the race window."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock, stale_after=30.0)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.order: list[str] = []

    def mark_sync(self) -> None:
        self.entered.set()
        self.release.wait(10)
        super().mark_sync()
        self.order.append("marked")


def test_set_paused_waits_for_a_mark_in_progress(clock: FakeClock) -> None:
    health = BlockingHealth(clock)

    async def answer() -> None:
        return None

    poll = HealthPoll(health, EVERY, clock, answer)
    loop_thread = threading.Thread(target=lambda: asyncio.run(poll.once()))
    loop_thread.start()
    assert health.entered.wait(10)
    pauser_started = threading.Event()

    def pause() -> None:
        pauser_started.set()
        poll.set_paused(True)
        health.order.append("paused")

    pauser = threading.Thread(target=pause)
    pauser.start()
    assert pauser_started.wait(10)
    pauser.join(0.05)
    assert pauser.is_alive(), "set_paused must wait while a mark is in progress"
    health.release.set()
    pauser.join(10)
    loop_thread.join(10)
    assert health.order == ["marked", "paused"]


def test_every_must_be_positive(clock: FakeClock) -> None:
    with pytest.raises(ValueError, match="every"):
        HealthPoll(SourceHealth(clock, 30.0), 0, clock, Rounds())
