"""The end of a batch job seen on its node: the batch script's cgroup empties (cgroup/v2).

A fiberd that carves below its own step's task cgroup has moved itself into a leaf of its
own, where Slurm's SIGTERM at the job's end no longer reaches it (Slurm signals the
processes listed directly in a task cgroup). The Slurm home learns the end from
slurmctld (its health poll, every few seconds) and, on a cgroup/v2 node, at once from
the job's batch step: Slurm ends a batch job when its script exits, and then the batch
step's ``user`` cgroup (the script and every process it started) empties. ``batch_user``
names that cgroup for fiberd's carving root (a ``.../step_<n>/user/task_<k>`` path);
``wait_batch_end`` returns once it was seen populated and then empty or gone.

An interactive (salloc) job has no batch step: there, as on cgroup v1 nodes (where fiberd
stays in its step's freezer group and Slurm's signal reaches it), the health poll alone
tells the end. Reads only ``cgroup.events`` (world-readable, root's), never writes.
"""

from __future__ import annotations

from pathlib import Path

from slurm_fiber.core.cgroups.v2 import events_populated
from slurm_fiber.core.clock import Clock

POLL_S = 0.2


def batch_user(root: Path | None) -> Path | None:
    """``<job dir>/step_batch/user`` for a carving root ``<job dir>/step_<n>/user/task_<k>``
    in Slurm's cgroup/v2 layout, else None. Pure."""
    if root is None or not root.name.startswith("task_") or root.parent.name != "user" \
            or not root.parent.parent.name.startswith("step_"):
        return None
    return root.parents[2] / "step_batch" / "user"


async def wait_batch_end(group: Path, clock: Clock, poll_s: float = POLL_S) -> str:
    """Return a scope-loss reason once ``group`` was seen populated and then is empty or
    gone; never returns for a group never seen populated (an interactive job's)."""
    seen = False
    while True:
        now = events_populated(group)
        if now:
            seen = True
        elif seen:
            return "the job's batch script ended (its cgroup step_batch emptied)"
        elif now is None and not seen:
            await clock.sleep(poll_s * 25)  # no batch step (yet): look again, rarely
            continue
        await clock.sleep(poll_s)
