"""ScopeLossQueue: every seed sentence, delivery observed from the callback's side."""

from __future__ import annotations

import asyncio

import pytest

from slurm_fiber.homes import ScopeLossQueue


async def tick() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def test_the_zero_argument_queue_is_ready_and_lose_reports_new_reasons() -> None:
    q = ScopeLossQueue()
    assert q.pending() == 0
    assert q.lose("pod deleted") is True
    assert q.lose("claim deallocated") is True
    assert q.lose("pod deleted") is False, "a reason already seen is dropped"
    assert q.pending() == 2


def test_reasons_queued_before_a_callback_wait_and_are_delivered_in_order() -> None:
    got: list[str] = []

    async def main() -> None:
        q = ScopeLossQueue()
        runner = asyncio.create_task(q.run())
        q.lose("a")
        q.lose("b")
        await tick()
        assert q.pending() == 2, "no callback yet: reasons wait"
        q.on_scope_lost(None)
        await tick()
        assert q.pending() == 2, "a nil callback is ignored"

        async def record(reason: str) -> None:
            got.append(reason)

        q.on_scope_lost(record)  # wakes delivery
        await tick()
        assert q.pending() == 0
        q.lose("c")
        await tick()
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(main())
    assert got == ["a", "b", "c"]


def test_each_reason_is_delivered_once_per_lifetime() -> None:
    got: list[str] = []

    async def main() -> None:
        q = ScopeLossQueue()

        async def record(reason: str) -> None:
            got.append(reason)

        q.on_scope_lost(record)
        runner = asyncio.create_task(q.run())
        assert q.lose("job ended")
        await tick()
        assert not q.lose("job ended"), "delivered already: still seen"
        await tick()
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(main())
    assert got == ["job ended"]


def test_delivery_is_on_the_one_task_run_owns_and_a_slow_callback_stalls_no_round() -> None:
    callers: list[asyncio.Task[None] | None] = []
    gate: asyncio.Event

    async def main() -> None:
        nonlocal gate
        gate = asyncio.Event()
        q = ScopeLossQueue()

        async def slow(reason: str) -> None:
            callers.append(asyncio.current_task())
            await gate.wait()  # an epoch bump waiting for fibers

        q.on_scope_lost(slow)
        runner = asyncio.create_task(q.run())

        async def poll_round(reason: str) -> bool:
            return q.lose(reason)

        assert await asyncio.wait_for(poll_round("first"), 5)
        await tick()
        # the callback is still running; a later round is not held up by it
        assert await asyncio.wait_for(poll_round("second"), 5)
        assert q.pending() == 1
        gate.set()
        await tick()
        assert q.pending() == 0
        assert callers == [runner, runner]
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(main())


def test_cancelling_run_cancels_a_callback_in_progress_and_run_is_called_once() -> None:
    cancelled: list[str] = []

    async def main() -> None:
        q = ScopeLossQueue()

        async def stuck(reason: str) -> None:
            try:
                await asyncio.get_running_loop().create_future()
            except asyncio.CancelledError:
                cancelled.append(reason)
                raise

        q.on_scope_lost(stuck)
        q.lose("gone")
        runner = asyncio.create_task(q.run())
        await tick()
        with pytest.raises(RuntimeError, match="once"):
            await q.run()
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner

    asyncio.run(main())
    assert cancelled == ["gone"]


def test_a_callback_error_ends_run_with_it_and_the_rest_stay_pending() -> None:
    async def main() -> ScopeLossQueue:
        q = ScopeLossQueue()

        async def broken(reason: str) -> None:
            raise OSError(f"cannot bump epoch for {reason}")

        q.on_scope_lost(broken)
        q.lose("a")
        q.lose("b")
        with pytest.raises(OSError, match="for a"):
            await q.run()
        return q

    q = asyncio.run(main())
    assert q.pending() == 1
