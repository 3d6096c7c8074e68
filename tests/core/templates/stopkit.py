"""Fibers that make a stop take its whole course, for the stopping and exit-reason tests.

``ignoring_fiber`` forks a fiber (``targetkit:ignore_term_and_sleep``) that ignores
SIGTERM and returns it only once the fiber has said so: a stop sent afterwards meets a
fiber already ignoring SIGTERM, which only the SIGKILL after the grace ends.
"""

from __future__ import annotations

import os

from slurm_fiber.core.fibers.fiber import Fiber
from slurm_fiber.core.templates.parent import FiberRequest, Template
from tests.core.processkit import read_line

T = "tests.core.templates.targetkit"


async def ignoring_fiber(t: Template, fid: str, epoch: int = 0) -> Fiber:
    """A fiber that ignores SIGTERM, returned once it has said so."""
    out_r, out_w = os.pipe()
    fiber = await t.fork(FiberRequest(id=fid, target=f"{T}:ignore_term_and_sleep", args=(60,),
                                      epoch=epoch, stdio=(None, out_w, None)))
    os.close(out_w)
    said = await read_line(out_r)
    os.close(out_r)
    assert said == b"ignoring\n"
    return fiber
