"""The cgroup v2 subtree a Slurm job's fiberd may carve, or why it has none.

In order of preference:

1. the subtree the prolog delegated to the job, recorded as one absolute
   path in the job's state dir (``JobPaths.cgroup_file``). It must be a
   cgroup directory under the cgroup2 mount, writable by this process, and,
   when it lies inside Slurm's tree, inside this job's cgroup. A record that
   fails any check gives no root (with the reason); it is never bypassed.
   It is refused (``delegation_refused``, the reason kept in front of the
   choice that follows) when fiberd runs in a Slurm job cgroup and the
   subtree lies outside it (fibers would leave the job's confinement), or
   when the kernel would not let fiberd move processes into it (no write
   access to the common ancestor's ``cgroup.procs``): never a root fiberd
   cannot use.
2. fiberd's own cgroup, when it is one of this job's step (or task) cgroups
   in Slurm's layout (cgroup_layout) and writable: fiberd first moves
   itself into a leaf (``fiberd``) below it, so the subtree holds no
   process directly, and refuses when other processes share the cgroup.
   It never takes the job's cgroup itself or anything above it.
3. none, with a reason a person can act on (e.g. proctrack/linuxproc puts
   steps in slurmd's own cgroup, which is not the job's to carve).

On a cgroup v1 or hybrid node (Slurm's cgroup/v1 plugin) the v2 tree holds
no job cgroup, so this gives none, and the core's v1 backend (core.cgroups,
``cgroup_backend`` auto) carves below fiberd's own v1 groups, which are the
job's step (freezer) and task (memory, devices) groups, given to the job user
by Slurm; the epilog clears what a dead fiberd leaves there (cgroup_v1).

Decisions read the tree under an injected mount and /proc, so tests build
the tree themselves; only ``enter_leaf`` writes (mkdir and one pid).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from slurm_fiber.core.cgroups.common import join
from slurm_fiber.homes.slurm.cgroup_layout import SlurmCgroup, cgroup_of_pid, parse_cgroup_path
from slurm_fiber.homes.slurm.jobenv import SlurmParseError

LEAF = "fiberd"
MAX_RECORD = 4096


@dataclass(frozen=True)
class CgroupChoice:
    """The root fiberd may carve (None: no carving) and a one-line reason for the choice."""

    path: Path | None
    reason: str


def _writable_cgroup(path: Path) -> str | None:
    """Why ``path`` is not a cgroup directory this process can carve; None when it is."""
    if not path.is_dir():
        return f"{path} is not a directory"
    if not (path / "cgroup.procs").exists():
        return f"{path} is not a cgroup (no cgroup.procs)"
    if not (os.access(path, os.W_OK) and os.access(path / "cgroup.procs", os.W_OK)):
        return f"{path} is not writable by uid {os.geteuid()}"
    return None


def _other_job(where: SlurmCgroup | None, job_id: int, sluid: str | None) -> str | None:
    """Why a cgroup inside Slurm's tree is not this job's; None when it is (or is outside).

    A SLUID-named job directory (Slurm 26.05) is this job's only when it is the job's
    own SLUID (SLURM_JOB_SLUID); without one, it is never taken.
    """
    if where is None or where.job_id == job_id:
        return None
    if where.job_id is None:
        if sluid is not None and where.sluid == sluid:
            return None
        known = f"job {job_id}'s SLUID is {sluid}" if sluid else f"job {job_id} has no SLUID"
        return f"it is in job cgroup {where.job_dir} (a SLUID), and {known}"
    return f"it belongs to job {where.job_id}, not {job_id}"


def delegated_root(record: Path, mount: Path, job_id: int,
                   sluid: str | None = None) -> CgroupChoice | None:
    """The subtree the prolog recorded in ``record``; None when there is no record.

    ``sluid`` is the job's SLUID, if it has one. Blocks on small reads. A bad record
    gives ``CgroupChoice(None, reason)``.
    """
    try:
        text = record.read_text(errors="replace")[:MAX_RECORD].strip()
    except FileNotFoundError:
        return None
    except OSError as err:
        return CgroupChoice(None, f"delegated cgroup record {record}: {err.strerror}")
    path = Path(text)
    real, real_mount = Path(os.path.realpath(path)), Path(os.path.realpath(mount))
    if not path.is_absolute() or real == real_mount or real_mount not in real.parents:
        return CgroupChoice(None, f"delegated cgroup {text[:200]!r} in {record} is not a cgroup "
                                  f"below the cgroup2 mount {mount}")
    problem = _other_job(parse_cgroup_path(real.relative_to(real_mount)), job_id, sluid)
    problem = problem and f"delegated cgroup {real}: {problem}"
    problem = problem or _writable_cgroup(real)
    if problem:
        return CgroupChoice(None, problem)
    return CgroupChoice(real, f"the subtree the prolog delegated ({record})")


def own_root(mount: Path, job_id: int, pid: int, proc: Path = Path("/proc"),
             sluid: str | None = None) -> CgroupChoice:
    """Process ``pid``'s own cgroup when it is this job's step cgroup and writable.

    The job is ``job_id`` and, on Slurm 26.05+, ``sluid`` (its cgroup's name).
    Reads /proc/<pid>/cgroup and stats the tree; never writes, never raises.
    """
    try:
        relative = cgroup_of_pid(pid, proc)
    except (OSError, SlurmParseError) as err:
        return CgroupChoice(None, f"own cgroup unknown: {err}")
    where = parse_cgroup_path(relative)
    if where is None:
        return CgroupChoice(None, f"own cgroup {relative} is not a Slurm job cgroup "
                                  "(proctrack/linuxproc or no cgroup/v2 plugin): not carving")
    problem = _other_job(where, job_id, sluid)
    if problem:
        return CgroupChoice(None, f"own cgroup {relative}: {problem}")
    if where.step is None:
        return CgroupChoice(None, f"own cgroup {relative} is the job's cgroup, which Slurm "
                                  "manages: only a step's may be carved")
    path = mount / relative.relative_to("/")
    problem = _writable_cgroup(path)
    if problem:
        return CgroupChoice(None, f"own cgroup: {problem}")
    return CgroupChoice(path, f"own cgroup ({where.job_dir}, step {where.step})")


def enter_leaf(root: Path, pid: int) -> None:
    """Move ``pid`` into the leaf ``root``/fiberd (created if missing). Blocks; raises OSError."""
    leaf = root / LEAF
    leaf.mkdir(mode=0o755, exist_ok=True)
    join(leaf, pid)


def _sharers(root: Path, pid: int) -> list[str]:
    """Pids other than ``pid`` still listed directly in ``root``'s cgroup.procs."""
    listed = (root / "cgroup.procs").read_text().split()
    return [p for p in listed if p != str(pid)]


def delegation_refused(path: Path, mount: Path, pid: int, proc: Path = Path("/proc")) -> str | None:
    """Why fiberd ``pid`` must not carve the delegated subtree ``path``; None when it may.

    Refused when ``pid`` runs inside a Slurm job cgroup and ``path`` lies outside that
    job's directory (its fibers would leave the job's limits and devices), and when the
    kernel would not let ``pid`` move processes into ``path``: a move needs write access
    to ``cgroup.procs`` of the common ancestor of where they are and ``path``. Reads
    /proc and stats the tree; never writes, never raises.
    """
    try:
        own = cgroup_of_pid(pid, proc)
    except (OSError, SlurmParseError) as err:
        return f"delegated cgroup {path} refused: own cgroup unknown ({err})"
    where = parse_cgroup_path(own)
    if where is not None:
        job = mount / where.job_path
        if path != job and job not in path.parents:
            return (f"delegated cgroup {path} refused (delegate_cgroup): it lies outside this "
                    f"job's cgroup {job}, where Slurm confines the job's devices and limits")
    here = mount / own.relative_to("/")
    common = Path(os.path.commonpath([here, path]))
    if not os.access(common / "cgroup.procs", os.W_OK):
        return (f"delegated cgroup {path} refused (delegate_cgroup): fiberd in {here} could "
                f"not move processes there (the kernel needs write access to "
                f"{common}/cgroup.procs, the common ancestor's)")
    return None


def choose_cgroup_root(record: Path, mount: Path | None, job_id: int, pid: int,
                       proc: Path = Path("/proc"), sluid: str | None = None) -> CgroupChoice:
    """Decide (and, for the own cgroup, prepare) the root of job ``job_id``'s fiberd ``pid``.

    Called once by the Slurm home's builder; blocks on small file I/O and
    never raises. ``mount`` is the cgroup2 mount (None: there is none);
    ``sluid`` the job's SLUID (Slurm 26.05+), which names its cgroup there.
    """
    if mount is None:
        return CgroupChoice(None, "no cgroup2 mount on this node")
    delegated = delegated_root(record, mount, job_id, sluid)
    refused = None
    if delegated is not None and delegated.path is not None:
        refused = delegation_refused(delegated.path, mount, pid, proc)
    if delegated is not None and refused is None:
        return delegated
    choice = own_root(mount, job_id, pid, proc, sluid)
    if refused is not None:
        choice = CgroupChoice(choice.path, f"{refused}; {choice.reason}")
    if choice.path is None:
        return choice
    try:
        enter_leaf(choice.path, pid)
        sharers = _sharers(choice.path, pid)
    except OSError as err:
        return CgroupChoice(None, f"cannot move into {choice.path / LEAF}: {err.strerror}")
    if sharers:
        shown = " ".join(sharers[:5])
        return CgroupChoice(None, f"{choice.path} is shared with other processes ({shown}): "
                                  "not carving")
    return choice
