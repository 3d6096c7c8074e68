"""ReadyGate: every seed sentence, with publish calls the test completes by hand."""

from __future__ import annotations

import asyncio

import pytest

from slurm_fiber.homes import ReadyGate


class Plane:
    """A control plane whose publish calls stay in flight until the test settles them."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.futures: list[asyncio.Future[None]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def publish(self, warm: list[str]) -> None:
        self.calls.append(list(warm))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.futures.append(fut)
        try:
            await fut
        finally:
            self.in_flight -= 1

    async def settle(self, err: Exception | None = None) -> None:
        """Finish the oldest call in flight, then let everyone run."""
        await tick()
        fut = self.futures.pop(0)
        if err is None:
            fut.set_result(None)
        else:
            fut.set_exception(err)
        await tick()


async def tick() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def in_flight(gate: ReadyGate) -> asyncio.Task[None]:
    """Start publish_ready("a", True) and let it reach the control plane, where it stays."""
    task = asyncio.create_task(gate.publish_ready("a", True))
    await tick()
    return task


class Instant:
    """A control plane that answers at once, failing with queued errors."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.failures: list[Exception] = []

    async def publish(self, warm: list[str]) -> None:
        self.calls.append(warm)
        if self.failures:
            raise self.failures.pop(0)


def test_first_publish_ready_publishes_then_only_flips() -> None:
    plane = Instant()
    gate = ReadyGate(plane.publish)

    async def main() -> None:
        await gate.publish_ready("b", False)
        assert plane.calls == [[]], "the first call publishes even 'not ready'"
        await gate.publish_ready("b", True)
        await gate.publish_ready("a", True)  # still "any warm": no flip
        assert gate.ready()
        await gate.publish_ready("b", False)
        await gate.publish_ready("a", False)
        assert not gate.ready()

    asyncio.run(main())
    assert plane.calls == [[], ["b"], []]


def test_warm_uids_are_sorted() -> None:
    plane = Instant()
    gate = ReadyGate(plane.publish)
    plane.failures.append(ConnectionError("down"))

    async def main() -> None:
        with pytest.raises(ConnectionError):
            await gate.publish_ready("z", True)
        await gate.publish_ready("m", True)

    asyncio.run(main())
    assert plane.calls == [["z"], ["m", "z"]]


def test_a_call_during_a_publish_records_and_returns_and_the_publisher_sends_newest() -> None:
    plane = Plane()
    gate = ReadyGate(plane.publish)

    async def main() -> None:
        first = await in_flight(gate)
        assert plane.calls == [["a"]]
        # no lock held across the publish: these return while it is in flight
        await asyncio.wait_for(gate.publish_ready("a", False), 5)
        assert not gate.ready()
        await asyncio.wait_for(gate.publish_ready("c", True), 5)
        await asyncio.wait_for(gate.publish_ready("c", False), 5)
        await plane.settle()
        assert plane.calls == [["a"], []], "the in-flight publisher sends the newest state"
        assert not first.done()
        await plane.settle()
        await first

    asyncio.run(main())
    assert plane.max_in_flight == 1


def test_newest_state_wins_and_equal_newest_is_not_resent() -> None:
    plane = Plane()
    gate = ReadyGate(plane.publish)

    async def main() -> None:
        first = await in_flight(gate)
        await gate.publish_ready("a", False)
        await gate.publish_ready("b", True)  # back to "warm", what is in flight
        await plane.settle()
        await first

    asyncio.run(main())
    assert plane.calls == [["a"]]


def test_never_an_older_state_after_a_newer_one() -> None:
    plane = Plane()
    gate = ReadyGate(plane.publish)
    decided: list[bool] = []

    async def flip(uid: str, ready: bool) -> None:
        await gate.publish_ready(uid, ready)

    async def main() -> None:
        tasks = []
        for i, ready in enumerate([True, False, True, False, True]):
            tasks.append(asyncio.create_task(flip("a", ready)))
            await tick()
            decided.append(gate.ready())
            if i % 2:
                await plane.settle()
        while plane.futures:
            await plane.settle()
        await asyncio.gather(*tasks)

    asyncio.run(main())
    seen = [bool(c) for c in plane.calls]
    assert seen[-1] == decided[-1]
    # each sent state was decided no earlier than the one before it
    positions = []
    start = 0
    for state in seen:
        start = decided.index(state, start)
        positions.append(start)
    assert positions == sorted(positions)
    assert plane.max_in_flight == 1


