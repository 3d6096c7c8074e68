"""Where the Slurm home publishes readiness: a file in the job's state dir, and the job's Comment.

The file (``ready.json``, replaced atomically) is authoritative: only the
job's own fiberd writes it. The Comment (`scontrol update JobId=N
Comment=...`, opt-in) is a convenience for people and tools reading
`squeue`: the job's user can overwrite it at any time, so nothing should
trust it. The file is written first; a Comment that fails raises after the
file holds the new state, so the gate retries both (rewriting the file is
harmless).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from slurm_fiber.core.clock import Clock
from slurm_fiber.homes.readyfile import writer
from slurm_fiber.homes.slurm.control import ControlPlane
from slurm_fiber.safefs import replace_file

COMMENT_READY = "slurm-fiber: ready"
COMMENT_NOT_READY = "slurm-fiber: not ready"


def ready_document(job_id: int, warm: list[str], wall: float) -> dict[str, object]:
    """The JSON the ready file holds: the job, whether any template is warm, which, and when."""
    return {"job_id": job_id, "ready": bool(warm), "warm": warm, "updated": wall,
            **writer()}  # readers check it is alive (homes/readyfile.py read_ready)


class ReadyPublisher:
    """A ReadyGate ``publish`` for one job: the file always, the Comment when ``control`` is set.

    Called by the gate on fiberd's loop; blocks its task on the file write
    (in a thread) and the `scontrol update`. Raises OSError or the control
    plane's error.
    """

    def __init__(self, job_id: int, ready_file: Path, clock: Clock,
                 control: ControlPlane | None = None) -> None:
        self.job_id = job_id
        self.ready_file = ready_file
        self.clock = clock
        self.control = control

    async def __call__(self, warm: list[str]) -> None:
        doc = ready_document(self.job_id, warm, self.clock.wall())
        data = (json.dumps(doc, sort_keys=True) + "\n").encode()
        await asyncio.to_thread(replace_file, self.ready_file, data)
        if self.control is not None:
            comment = COMMENT_READY if warm else COMMENT_NOT_READY
            await self.control.set_comment(self.job_id, comment)
