"""The batch script's cgroup emptying tells fiberd its job ended (Slurm's cgroup/v2 layout),
on a real cgroup2 tree with a real process standing in for the batch script."""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.core.clock import SystemClock
from slurm_fiber.homes.slurm.batchwatch import batch_user, wait_batch_end

CGROUP2 = Path("/sys/fs/cgroup/unified")


def test_the_batch_steps_cgroup_of_a_carving_root() -> None:
    job = Path("/sys/fs/cgroup/system.slice/n1_slurmstepd.scope/s7B1M90RT51P00")
    assert batch_user(job / "step_0/user/task_0") == job / "step_batch/user"
    assert batch_user(job / "step_0") is None
    assert batch_user(Path("/sys/fs/cgroup/unified/slurm-fiber/job_4")) is None
    assert batch_user(None) is None


@pytest.fixture
def batch() -> Iterator[Path]:
    if not os.access(CGROUP2 / "cgroup.procs", os.W_OK):
        pytest.skip(f"no writable cgroup v2 at {CGROUP2}")
    root = CGROUP2 / f"sf-test-{uuid.uuid4().hex[:8]}"
    group = root / "step_batch" / "user"
    group.mkdir(parents=True)
    yield group
    (root / "cgroup.kill").write_text("1\n")
    for path in (group, group.parent, root):
        for _ in range(200):
            try:
                path.rmdir()
                break
            except OSError:
                pass


def test_the_end_is_told_once_the_batch_script_is_gone(batch: Path) -> None:
    script = subprocess.Popen(["sleep", "300"])
    (batch / "cgroup.procs").write_text(f"{script.pid}\n")

    async def scenario() -> str:
        watch = asyncio.create_task(wait_batch_end(batch, SystemClock(), poll_s=0.02))
        await asyncio.sleep(0.3)
        assert not watch.done()  # the script still runs
        script.kill()
        script.wait()
        return await asyncio.wait_for(watch, 5)

    assert "batch script ended" in asyncio.run(scenario())


def test_a_job_without_a_batch_step_is_never_told(tmp_path: Path) -> None:
    async def scenario() -> bool:
        watch = asyncio.create_task(wait_batch_end(tmp_path / "none", SystemClock(), 0.01))
        await asyncio.sleep(0.3)
        done = watch.done()
        watch.cancel()
        return done

    assert asyncio.run(scenario()) is False
