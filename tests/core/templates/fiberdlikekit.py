"""A small stand-in for fiberd, run as its own process by test_fiberd_death.

Usage: python -m tests.core.templates.fiberdlikekit STATE_DIR MARK [CGROUP_ROOT]
Starts a template, forks three fibers (call mode, exec mode, and an exec
whose shell has children of its own), waits for the template's spare to be
back, prints one JSON line of pids and fiber cgroup leaves, then waits to be
killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from slurm_fiber.core.cgroups.manager import CgroupManager
from slurm_fiber.core.templates.parent import FiberRequest
from slurm_fiber.core.trust.grant import Limits
from tests.core.processkit import warm_template


async def main(state: Path, mark: str, root: Path | None) -> None:
    mgr = CgroupManager(root)
    grant = mgr.carve_grant("g", Limits())
    t = await warm_template(state, mark, preload=("tests.core.templates.targetkit",), cgroup=grant)
    fibers = [
        await t.fork(FiberRequest(id="call", target="tests.core.templates.targetkit:sleep",
                                  args=(60,))),
        await t.fork(FiberRequest(id="exec", mode="exec", argv=("sleep", "60"))),
        await t.fork(FiberRequest(id="tree", mode="exec",
                                  argv=("sh", "-c", "sleep 60 & sleep 60 & wait"))),
    ]
    while not t.idle_spares:
        await asyncio.sleep(0.01)
    print(json.dumps({"template": t.pid, "fibers": [f.pid for f in fibers],
                      "spares": t.idle_spares,
                      "leaves": [f.cgroup.name for f in fibers if f.cgroup]}), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2],
                     Path(sys.argv[3]) if len(sys.argv) > 3 else None))
