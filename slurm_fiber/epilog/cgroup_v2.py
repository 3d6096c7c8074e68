"""After a job on a cgroup/v2 node: remove what its fiberd carved below Slurm's step cgroups.

Slurm's cgroup/v2 plugin removes a step's directories non-recursively, so the cgroups a
job user's fiberd made below its task cgroup (delegated by the SPANK plugin,
contrib/spank) keep the task, step and job directories alive after the job. The epilog
finds the job's directory in slurmd's cgroup2 view::

    <mount>/system.slice/[<node>_]slurmstepd.scope/<job_<id> | the job's SLUID>

where every name is root's (checked: the mount, system.slice, the scope and the job
directory; a cgroup file system has no symbolic links and none is followed), kills
whatever still runs below each ``step_*/user/task_*`` directory (``cgroup.kill``: the
job's processes only, never Slurm's, which live in ``step_*/slurm``), waits a bounded
time for them to go, and removes every empty directory below the job's, deepest first,
then the job's own. A directory still busy stays and is named. Nothing is written but
``cgroup.kill`` files below the job's task directories, and nothing is made. Which
directories are the job's is this module's (Slurm's layout); the killing, waiting and
removing are core/cgroups/teardown.py's, bounded in time, number and depth.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_fiber.core.cgroups import teardown
from slurm_fiber.core.cgroups.v2 import cgroup2_mount
from slurm_fiber.homes.slurm.jobenv import SlurmJob

if TYPE_CHECKING:
    from slurm_fiber.hooks.hook import Hook


def _root_dir(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == 0


def job_dir(mount: Path | None, job: SlurmJob) -> Path | None:
    """The job's directory in Slurm's cgroup/v2 tree on this node, or None (no cgroup2
    mount, no Slurm scope, no such directory, or a name on the way that is not root's)."""
    if mount is None or not _root_dir(mount) or not _root_dir(mount / "system.slice"):
        return None
    names = [f"job_{job.job_id}"] + ([job.sluid] if job.sluid else [])
    for scope in (f"{job.node}_slurmstepd.scope", "slurmstepd.scope"):
        base = mount / "system.slice" / scope
        if not _root_dir(base):
            continue
        for name in names:
            if _root_dir(base / name):
                return base / name
    return None


def _carved(job: Path) -> list[Path]:
    """The directories right below the job's task directories: what the job made."""
    found: list[Path] = []
    with contextlib.suppress(OSError):
        for step in sorted(job.iterdir()):
            if not step.name.startswith("step_") or not _root_dir(step):
                continue
            with contextlib.suppress(OSError):
                for task in sorted((step / "user").iterdir()):
                    if task.name.startswith("task_") and not task.is_symlink():
                        found += [c for c in task.iterdir()
                                  if c.is_dir() and not c.is_symlink()]
    return found


def clear(mount: Path | None, job: SlurmJob, wait_s: float) -> tuple[int, list[str]]:
    """Kill what runs in the job's carved cgroups, wait up to half of ``wait_s`` for them
    to empty, remove every empty directory of the job's (its own last) within the rest.
    How many were removed, and one line per directory left (none when the job has no
    directory)."""
    top = job_dir(mount, job)
    if top is None:
        return 0, []
    carved = _carved(top)
    start = time.monotonic()
    teardown.kill_each(carved)
    teardown.wait_empty(carved, start + wait_s / 2)
    removed, left = teardown.remove_tree(top, start + wait_s)
    return removed, left[:5]


def run(hook: Hook, job: SlurmJob, wait_s: float) -> bool:
    """The epilog's ``cgroup_v2`` step: ``clear`` in slurmd's cgroup2 view, a note of what
    was removed, a report naming what was left. True when nothing was left."""
    mount = cgroup2_mount(Path("/proc/self/mountinfo").read_text())
    removed, left = clear(mount, job, wait_s)
    if removed:
        hook.note("cgroup_v2", f"removed {removed} cgroup(s) of job {job.job_id} left in "
                               "Slurm's cgroup/v2 tree")
    if left:
        hook.report("cgroup_v2", "left busy: " + "; ".join(left))
    return not left
