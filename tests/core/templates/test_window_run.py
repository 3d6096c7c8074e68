"""A task window in a real template (core/templates/child/window_run.py): the template itself
starts no task at or after the window's deadline, whatever fiberd does, and reports what
it started and what ended; fiberd's side (core/templates/window_parent.py) reads it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from pathlib import Path

from slurm_fiber.core.cgroups.manager import CgroupManager
from slurm_fiber.core.fibers.fiber import ResultReader
from slurm_fiber.core.templates.parent import FiberRequest, Template
from slurm_fiber.core.templates.window_parent import Batch, WindowLink
from slurm_fiber.core.trust.grant import Limits
from tests.core.processkit import aio, warm_template


async def run_window(tmp_path: Path, mark: str, left: float, count: int) -> list[Batch]:
    t = await warm_template(tmp_path, mark)
    try:
        keys = [f"k{i}" for i in range(count)]
        link = WindowLink("w1", keys, [None] * count)
        tasks = [{"key": key, "order": t.run_order(FiberRequest(
            id=f"w1.{n}", mode="exec", argv=("sh", "-c", f"echo {key} >> {tmp_path}/ran")))}
            for n, key in enumerate(keys)]
        await t.open_window(link, link.order(1, left, None, tasks), [])
        batches = []
        while not batches or not batches[-1].done:
            batches.append(await asyncio.wait_for(link.batches.get(), 30))
            t.window_order("w1", "window_ack")  # as fiberd does once a batch is durable
        return batches
    finally:
        await t.stop(1)


@aio
async def test_the_template_starts_no_task_past_the_window_deadline(tmp_path: Path,
                                                                    mark: str) -> None:
    batches = await run_window(tmp_path, mark, 0.0, 3)  # due as it arrives
    assert [s for b in batches for s in b.starts] == []
    assert not (tmp_path / "ran").exists()


@aio
async def test_the_template_runs_a_window_one_at_a_time_and_reports_each(tmp_path: Path,
                                                                        mark: str) -> None:
    batches = await run_window(tmp_path, mark, 60.0, 3)
    starts = [s["key"] for b in batches for s in b.starts]
    ends = [e["key"] for b in batches for e in b.ends]
    assert starts == ["k0", "k1", "k2"] and sorted(ends) == starts  # type: ignore[type-var]
    assert (tmp_path / "ran").read_text().split() == starts


def open_sockets() -> list[int]:
    """The inodes of the sockets this process holds open (a call fiber's target)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                found.append(int(target[len("socket:["):-1]))
    return found


async def call_window(t: Template, orders: list[FiberRequest], size: int,
                      leaves: list[Path | None] | None = None
                      ) -> tuple[WindowLink, list[ResultReader], list[int]]:
    """Open a window of call ``orders`` in ``t``, each with its result channel as fiberd
    makes one; the link, fiberd's readers and the inodes of the fibers' ends."""
    keys = [f"k{n}" for n in range(len(orders))]
    link = WindowLink("w1", keys, leaves or [None] * len(orders))
    readers, theirs, inodes = [], [], []
    for _ in orders:
        ours, fiber_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        readers.append(ResultReader(ours))
        inodes.append(os.fstat(fiber_end.fileno()).st_ino)
        theirs.append(fiber_end)
    tasks = [{"key": key, "order": t.run_order(order), "result": True}
             for key, order in zip(keys, orders, strict=True)]
    try:
        await t.open_window(link, link.order(size, 60.0, None, tasks),
                            [s.fileno() for s in theirs])
    finally:
        for s in theirs:
            s.close()
    return link, readers, inodes


async def all_batches(t: Template, link: WindowLink) -> list[Batch]:
    batches = []
    while not batches or not batches[-1].done:
        batches.append(await asyncio.wait_for(link.batches.get(), 30))
        t.window_order(link.id, "window_ack")
    return batches


@aio
async def test_the_template_forks_each_call_task_into_its_leaf_and_its_record_comes_back(
        tmp_path: Path, mark: str, cgroup_root: Path) -> None:
    grant = CgroupManager(cgroup_root).carve_grant("g", Limits())
    t = await warm_template(tmp_path, mark, cgroup=grant)
    try:
        leaves = await t.window_leaves("w1", 3)
        orders = [FiberRequest(id=f"w1.{n}", mode="call", target="operator:mul",
                               args=(n, 7)) for n in range(2)]
        orders.append(FiberRequest(id="w1.2", mode="call",
                                   target="tests.core.runtime.targetkit:cgroups"))
        link, readers, _ = await call_window(t, orders, 2, list(leaves))
        batches = await all_batches(t, link)
        starts = [s for b in batches for s in b.starts]
        ends = [e for b in batches for e in b.ends]
        assert sorted(str(s["key"]) for s in starts) == ["k0", "k1", "k2"]
        assert {str(e["key"]): os.waitstatus_to_exitcode(int(e["status"]))  # type: ignore[call-overload]
                for e in ends} == {"k0": 0, "k1": 0, "k2": 0}
        records = [r.finish() for r in readers]
        assert records[:2] == [{"ok": True, "result": 0}, {"ok": True, "result": 7}]
        inside = str(records[2]["result"])  # type: ignore[index]
        assert leaves[2] is not None
        assert any(line.startswith("0::") and line.endswith(f"/{leaves[2].name}")
                   for line in inside.splitlines())  # k2 ran in the third leaf
    finally:
        await t.stop(1)


@aio
async def test_a_call_fiber_holds_no_other_tasks_result_channel(tmp_path: Path,
                                                                mark: str) -> None:
    t = await warm_template(tmp_path, mark)
    try:
        target = "tests.core.templates.test_window_run:open_sockets"
        orders = [FiberRequest(id=f"w1.{n}", mode="call", target=target) for n in range(3)]
        link, readers, inodes = await call_window(t, orders, 1)
        await all_batches(t, link)
        held = [set(r.finish()["result"]) for r in readers]  # type: ignore[index]
        for n, sockets in enumerate(held):
            assert inodes[n] in sockets  # its own channel
            assert not sockets & (set(inodes) - {inodes[n]}), n  # and no other task's
    finally:
        await t.stop(1)


@aio
async def test_a_close_queued_behind_another_order_is_read_before_a_killed_task_is_replaced(
        tmp_path: Path, mark: str) -> None:
    """fiberd sends ``window_close`` and then kills the window's fibers; the template may
    find the close queued behind an ack and the killed fiber's exit at once: it starts
    nothing more all the same."""
    t = await warm_template(tmp_path, mark)
    try:
        keys = ["k0", "k1"]
        link = WindowLink("w1", keys, [None, None])
        tasks = [{"key": key, "order": t.run_order(FiberRequest(
            id=f"w1.{n}", mode="exec", argv=("sleep", "30")))} for n, key in enumerate(keys)]
        await t.open_window(link, link.order(1, 60.0, None, tasks), [])
        first = await asyncio.wait_for(link.batches.get(), 30)
        assert [s["key"] for s in first.starts] == ["k0"]
        template = t.process.pid
        assert template is not None
        os.kill(template, signal.SIGSTOP)  # both orders and the exit wait for it at once
        try:
            t.window_order("w1", "window_ack")
            t.window_order("w1", "window_close")
            link.kill()
            await asyncio.sleep(0.3)
        finally:
            os.kill(template, signal.SIGCONT)
        batches = [first, *await all_batches(t, link)]
        assert [s["key"] for b in batches for s in b.starts] == ["k0"]  # k1 never started
        assert [e["key"] for b in batches for e in b.ends] == ["k0"]
    finally:
        await t.stop(1)
