"""Slurm's cgroup v1 layout: where a job's groups are on a node, for the epilog to clear.

Slurm's cgroup/v1 plugin (22.05 through 24.x) builds, at the root of each v1
hierarchy it is given (``<CgroupMountpoint>/<controller>``, cgroup.conf,
default /sys/fs/cgroup)::

    <mount>/<prefix>/uid_<uid>/job_<id>/step_<step>[/task_<k>]

where ``<prefix>`` is ``slurm``, or ``slurm_<nodename>`` when slurmd is built
with multiple-slurmd support (Debian's is). ``uid_<uid>`` and ``job_<id>`` are
root's; the step and task groups are chowned to the job user, who may make
groups below them (a job's fiberd carves its own there, core.cgroups'
v1 backend). Slurm signals and waits only for the processes listed directly
in a step's group, and cannot remove a step group that still has children,
so what a fiberd that died left below its step outlives the job unless the
epilog clears it.

``job_groups`` finds a finished job's groups from the node's cgroup.conf (next
to ``SLURM_CONF``, which slurmd sets): every name on the way is root's (the
mount point, the prefix, ``uid_<uid>``, ``job_<id>``), and a cgroup file system
holds no symbolic links, so nothing a job user can replace is followed.
Reads only; never raises for a missing file (an unreadable cgroup.conf reads as
Slurm's defaults).
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MOUNTPOINT = Path("/sys/fs/cgroup")
MAX_CONF = 1 << 16


def read_cgroup_conf(slurm_conf: Path) -> dict[str, str]:
    """cgroup.conf next to ``slurm_conf`` as {lowercased key: value}; {} when unreadable."""
    try:
        text = (slurm_conf.parent / "cgroup.conf").read_text(errors="replace")[:MAX_CONF]
    except OSError:
        return {}
    conf: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("#")[0].strip().partition("=")
        if sep:
            conf[key.strip().lower()] = value.strip()
    return conf


def job_groups(slurm_conf: str | None, node: str, uid: int, job_id: int) -> list[Path]:
    """The existing v1 groups of job ``job_id`` of user ``uid`` on ``node``, one per
    hierarchy (sorted); [] when the node runs cgroup/v2 or Slurm made none."""
    conf = read_cgroup_conf(Path(slurm_conf)) if slurm_conf else {}
    if conf.get("cgroupplugin", "").lower() == "cgroup/v2":
        return []
    mountpoint = Path(conf.get("cgroupmountpoint") or DEFAULT_MOUNTPOINT)
    try:
        hierarchies = sorted(p for p in mountpoint.iterdir()
                             if p.is_dir() and not p.is_symlink())
    except OSError:
        return []
    found = []
    for hierarchy in hierarchies:
        if not (hierarchy / "tasks").is_file():  # a v1 hierarchy (cgroup2 has no tasks file)
            continue
        for prefix in (f"slurm_{node}", "slurm"):
            job = hierarchy / prefix / f"uid_{uid}" / f"job_{job_id}"
            if job.is_dir():
                found.append(job)
    return found
