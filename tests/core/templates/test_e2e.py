"""End to end with real processes: a warm template of heavy stdlib modules, 100 fibers.

Each fiber reports (on its stdout file) that its modules are the very objects
the template imported (no re-import), that its parent is the template that
warmed, which cgroup it sits in (read from /proc/self/cgroup inside it) and
which device variables it sees; it exits with ``i % 5``. Afterwards nothing
is left: no process carrying the test's mark, no cgroup under the root.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from slurm_fiber.core.cgroups.manager import CgroupManager
from slurm_fiber.core.devices import Device, DeviceChannel
from slurm_fiber.core.templates.parent import FiberRequest
from slurm_fiber.core.trust.grant import Limits
from tests.core.processkit import aio, cgroup_dirs, marked_procs, warm_template
from tests.core.templates.targetkit import HEAVY

T = "tests.core.templates.targetkit"
N = 100


@pytest.mark.machine_may_lack("a writable cgroup2 hierarchy")
@aio
async def test_hundred_fibers_from_one_warm_template(tmp_path: Path, mark: str,
                                                    cgroup_root: Path):
    mgr = CgroupManager(cgroup_root)
    grant = mgr.carve_grant("job-7", Limits(memory=1 << 30, pids=500))
    assert grant is not None
    channel = DeviceChannel.of([Device("gpu", 0), Device("gpu", 2, uuid="GPU-2")])
    t = await warm_template(tmp_path, mark, preload=(*HEAVY, T), warm=f"{T}:warm",
                             cgroup=grant, channel=channel, uid="job-7")

    async def one(i: int):
        fiber = await t.fork(FiberRequest(id=f"f{i}", target=f"{T}:observe", args=(i,),
                                          jti="jti-1", epoch=3))
        return fiber, await fiber.wait()

    results = []
    for batch in range(0, N, 20):
        results += await asyncio.gather(*(one(i) for i in range(batch, batch + 20)))
    pids = set()
    for i, (fiber, ex) in enumerate(results):
        assert ex.exit_code == i % 5, (i, ex)
        seen = json.loads(fiber.stdout_path.read_text())
        assert seen["i"] == i and seen["fiber_id"] == f"f{i}"
        assert seen["warmed_by_parent"] and seen["same_modules"]
        assert seen["n_modules"] == len(HEAVY)
        assert fiber.cgroup is not None and fiber.cgroup.parent.parent == grant.fibers
        assert seen["cgroup"] == "/" + str(fiber.cgroup.relative_to(cgroup_root.parent))
        assert seen["env"] == {"CUDA_VISIBLE_DEVICES": "0,2", "NVIDIA_VISIBLE_DEVICES": "0,GPU-2",
                               "ROCR_VISIBLE_DEVICES": "0,2", "GPU_DEVICE_ORDINAL": "0,2",
                               "ZE_AFFINITY_MASK": "0,2"}
        record = fiber.to_json()
        assert (record["uid"], record["jti"], record["epoch"]) == ("job-7", "jti-1", 3)
        # Its stdout file has output and is named; its empty stderr file is removed.
        assert record["stdout"] == str(fiber.stdout_path) and record["stderr"] is None
        assert not (fiber.stdout_path.parent / f"fiber-f{i}.err").exists()
        assert ex.cpu_time is not None and ex.maxrss
        pids.add(fiber.pid)
    assert len(pids) == N and t.fibers == {}
    # Fibers running together never share a leaf; ended fibers' leaves are reused
    # or removed, so what remains besides the template's is a few spare slots.
    for batch in range(0, N, 20):
        assert len({fiber.cgroup for fiber, _ in results[batch:batch + 20]}) == 20
    # (Removals run in the background, in batches: wait for them to catch up.)
    for _ in range(500):
        kept = [d.name for d in cgroup_dirs(grant.fibers) if d.name.startswith("slot-")]
        if len(kept) <= 3:
            break
        await asyncio.sleep(0.02)
    assert len(kept) <= 3 and len(cgroup_dirs(grant.fibers)) - len(kept) <= 1  # one group
    await t.stop(1.0)
    await mgr.remove_grant("job-7")
    assert marked_procs(mark) == []
    assert cgroup_dirs(cgroup_root) == []
