"""The cgroup v2 subtree a site may delegate to each job (``delegate_cgroup = true``).

``job_cgroup`` says where the job's subtree is (the site's layout). The prolog
creates ``<parent>/<node>/job_<id>`` and delegates it to the job user the way the
kernel's cgroup v2 documentation describes (``core.cgroups.v2.delegate``: the
directory and its ``cgroup.procs``, ``cgroup.threads`` and ``cgroup.subtree_control``
are chowned), then records the path in the job's state dir
(``paths.cgroup_file``), where the Slurm home (cgroup_root) finds it. The
parent is the site's ``cgroup_parent``, default ``<cgroup2 mount>/slurm-fiber``.

A user can move processes into the subtree only from a cgroup whose common
ancestor with it the user may write; a root job always can. The epilog never
trusts the record (the job user owns the state dir): it recomputes the path
with ``job_cgroup`` and kills, waits for and removes exactly that subtree.
"""

from __future__ import annotations

from pathlib import Path

from slurm_fiber.core.cgroups.v2 import cgroup2_mount
from slurm_fiber.homes.slurm.siteconfig import SiteConfig

DEFAULT_PARENT = "slurm-fiber"
MOUNTINFO = Path("/proc/self/mountinfo")


def job_cgroup(config: SiteConfig, node: str, job_id: int,
               mountinfo: Path = MOUNTINFO) -> Path | None:
    """The job's delegated cgroup path, or None when delegation is off or there is no cgroup2.

    Reads /proc/self/mountinfo only when the site names no ``cgroup_parent``.
    """
    if not config.delegate_cgroup:
        return None
    parent = config.cgroup_parent
    if parent is None:
        mount = cgroup2_mount(mountinfo.read_text())
        if mount is None:
            return None
        parent = mount / DEFAULT_PARENT
    return parent / node / f"job_{job_id}"

