"""What must not regress at scale (issue 19): many fibers stopped and accounted, one timer.

With a few hundred running fibers (enough to catch a per-fiber loop, small enough
for CI): removing the grant and shutting fiberd down stop every one, each exit is
audited once with its reason (none ``lost``), nothing of them runs afterwards and
no cgroup is left. Deadlines are kept by one timer on the injected clock: many
fibers add one sleeper, and they fire in deadline order. A pidfd above FD_SETSIZE
is read correctly (select() refused it, and fibers were killed as lost). Fibers
that ignore SIGTERM, more than one slot group of them, are killed at shutdown
(one cgroup.kill for the grant) and each exit is still reported by the
template; a slot group goes once its leaves are gone, so none piles up.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from slurm_fiber.core.cgroups.common import SLOTS_PER_GROUP
from slurm_fiber.core.cgroups.leaves import LeafPool
from slurm_fiber.core.cgroups.manager import CgroupManager
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.fibers.fiber import DeadlineTimer, Fiber
from slurm_fiber.core.templates.parent import FiberRequest
from slurm_fiber.core.trust.grant import Limits
from slurm_fiber.core.waiting import pidfd_exited
from tests.core.processkit import (
    aio,
    cgroup_dirs,
    marked_procs,
    stop_on_fake_clock,
    warm_template,
)
from tests.core.runtime.fiberdkit import Live, Site, running_fiberd, until, warm

MANY = 300
T = "tests.core.templates.targetkit"


def exits(site: Site) -> list[dict[str, object]]:
    lines = (site.state / "audit.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "fiber_exit"]


async def start_many(live: Live) -> list[object]:
    views = [await live.clone(argv=("sleep", "600")) for _ in range(MANY)]
    assert all(v.fiber.running for v in views)  # type: ignore[attr-defined]
    assert live.core.fibers_running() == MANY
    return views


async def assert_all_stopped(site: Site, code: str) -> None:
    ended = exits(site)
    assert len(ended) == MANY and len({e["fiber"] for e in ended}) == MANY
    for end in ended:
        record = end["exit"]
        assert isinstance(record, dict)
        assert record["state"] == "exited" and record["stopped"] is True
        assert record["signal"] == signal.SIGTERM
        assert record["reason"]["code"] == code  # type: ignore[index]
    await until(lambda: marked_procs(site.mark) == [])  # the template stops after its fibers


@pytest.mark.machine_may_lack("a writable cgroup2 hierarchy")
@aio
async def test_removing_a_grant_stops_hundreds_of_fibers_and_reports_every_exit(
        site: Site, cgroup_root: Path) -> None:
    site.drop()
    async with running_fiberd(site, cgroup_root=str(cgroup_root)) as live:
        await warm(live)
        await start_many(live)
        site.remove()
        await until(lambda: "g1" not in live.core.status()["templates"], within=60)  # type: ignore[operator]
        await until(lambda: len(exits(site)) == MANY, within=60)
        assert live.core.fibers_running() == 0
        await assert_all_stopped(site, "removed")
        await until(lambda: [p for p in cgroup_root.iterdir() if p.is_dir()] == [])


@pytest.mark.machine_may_lack("a writable cgroup2 hierarchy")
@aio
async def test_shutdown_stops_hundreds_of_fibers_and_leaves_no_cgroup(
        site: Site, cgroup_root: Path) -> None:
    site.drop()
    async with running_fiberd(site, cgroup_root=str(cgroup_root)) as live:
        await warm(live)
        await start_many(live)
        await live.core.shutdown()
        assert live.core.fibers_running() == 0
    await assert_all_stopped(site, "fiberd_shutdown")
    assert [p for p in cgroup_root.iterdir() if p.is_dir()] == []


@pytest.mark.machine_may_lack("a writable cgroup2 hierarchy")
@aio
async def test_shutdown_kills_fibers_that_ignore_sigterm_and_still_reports_each_exit(
        site: Site, cgroup_root: Path) -> None:
    # More fibers than one slot group holds: after the grace one cgroup.kill of the grant's
    # fibers takes them all, and the template (not under it) reaps and reports each.
    many = SLOTS_PER_GROUP + 50
    site.drop()
    async with running_fiberd(site, cgroup_root=str(cgroup_root)) as live:
        await warm(live)
        views = [await live.clone(target=f"{T}:ignore_term_and_sleep", args=(600,))
                 for _ in range(many)]
        outs = [v.fiber.stdout_path for v in views]
        # Each has set SIGTERM aside (it says so once it has).
        await until(lambda: all(p.is_file() and p.read_text() == "ignoring\n" for p in outs),
                    within=60)
        assert len(list(cgroup_root.glob("grant-*/fibers/group-*"))) >= 2
        await live.core.shutdown()
        assert live.core.fibers_running() == 0
    ended = exits(site)
    assert len(ended) == many and len({e["fiber"] for e in ended}) == many
    for end in ended:
        record = end["exit"]
        assert isinstance(record, dict)
        assert record["state"] == "exited" and record["signal"] == signal.SIGKILL
        assert record["reason"]["code"] == "fiberd_shutdown"  # type: ignore[index]
        assert "killed after" in record["reason"]["message"]  # type: ignore[index]
    await until(lambda: marked_procs(site.mark) == [])
    assert [p for p in cgroup_root.iterdir() if p.is_dir()] == []


@pytest.mark.machine_may_lack("a writable cgroup2 hierarchy")
@aio
async def test_a_fiber_that_left_the_fibers_cgroup_is_still_killed_at_shutdown(
        site: Site, cgroup_root: Path) -> None:
    # The grant's one cgroup.kill misses it; its own SIGKILL (pidfd, group) does not.
    site.drop()
    async with running_fiberd(site, cgroup_root=str(cgroup_root)) as live:
        await warm(live)
        template = str(cgroup_root / "grant-g1" / "template")
        view = await live.clone(target="tests.core.runtime.targetkit:escape", args=(template, 600))
        out = view.fiber.stdout_path
        await until(lambda: out.is_file() and out.read_text() == "moved\n")
        await live.core.shutdown()
    [end] = exits(site)
    record = end["exit"]
    assert isinstance(record, dict) and record["signal"] == signal.SIGKILL
    await until(lambda: marked_procs(site.mark) == [])
    assert [p for p in cgroup_root.iterdir() if p.is_dir()] == []


@pytest.mark.machine_may_lack("a writable cgroup2 hierarchy")
@aio
async def test_slot_groups_go_once_their_leaves_are_gone(cgroup_root: Path) -> None:
    mgr = CgroupManager(cgroup_root)
    grant = mgr.carve_grant("g", Limits())
    assert grant is not None
    pool = LeafPool(grant)
    leaves = [await pool.take(str(n)) for n in range(2 * SLOTS_PER_GROUP + 10)]
    groups = {leaf.parent for leaf in leaves if leaf is not None}
    assert len(groups) == 3 and all(g.parent == grant.fibers for g in groups)
    for leaf in leaves:
        assert leaf is not None
        pool.give_back(leaf, None, None, keep=False, limit=1)
    await pool.settle()
    # Every leaf is gone, and every group but the one new leaves still go in.
    assert [p.name for p in cgroup_dirs(grant.fibers)] == [max(groups).name]
    await mgr.remove_grant("g")
    assert cgroup_dirs(cgroup_root) == []


@aio
async def test_a_leaf_is_kept_for_the_next_spare_only_while_bare(cgroup_root: Path) -> None:
    """An ended fiber's leaf goes to the next spare; one the fiber made sub-cgroups in (it
    may: its leaf is its own) or that is gone is not kept."""
    mgr = CgroupManager(cgroup_root)
    grant = mgr.carve_grant("g", Limits())
    assert grant is not None
    pool = LeafPool(grant)
    bare, nested, gone = [await pool.take(str(n)) for n in range(3)]
    assert bare is not None and nested is not None and gone is not None
    (nested / "mine").mkdir()
    gone.rmdir()
    for leaf in (nested, gone, bare):
        pool.give_back(leaf, None, None, keep=True, limit=8)
    assert await pool.take("next") == bare  # the only one kept
    assert await pool.take("after") not in (nested, gone)
    await pool.settle()
    assert not nested.exists()  # removed, sub-cgroup and all
    await mgr.remove_grant("g")


@aio
async def test_deadlines_fire_in_order_on_one_timer(site: Site) -> None:
    clock = FakeClock()
    mark = site.mark
    t = await warm_template(site.root, mark, preload=(T,), clock=clock)
    await clock.settle()
    idle = clock.sleepers  # the template's stall guard
    timer = DeadlineTimer(clock, grace=5)
    order = [4, 1, 3, 2]  # seconds from now, as fibers are added
    fibers: list[Fiber] = []
    ended: list[str] = []
    for i, after in enumerate(order):
        fiber = await t.fork(FiberRequest(id=f"f{i}", target=f"{T}:sleep", args=(600,)))
        fiber.on_done(lambda f: ended.append(f.id))
        due = clock.mono() + after
        timer.add(fiber, lambda due=due: due)
        fibers.append(fiber)
    late = await t.fork(FiberRequest(id="late", target=f"{T}:sleep", args=(600,)))
    moved: dict[str, float | None] = {"at": None}  # no deadline until rearmed
    timer.add(late, lambda: moved["at"])
    await clock.settle()
    assert clock.sleepers == idle + 1  # five fibers, one timer
    assert len(timer) == 5
    for second in range(1, 5):
        await clock.advance_and_settle(1)
        await until(lambda second=second: len(ended) == second)
    assert ended == ["f1", "f3", "f2", "f0"]  # deadline order, not insertion order
    # The passes the clock won left no wait on the timer's event behind (with only "late"
    # left, which has no deadline, the timer awaits its event in its own task).
    assert not [task for task in asyncio.all_tasks()
                if task.get_coro().__qualname__ == "Event.wait"]  # type: ignore[union-attr]
    assert late.running and len(timer) == 1
    await clock.advance_and_settle(100)
    assert late.running  # None: never due without a rearm
    moved["at"] = clock.mono() - 1  # a lease ended early
    timer.rearm()
    end = await late.wait()
    assert end.stopped and end.signal == signal.SIGTERM and len(timer) == 0
    timer.close()
    await stop_on_fake_clock(t, clock)
    assert marked_procs(mark) == []


def test_a_pidfd_above_fd_setsize_reads_as_running_until_its_process_exits() -> None:
    pid = os.fork()
    if pid == 0:
        signal.pause()
        os._exit(0)
    pidfd = os.pidfd_open(pid)
    high = os.dup2(pidfd, 1500)  # above FD_SETSIZE (1024), as with ~500 fibers
    try:
        assert not pidfd_exited(high)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert pidfd_exited(high)
    finally:
        os.close(high)
        os.close(pidfd)



@aio
async def test_grants_delivered_at_once_are_all_saved_and_cloned_from(site: Site) -> None:
    uids = [f"g{i}" for i in range(20)]
    for uid in uids:
        site.drop(uid)
    async with running_fiberd(site) as live:
        for uid in uids:
            await warm(live, uid)
        saved = json.loads((site.state / "grantbook.json").read_text())
        assert sorted(saved["tokens"]) == sorted(uids)
        assert not live.core.book.unsaved
        view = await live.clone("g19", argv=("true",))
        assert (await view.fiber.wait()).exit_code == 0  # type: ignore[union-attr]
