"""What a mass stop shares (core/ends.py). LateReports on the injected clock: a wait ends
with its report or at its timeout, never before; thousands of waits share one sleeper;
nothing of it is left once nobody waits. survivors_frozen: the collector is kept off the
survivors until the last overlapping stop ends."""

from __future__ import annotations

import asyncio
import gc

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.fibers.ends import LateReports, survivors_frozen
from tests.core.processkit import aio


async def one_wait(clock: FakeClock) -> tuple[asyncio.Future[object], asyncio.Task[bool]]:
    """A report not in yet, and a wait for it of 10 s begun now."""
    reported: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(LateReports(clock).wait(reported, 10.0))
    await clock.settle()  # the wait has begun: its timeout counts from now
    return reported, waiting


@aio
async def test_a_wait_ends_when_its_report_comes_and_leaves_no_sleeper() -> None:
    clock = FakeClock()
    reported, waiting = await one_wait(clock)
    assert not waiting.done() and clock.sleepers == 1
    reported.set_result("exit")
    await clock.settle()
    assert waiting.result() is True
    assert clock.sleepers == 0


@aio
async def test_a_wait_with_no_report_ends_at_its_timeout_not_before() -> None:
    clock = FakeClock()
    _, waiting = await one_wait(clock)
    await clock.advance_and_settle(9.5)
    assert not waiting.done()
    await clock.advance_and_settle(0.5)
    assert waiting.result() is False


@aio
async def test_many_waits_share_one_sleeper_and_each_ends_at_its_own_time() -> None:
    clock = FakeClock()
    late = LateReports(clock)
    loop = asyncio.get_running_loop()
    reports = [loop.create_future() for _ in range(1000)]
    first = [asyncio.ensure_future(late.wait(r, 10.0)) for r in reports[:500]]
    await clock.settle()
    await clock.advance_and_settle(5.0)
    second = [asyncio.ensure_future(late.wait(r, 10.0)) for r in reports[500:]]
    await clock.settle()
    assert clock.sleepers == 1
    for r in reports[::2]:
        r.set_result("exit")
    await clock.advance_and_settle(5.0)  # the first half's timeouts come
    assert [w.result() for w in first] == [True, False] * 250
    assert not any(w.done() for w in second[1::2])
    await clock.advance_and_settle(5.0)
    assert [w.result() for w in second] == [True, False] * 250
    assert clock.sleepers == 0


@aio
async def test_an_earlier_timeout_than_any_waiting_is_still_kept() -> None:
    clock = FakeClock()
    late = LateReports(clock)
    loop = asyncio.get_running_loop()
    slow = asyncio.ensure_future(late.wait(loop.create_future(), 60.0))
    await clock.settle()
    quick = asyncio.ensure_future(late.wait(loop.create_future(), 1.0))
    await clock.settle()
    await clock.advance_and_settle(1.0)
    assert quick.result() is False and not slow.done()
    slow.cancel()
    await clock.settle()
    assert clock.sleepers == 0


@aio
async def test_a_wait_whose_report_lags_asks_the_template_for_it_once() -> None:
    clock = FakeClock()
    asked: list[int] = []
    late = LateReports(clock, asked.append)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[object] = loop.create_future()
    done.set_result("exit")
    assert await late.wait(done, 10.0, 41) is True and asked == []  # in: nothing to ask
    lagging: asyncio.Future[object] = loop.create_future()
    waiting = asyncio.ensure_future(late.wait(lagging, 10.0, 42))
    await clock.settle()
    assert asked == [42]
    lagging.set_result("exit")
    await clock.settle()
    assert waiting.result() is True and asked == [42]
    # A report read in the loop step the wait began in (it came with the exit) is not
    # asked for: the ask waits one step.
    prompt: asyncio.Future[object] = loop.create_future()
    waiting = asyncio.ensure_future(late.wait(prompt, 10.0, 43))
    loop.call_soon(prompt.set_result, "exit")  # queued behind the wait's first step
    await clock.settle()
    assert waiting.result() is True and asked == [42]


def test_survivors_stay_frozen_until_the_last_of_overlapping_mass_stops_ends() -> None:
    gc.collect()
    before = gc.get_freeze_count()
    first, second = survivors_frozen(), survivors_frozen()
    with first:
        alive = [object() for _ in range(10)]  # noqa: F841 (alive while frozen)
        assert gc.get_freeze_count() > before
        second.__enter__()
    assert gc.get_freeze_count() > before  # the second stop is still under way
    second.__exit__(None, None, None)
    assert gc.get_freeze_count() == 0
