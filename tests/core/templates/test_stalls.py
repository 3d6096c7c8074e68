"""A template that stops answering, on the injected clock: given up on exactly at the bound,
killed, re-warmed; fibers' exits still seen through their pidfds; a Clone racing a
SIGKILLed template is refused as not ready, never as a failed fork."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from slurm_fiber.core.cgroups.manager import CgroupManager
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.fibers.fiber import FiberState
from slurm_fiber.core.templates.parent import (
    FiberRequest,
    Template,
    TemplateNotReady,
    TemplateState,
)
from slurm_fiber.core.trust.grant import Limits
from slurm_fiber.core.waiting import zombie_exit
from tests.core.processkit import (
    aio,
    cgroup_dirs,
    idle_spares,
    marked_procs,
    proc_state,
    wait_dead,
    wait_state,
    warm_template,
)

T = "tests.core.templates.targetkit"
BOUND = 5.0


async def pass_time(clock: FakeClock, seconds: float, step: float = 0.5) -> None:
    """Move the fake clock ``seconds`` forward in steps, as time passes for a running fiberd
    (one jump would be a gap in its watching, which restarts the stall count)."""
    while seconds > 1e-9:
        await clock.advance_and_settle(min(step, seconds))
        seconds -= step


async def rewarmed(t: Template, clock: FakeClock, first: int) -> None:
    """Move the fake clock through the re-warm backoff until ``t`` is ready in a new process."""
    while t.pid == first:
        await clock.advance_and_settle(0.1)
        await asyncio.sleep(0.01)
    assert await t.wait_warm() is TemplateState.READY


async def stop_with(t: Template, clock: FakeClock, grace: float = 1.0) -> None:
    """Stop ``t``, moving the fake clock along (graces and report bounds run on it)."""
    stopping = asyncio.ensure_future(t.stop(grace))
    while not stopping.done():
        await clock.advance_and_settle(0.5)
        await asyncio.sleep(0.01)
    await stopping


@aio
async def test_a_spare_request_unanswered_for_the_bound_gives_the_template_up(
        tmp_path: Path, mark: str):
    clock = FakeClock()
    t = await warm_template(tmp_path, mark, preload=(T,), clock=clock, spares=0, timeout=BOUND)
    first = t.pid
    assert first is not None
    os.kill(first, signal.SIGSTOP)
    assert wait_state(first, "T")
    clone = asyncio.ensure_future(t.fork(FiberRequest(id="f1", target=f"{T}:add", args=(1, 1))))
    await clock.settle()  # the request is sent
    await pass_time(clock, BOUND - 0.1)
    assert not clone.done() and t.state is TemplateState.READY  # within the bound: waiting
    await clock.advance_and_settle(0.2)
    with pytest.raises(TemplateNotReady) as refused:
        await clone
    assert refused.value.state is TemplateState.REWARMING
    assert t.state is TemplateState.REWARMING and t.last_fault is not None
    assert t.last_fault.startswith("no answer to a request for 5.1 s")
    assert wait_dead(first)  # killed although stopped
    assert t.retry_after() > 0
    await rewarmed(t, clock, first)
    assert t.restarts == 1
    fiber = await t.fork(FiberRequest(id="f2", target=f"{T}:add", args=(2, 3)))
    assert (await fiber.wait()).result == {"ok": True, "result": 5}
    await stop_with(t, clock)
    assert marked_procs(mark) == []


@pytest.mark.parametrize("carved", [False, True], ids=["uncarved", "carved"])
@aio
async def test_a_template_stopped_for_the_bound_is_given_up_with_no_clone_asking(
        tmp_path: Path, mark: str, carved: bool, request: pytest.FixtureRequest):
    clock = FakeClock()
    mgr = CgroupManager(request.getfixturevalue("cgroup_root")) if carved else None
    grant = mgr.carve_grant("g", Limits()) if mgr else None
    t = await warm_template(tmp_path, mark, preload=(T,), clock=clock, timeout=BOUND,
                            cgroup=grant)
    [spare] = await idle_spares(t)
    first = t.pid
    assert first is not None
    os.kill(first, signal.SIGSTOP)
    assert wait_state(first, "T")
    await pass_time(clock, 1.0)  # the next look sees it stopped
    await pass_time(clock, BOUND - 0.1)
    assert t.state is TemplateState.READY
    await clock.advance_and_settle(0.2)
    assert t.state is TemplateState.REWARMING
    assert t.last_fault is not None and t.last_fault.startswith("stopped (SIGSTOP")
    assert t.to_json()["last_fault"] == t.last_fault
    with pytest.raises(TemplateNotReady, match="rewarming"):
        await t.fork(FiberRequest(id="f1", target=f"{T}:add", args=(1, 1)))
    assert wait_dead(first) and wait_dead(spare)
    await rewarmed(t, clock, first)
    await stop_with(t, clock)
    assert marked_procs(mark) == []
    if mgr is not None:
        await mgr.remove_grant("g")  # fails if a spare's leaf were left
        assert cgroup_dirs(request.getfixturevalue("cgroup_root")) == []


@pytest.mark.parametrize("carved", [False, True], ids=["uncarved", "carved"])
@aio
async def test_a_fibers_exit_is_reported_while_its_template_is_stopped(
        tmp_path: Path, mark: str, carved: bool, request: pytest.FixtureRequest):
    clock = FakeClock()
    mgr = CgroupManager(request.getfixturevalue("cgroup_root")) if carved else None
    grant = mgr.carve_grant("g", Limits()) if mgr else None
    t = await warm_template(tmp_path, mark, preload=(T,), clock=clock, timeout=BOUND,
                            cgroup=grant)
    fiber = await t.fork(FiberRequest(id="f1", target=f"{T}:sleep", args=(60,)))
    assert t.pid is not None
    os.kill(t.pid, signal.SIGSTOP)
    assert wait_state(t.pid, "T")
    os.kill(fiber.pid, signal.SIGTERM)
    assert wait_state(fiber.pid, "Z")  # its parent, the template, cannot reap it
    waiting = asyncio.ensure_future(fiber.wait())
    await clock.settle()  # fiberd sees its pidfd: it exited
    await pass_time(clock, BOUND - 0.1)
    assert not waiting.done()  # the template's report may still come
    await clock.advance_and_settle(0.2)
    end = await waiting
    assert end.state is FiberState.EXITED and end.signal == signal.SIGTERM
    assert end.cpu_time is not None and end.maxrss is None  # the kernel's record
    assert fiber.id not in t.fibers
    await stop_with(t, clock)
    assert marked_procs(mark) == []
    if mgr is not None:
        await mgr.remove_grant("g")


@aio
async def test_a_fiber_running_when_its_template_is_given_up_is_lost_not_left(
        tmp_path: Path, mark: str):
    clock = FakeClock()
    t = await warm_template(tmp_path, mark, preload=(T,), clock=clock, timeout=BOUND)
    fiber = await t.fork(FiberRequest(id="f1", target=f"{T}:ignore_term_and_sleep",
                                      args=(60,)))
    first = t.pid
    assert first is not None
    os.kill(first, signal.SIGSTOP)
    assert wait_state(first, "T")
    await pass_time(clock, 1.0)
    await pass_time(clock, BOUND)
    assert t.last_fault is not None  # given up on (and maybe re-warming already)
    assert wait_dead(first)
    end = await fiber.wait()
    assert end.state in (FiberState.LOST, FiberState.EXITED)
    assert end.status is None or end.signal == signal.SIGKILL
    assert proc_state(fiber.pid) in ("Z", "")
    await stop_with(t, clock)
    assert marked_procs(mark) == []


@aio
async def test_a_clone_racing_a_sigkilled_template_is_not_ready_not_a_failed_fork(
        tmp_path: Path, mark: str):
    t = await warm_template(tmp_path, mark, preload=(T,))
    [spare] = await idle_spares(t)
    first = t.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    # Without yielding: fiberd has not heard of it; the spare died by its death signal.
    assert wait_dead(first) and wait_dead(spare)
    assert t.state is TemplateState.READY
    with pytest.raises(TemplateNotReady) as refused:
        await t.fork(FiberRequest(id="f1", target=f"{T}:add", args=(1, 1)))
    assert refused.value.state is TemplateState.REWARMING
    assert t.last_fault is not None and "the template" in t.last_fault
    assert await t.wait_warm() is TemplateState.READY and t.pid != first
    fiber = await t.fork(FiberRequest(id="f2", target=f"{T}:add", args=(1, 1)))
    assert (await fiber.wait()).result == {"ok": True, "result": 2}
    await t.stop(1.0)
    assert marked_procs(mark) == []


def test_the_kernel_keeps_an_unreaped_childs_exit_and_only_its_parents() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    pidfd = os.pidfd_open(pid)
    try:
        assert wait_state(pid, "Z")
        seen = zombie_exit(pid, pidfd, parent=os.getpid())
        assert seen is not None and os.waitstatus_to_exitcode(int(seen["status"])) == 7
        # Any pid but the parent it died under (not 1: in a container that is this test).
        assert zombie_exit(pid, pidfd, parent=os.getpid() + 1) is None
        os.waitpid(pid, 0)
        assert zombie_exit(pid, pidfd) is None  # reaped: the pid may name another
    finally:
        os.close(pidfd)
