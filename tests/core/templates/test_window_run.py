"""A task window in a real template (core/templates/child/window_run.py): the template itself
starts no task at or after the window's deadline, whatever fiberd does, and reports what
it started and what ended; fiberd's side (core/templates/window_parent.py) reads it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from slurm_fiber.core.templates.parent import FiberRequest
from slurm_fiber.core.templates.window_parent import Batch, WindowLink
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
