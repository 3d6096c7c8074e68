"""Slurm's cgroup v2 layout: which job and step a cgroup belongs to, and where a job's cgroup is.

Slurm's cgroup/v2 plugin (22.05 through 25.x) builds, under slurmd's stepd scope::

    <mount>/system.slice/slurmstepd.scope/job_<id>/step_<step>/user/task_<k>
                                                           .../slurm        (the slurmstepd)
    <mount>/system.slice/slurmstepd.scope/system             (slurmstepd "infinity")

where <step> is a number, "batch", "extern" or "interactive" (a het job
component is "<n>+<k>"), the task is "task_<k>" or "task_special" (older:
task_4294967293), and with several slurmd per host the scope is
"<nodename>_slurmstepd.scope". Slurm 26.05 names the job directory by the
job's SLUID instead ("s" and 13 digits of Crockford's base32, e.g. s7B1M90RT51P00;
the job's SLURM_JOB_SLUID) unless the site sets CgroupJobIdPaths=yes (26.05.2+); a
SLUID path gives no job id, only the SLUID. Seen from real daemons (the container
cluster with cgroup/v2, tests/homes/slurm/fixtures/cgroup_*): 22.05.8 and 24.11.5 give
.../n1_slurmstepd.scope/job_6/step_0/user/task_0, 26.05.5 gives
.../n1_slurmstepd.scope/s7B1M90RT51P00/step_0/user/task_0 (and a task_special
beside task_0).

Parsing is pure. The lookups read only /proc/<pid>/cgroup and list
directories; they never write. Unknown shapes give None, never an exception,
except a malformed /proc/<pid>/cgroup, which raises SlurmParseError.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath

from slurm_fiber.homes.slurm.jobenv import SLUID_PATTERN, SlurmParseError

SCOPE = re.compile(r"(?:[A-Za-z0-9_.-]+_)?slurmstepd\.scope")
JOB_DIR = re.compile(r"job_(\d{1,10})")
SLUID_DIR = SLUID_PATTERN
STEP_DIR = re.compile(r"step_(\d{1,10}(?:\+\d{1,10})?|batch|extern|interactive)")
TASK_DIR = re.compile(r"task_(\d{1,10}|special)")
STEP_PARTS = frozenset({"user", "slurm"})


@dataclass(frozen=True)
class SlurmCgroup:
    """Where a cgroup sits in Slurm's tree. Paths are relative to the cgroup mount.

    ``job_id`` is None for a SLUID-named job directory; ``step``, ``part``
    ("user" or "slurm") and ``task`` are None above those levels. ``inner``
    is whatever lies below the deepest level understood (e.g. a subtree
    fiberd carved inside its task).
    """

    scope: PurePosixPath
    job_dir: str
    job_id: int | None
    sluid: str | None
    step: str | None = None
    part: str | None = None
    task: str | None = None
    inner: PurePosixPath | None = None

    @property
    def job_path(self) -> PurePosixPath:
        return self.scope / self.job_dir

    @property
    def step_path(self) -> PurePosixPath | None:
        return self.job_path / f"step_{self.step}" if self.step is not None else None


def parse_cgroup_path(path: str | PurePath) -> SlurmCgroup | None:
    """Classify a cgroup path (as in /proc/<pid>/cgroup, or relative to the mount).

    Returns None when the path is not inside a Slurm job (not under a
    slurmstepd scope, or in the scope's "system" cgroup).
    """
    parts = PurePosixPath("/", path).parts[1:]
    scope_at = next((i for i, p in enumerate(parts) if SCOPE.fullmatch(p)), None)
    if scope_at is None or scope_at + 1 >= len(parts):
        return None
    scope = PurePosixPath(*parts[: scope_at + 1])
    job_dir, rest = parts[scope_at + 1], list(parts[scope_at + 2:])
    job_match = JOB_DIR.fullmatch(job_dir)
    if job_match is None and not SLUID_DIR.fullmatch(job_dir):
        return None
    step = part = task = None
    if rest and (match := STEP_DIR.fullmatch(rest[0])):
        step = match.group(1)
        rest.pop(0)
        if rest and rest[0] in STEP_PARTS:
            part = rest.pop(0)
            if part == "user" and rest and (match := TASK_DIR.fullmatch(rest[0])):
                task = match.group(1)
                rest.pop(0)
    return SlurmCgroup(
        scope=scope,
        job_dir=job_dir,
        job_id=int(job_match.group(1)) if job_match else None,
        sluid=None if job_match else job_dir,
        step=step,
        part=part,
        task=task,
        inner=PurePosixPath(*rest) if rest else None,
    )


def cgroup_of_pid(pid: int | str, proc: Path = Path("/proc")) -> PurePosixPath:
    """The cgroup v2 path of a process, from the "0::<path>" line of /proc/<pid>/cgroup.

    Blocks on one small file read. Raises OSError when the process is gone and
    SlurmParseError("unrecognised") when the file has no cgroup v2 line.
    """
    text = (proc / str(pid) / "cgroup").read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith("0::/"):
            return PurePosixPath(line[3:])
    raise SlurmParseError("unrecognised", f"{proc}/{pid}/cgroup has no cgroup v2 (0::) line")


def job_cgroup_of_pid(pid: int | str, mount: Path, proc: Path = Path("/proc")) -> Path | None:
    """The directory of the job cgroup holding ``pid`` under ``mount``, or None.

    None when the process is not in a Slurm job cgroup (e.g. proctrack/linuxproc).
    Raises as cgroup_of_pid does.
    """
    where = parse_cgroup_path(cgroup_of_pid(pid, proc))
    return mount / where.job_path if where else None


def find_job_cgroup(mount: Path, job_dir: str) -> Path | None:
    """The existing job directory ``job_dir`` ("job_<id>" or a SLUID) under any slurmstepd
    scope in ``mount``/system.slice, or None. Lists one directory level; never writes.
    """
    if not (JOB_DIR.fullmatch(job_dir) or SLUID_DIR.fullmatch(job_dir)):
        return None
    slice_dir = mount / "system.slice"
    try:
        scopes = sorted(p for p in slice_dir.iterdir() if SCOPE.fullmatch(p.name))
    except OSError:
        return None
    return next((s / job_dir for s in scopes if (s / job_dir).is_dir()), None)


def job_dir_name(job_id: int) -> str:
    """The job directory name Slurm uses for a numeric id ("job_<id>")."""
    return f"job_{job_id}"
