"""Stopping fibers: SIGTERM → grace → SIGKILL, stop-all, epochs, deadlines (fake and real clock)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from slurm_fiber.core.cgroups.manager import CgroupManager
from slurm_fiber.core.clock import FakeClock, SystemClock
from slurm_fiber.core.fibers.fiber import enforce_deadline
from slurm_fiber.core.templates.parent import FiberRequest
from slurm_fiber.core.trust.grant import Limits
from tests.core.processkit import (
    EXEC_STARTS,
    aio,
    cgroup_dirs,
    exec_template,
    fork_as,
    marked_procs,
    read_line,
    stop_on_fake_clock,
    wait_marked,
    warm_template,
)
from tests.core.templates.stopkit import ignoring_fiber

T = "tests.core.templates.targetkit"


@aio
async def test_sigterm_ends_a_cooperative_fiber_without_waiting_the_grace(tmp_path, mark):
    clock = FakeClock()
    t = await warm_template(tmp_path, mark, preload=(T,), clock=clock)
    fiber = await t.fork(FiberRequest(id="a", target=f"{T}:sleep", args=(60,)))
    ex = await fiber.stop(grace=30)  # the fake clock never moves: SIGTERM alone did it
    assert ex.signal == signal.SIGTERM and ex.stopped
    assert await fiber.stop(grace=30) is ex  # idempotent
    await t.stop(0)


@aio
async def test_a_fiber_ignoring_sigterm_is_killed_exactly_after_the_grace(tmp_path, mark):
    clock = FakeClock()
    t = await warm_template(tmp_path, mark, preload=(T,), clock=clock)
    fiber = await ignoring_fiber(t, "b")
    guarding = clock.sleepers  # the template's stall guard sleeps on the clock too
    stopping = asyncio.ensure_future(fiber.stop(grace=5))
    await clock.settle()
    assert clock.sleepers == guarding + 1  # the grace is running on the clock
    await clock.advance_and_settle(4.9)
    await asyncio.sleep(0.2)
    assert not stopping.done() and fiber.running  # SIGTERM ignored, grace not over
    await clock.advance_and_settle(0.2)
    ex = await stopping
    assert ex.signal == signal.SIGKILL
    await stop_on_fake_clock(t, clock)
    assert marked_procs(mark) == []


@aio
async def test_epoch_bump_stops_only_older_fibers(tmp_path, mark):
    t = await warm_template(tmp_path, mark, preload=(T,))
    old = [await t.fork(FiberRequest(id=f"o{i}", target=f"{T}:sleep", args=(60,), epoch=1))
           for i in range(3)]
    new = await t.fork(FiberRequest(id="n", target=f"{T}:sleep", args=(60,), epoch=2))
    exits = await t.stop_fibers(0.5, before_epoch=2)
    assert len(exits) == 3 and all(e.stopped for e in exits)
    assert all(not f.running for f in old) and new.running
    assert set(t.fibers) == {"n"}
    await t.stop(0.5)
    assert not new.running and marked_procs(mark) == []


@aio
async def test_deadline_moves_with_the_fence_and_a_nudge_applies_an_earlier_one(tmp_path, mark):
    clock = FakeClock()
    t = await warm_template(tmp_path, mark, preload=(T,), clock=clock)
    fiber = await t.fork(FiberRequest(id="d", target=f"{T}:sleep", args=(60,)))
    deadline = {"at": clock.mono() + 10}
    nudge = asyncio.Event()
    watch = asyncio.ensure_future(enforce_deadline(fiber, lambda: deadline["at"], clock,
                                                   grace=1, nudge=nudge))
    await clock.advance_and_settle(5)
    deadline["at"] += 20  # the fence was extended
    await clock.advance_and_settle(6)  # past the old deadline
    await asyncio.sleep(0.1)
    assert fiber.running and not watch.done()
    deadline["at"] = clock.mono() - 1  # the lease ended early
    nudge.set()
    ex = await watch
    assert ex.stopped and ex.signal == signal.SIGTERM
    await t.stop(0)


@aio
async def test_enforce_deadline_returns_the_exit_of_a_fiber_that_ends_first(tmp_path, mark):
    clock = FakeClock()
    t = await warm_template(tmp_path, mark, preload=(T,), clock=clock)
    fiber = await t.fork(FiberRequest(id="q", target=f"{T}:add", args=(1, 1)))
    ex = await enforce_deadline(fiber, lambda: None, clock, grace=1)
    assert not ex.stopped and ex.result == {"ok": True, "result": 2}
    await t.stop(0)


async def _overshoot(tmp_path: Path, mark: str, cgroup_root: Path | None) -> None:
    clock = SystemClock()
    mgr = CgroupManager(cgroup_root)
    grant = mgr.carve_grant("g", Limits())
    t = await warm_template(tmp_path, mark, preload=(T,), cgroup=grant, clock=clock)
    fiber = await ignoring_fiber(t, "late")
    grace = 0.2
    deadline = clock.mono() + 0.3
    ex = await enforce_deadline(fiber, lambda: deadline, clock, grace=grace)
    overshoot = clock.mono() - deadline
    print(f"overshoot past the deadline: {overshoot * 1000:.1f} ms (grace {grace * 1000:.0f} ms,"
          f" carved={mgr.carved})")
    assert ex.signal == signal.SIGKILL and ex.stopped
    assert grace <= overshoot < 1.0
    await t.stop(0.5)
    await mgr.remove_grant("g")
    assert marked_procs(mark) == []


@aio
async def test_overshoot_past_deadline_uncarved(tmp_path, mark):
    await _overshoot(tmp_path, mark, None)


@pytest.mark.machine_may_lack("a writable cgroup2 hierarchy")
@aio
async def test_overshoot_past_deadline_carved_kills_by_cgroup(tmp_path, mark, cgroup_root):
    await _overshoot(tmp_path, mark, cgroup_root)
    assert cgroup_dirs(cgroup_root) == []


@pytest.mark.parametrize("start", EXEC_STARTS)
@pytest.mark.parametrize("carved", [False, True])
@aio
async def test_stop_takes_an_exec_fibers_children_with_it(tmp_path, mark, request, carved,
                                                          start):
    root = request.getfixturevalue("cgroup_root") if carved else None
    mgr = CgroupManager(root)
    grant = mgr.carve_grant("g", Limits())
    t = await exec_template(tmp_path, mark, start, cgroup=grant)
    out_r, out_w = os.pipe()
    script = "trap '' TERM; sleep 60 & sleep 60 & echo up; wait"
    fiber = await fork_as(t, start, FiberRequest(id="sh", mode="exec",
                                                 argv=("sh", "-c", script),
                                                 stdio=(None, out_w, None)))
    os.close(out_w)
    assert await read_line(out_r) == b"up\n"
    os.close(out_r)
    # template, its spare (kept, or made to replace the one used), sh, two sleeps
    count = 5
    assert len(wait_marked(mark, count)) == count
    started = time.monotonic()
    await fiber.stop(0.2)
    assert time.monotonic() - started < 5
    # Carved: stop returned after the cgroup emptied. Uncarved: the group got its
    # SIGKILL, but only the fiber itself is waited for, so its children may still be dying.
    left = marked_procs(mark) if carved else wait_marked(mark, count - 3)
    assert left == sorted({t.pid, *t.idle_spares})
    await t.stop(0.5)
    await mgr.remove_grant("g")
    assert marked_procs(mark) == []
    if root is not None:
        assert cgroup_dirs(root) == []


@pytest.mark.parametrize("carved", [False, True])
@aio
async def test_a_fiber_ends_with_its_leader_what_it_left_in_its_group_is_killed(
        tmp_path, mark, request, carved):
    root = request.getfixturevalue("cgroup_root") if carved else None
    mgr = CgroupManager(root)
    grant = mgr.carve_grant("g", Limits())
    t = await warm_template(tmp_path, mark, cgroup=grant)
    out_r, out_w = os.pipe()
    # The leader exits by itself at once; the sleep it started stays in its process group.
    fiber = await t.fork(FiberRequest(id="sh", mode="exec", stdio=(None, out_w, None),
                                      argv=("sh", "-c", "sleep 60 & echo $!")))
    os.close(out_w)
    sleeper = int(await read_line(out_r))
    os.close(out_r)
    end = await fiber.wait()
    assert end.exit_code == 0 and end.reason is None  # it ended by itself
    # Uncarved, the template killed the group before it reaped the leader; carved, the
    # cgroup was emptied before wait returned.
    # (SIGKILLed, it may take a moment to be gone from /proc.)
    until = time.monotonic() + 10
    while sleeper in marked_procs(mark) and time.monotonic() < until:
        await asyncio.sleep(0.02)
    assert sleeper not in marked_procs(mark) and t.pid in marked_procs(mark)
    await t.stop(0.5)
    await mgr.remove_grant("g")
    assert marked_procs(mark) == []