def test_a_failed_publish_raises_and_the_next_call_sends_it_again() -> None:
    plane = Instant()
    gate = ReadyGate(plane.publish)
    plane.failures.append(ConnectionError("api down"))

    async def main() -> None:
        with pytest.raises(ConnectionError, match="api down"):
            await gate.publish_ready("a", True)
        await gate.publish_ready("b", True)  # no flip, but the failed state is resent

    asyncio.run(main())
    assert plane.calls == [["a"], ["a", "b"]]


def test_republish_before_the_first_publish_ready_does_nothing() -> None:
    plane = Instant()
    gate = ReadyGate(plane.publish)
    assert asyncio.run(gate.republish()) == (False, None)
    assert plane.calls == []


def test_republish_after_success_has_nothing_to_send() -> None:
    plane = Instant()
    gate = ReadyGate(plane.publish)

    async def main() -> tuple[bool, Exception | None]:
        await gate.publish_ready("a", True)
        return await gate.republish()

    assert asyncio.run(main()) == (False, None)
    assert plane.calls == [["a"]]


def test_republish_reports_each_new_failure_and_the_recovery_once() -> None:
    plane = Instant()
    gate = ReadyGate(plane.publish)
    plane.failures += [
        ConnectionError("down"),
        ConnectionError("down"),
        ConnectionError("down"),
        ConnectionError("timeout"),
    ]
    outcomes: list[tuple[bool, str | None]] = []

    async def main() -> None:
        with pytest.raises(ConnectionError):
            await gate.publish_ready("a", True)
        for _ in range(5):
            changed, err = await gate.republish()
            outcomes.append((changed, None if err is None else str(err)))

    asyncio.run(main())
    assert outcomes == [
        (False, "down"),
        (False, "down"),
        (True, "timeout"),
        (True, None),
        (False, None),  # accepted: nothing left to send
    ]
    assert plane.calls == [["a"]] * 5


def test_republish_while_a_publish_is_in_flight_leaves_it_to_the_publisher() -> None:
    plane = Plane()
    gate = ReadyGate(plane.publish)

    async def main() -> None:
        first = await in_flight(gate)
        assert await gate.republish() == (False, None)
        await plane.settle(ConnectionError("down"))
        with pytest.raises(ConnectionError):
            await first
        again = asyncio.create_task(gate.republish())
        await plane.settle()
        assert await again == (True, None)

    asyncio.run(main())
    assert plane.calls == [["a"], ["a"]]


def test_a_failure_while_newer_state_waits_still_sends_the_newest() -> None:
    plane = Plane()
    gate = ReadyGate(plane.publish)

    async def main() -> None:
        first = await in_flight(gate)
        await gate.publish_ready("a", False)
        await plane.settle(ConnectionError("down"))
        await plane.settle()
        await first  # the last state it sent was accepted
        assert await gate.republish() == (False, None)

    asyncio.run(main())
    assert plane.calls == [["a"], []]


def test_a_publish_cancelled_in_flight_leaves_the_state_unknown_so_the_next_is_sent() -> None:
    """fiberd publishes "not ready" at start; a "ready" the plane takes but whose caller is
    cancelled (shutdown) must not make the later "not ready" look already published."""

    async def main() -> None:
        plane = Plane()
        gate = ReadyGate(plane.publish)
        first = asyncio.create_task(gate.publish_ready("", False))
        await plane.settle()
        await first
        up = await in_flight(gate)  # the plane has it, its answer never comes back
        up.cancel()
        with pytest.raises(asyncio.CancelledError):
            await up
        assert plane.futures.pop(0).cancelled()  # no answer will come for it
        down = asyncio.create_task(gate.publish_ready("a", False))
        await tick()
        assert plane.calls == [[], ["a"], []]
        await plane.settle()
        await down

    asyncio.run(main())
