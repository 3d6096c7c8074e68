"""Spares: fiber processes a ready template forks ahead, already in their own cgroup leaves.

A Clone hands an idle spare its order (no fork, no cgroup move on its path)
and a replacement is forked behind it, into an ended fiber's leaf when one
is free; with ``spares=0`` each Clone makes its spare on the spot. A spare
killed from outside never costs a Clone, and a stopped template leaves no
spare process or leaf behind. A template not asked to fork for ``spares_idle``
clock seconds dismisses its spares until its next fork.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from slurm_fiber.core.cgroups.common import populated
from slurm_fiber.core.cgroups.manager import CgroupManager
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.templates.parent import FiberRequest
from slurm_fiber.core.trust.grant import Limits
from tests.core.processkit import (
    aio,
    cgroup_dirs,
    idle_spares,
    marked_procs,
    stop_on_fake_clock,
    unified_cgroup,
    wait_dead,
    warm_template,
)

T = "tests.core.templates.targetkit"


@aio
async def test_a_clone_takes_the_idle_spare_in_its_own_leaf_and_a_new_one_follows(
        tmp_path: Path, mark: str, cgroup_root: Path):
    mgr = CgroupManager(cgroup_root)
    grant = mgr.carve_grant("g", Limits())
    assert grant is not None
    t = await warm_template(tmp_path, mark, preload=(T,), cgroup=grant)
    [spare] = await idle_spares(t)
    # Forked in the template's leaf, it moves to its own before it reads any order.
    end = time.monotonic() + 10
    while (leaf := unified_cgroup(spare)).endswith("/template") and time.monotonic() < end:
        await asyncio.sleep(0.01)
    assert leaf.startswith(f"/{cgroup_root.name}/grant-g/fibers/group-")
    assert leaf.rpartition("/")[2].startswith("slot-")
    assert unified_cgroup(t.pid) == f"/{cgroup_root.name}/grant-g/template"
    assert t.fibers == {} and t.to_json()["spares"] == 1  # a spare is not a fiber

    fiber = await t.fork(FiberRequest(id="f1", target=f"{T}:add", args=(2, 3)))
    assert fiber.pid == spare and fiber.cgroup is not None
    assert f"/{cgroup_root.name}/{fiber.cgroup.relative_to(cgroup_root)}" == leaf
    end = await fiber.wait()
    assert end.exit_code == 0 and end.result == {"ok": True, "result": 5}
    [after] = await idle_spares(t)
    assert after != spare and unified_cgroup(after) not in ("", leaf)

    # The ended fiber's leaf is empty and kept: the spare made behind the next Clone
    # goes into it (no cgroup created or removed).
    assert fiber.cgroup.is_dir() and not populated(fiber.cgroup)
    second = await t.fork(FiberRequest(id="f2", target=f"{T}:add", args=(1, 1)))
    assert second.pid == after and (await second.wait()).exit_code == 0
    [third] = await idle_spares(t)
    end_by = time.monotonic() + 10
    while unified_cgroup(third) != leaf and time.monotonic() < end_by:
        await asyncio.sleep(0.01)
    assert unified_cgroup(third) == leaf
    await t.stop(1.0)
    await mgr.remove_grant("g")
    assert marked_procs(mark) == [] and cgroup_dirs(cgroup_root) == []


@aio
async def test_without_spares_each_clone_forks_its_own_on_the_spot(tmp_path: Path, mark: str):
    t = await warm_template(tmp_path, mark, preload=(T,), spares=0)
    assert await idle_spares(t, 0) == []
    for i in range(3):
        fiber = await t.fork(FiberRequest(id=f"f{i}", target=f"{T}:add", args=(i, 1)))
        assert (await fiber.wait()).result == {"ok": True, "result": i + 1}
    assert t.idle_spares == [] and sorted(marked_procs(mark)) == [t.pid]
    await t.stop(1.0)
    assert marked_procs(mark) == []


@aio
async def test_an_idle_spare_killed_from_outside_does_not_cost_a_clone(
        tmp_path: Path, mark: str, cgroup_root: Path):
    mgr = CgroupManager(cgroup_root)
    grant = mgr.carve_grant("g", Limits())
    t = await warm_template(tmp_path, mark, preload=(T,), cgroup=grant)
    [spare] = await idle_spares(t)
    os.kill(spare, signal.SIGKILL)
    assert wait_dead(spare)  # without yielding: fiberd has not heard of it yet
    fiber = await t.fork(FiberRequest(id="f1", target=f"{T}:add", args=(1, 1)))
    assert fiber.pid != spare
    assert (await fiber.wait()).result == {"ok": True, "result": 2}
    await idle_spares(t)
    await t.stop(1.0)
    await mgr.remove_grant("g")  # (fails if any spare's leaf were left)
    assert marked_procs(mark) == [] and cgroup_dirs(cgroup_root) == []


@aio
async def test_spares_go_after_spares_idle_without_a_fork_and_come_back_with_one(
        tmp_path: Path, mark: str):
    clock = FakeClock()
    t = await warm_template(tmp_path, mark, preload=(T,), clock=clock, spares_idle=60.0)
    ran = await t.fork(FiberRequest(id="x1", mode="exec", argv=["true"], cwd="/"))
    assert (await ran.wait()).exit_code == 0
    [spare] = await idle_spares(t)
    await clock.advance_and_settle(59.0)
    assert not t.shed_idle_spares()  # cloned 59 s ago: recent enough
    await clock.advance_and_settle(1.0)
    assert t.shed_idle_spares()
    assert wait_dead(spare)
    assert t.idle_spares == [] and t.to_json()["spares"] == 0
    assert not t.shed_idle_spares()  # nothing left to dismiss
    fiber = await t.fork(FiberRequest(id="c1", target=f"{T}:add", args=(2, 3)))
    assert (await fiber.wait()).result == {"ok": True, "result": 5}  # forked on the spot
    assert len(await idle_spares(t)) == 1  # and kept again from this fork on
    await stop_on_fake_clock(t, clock)
    assert marked_procs(mark) == []

