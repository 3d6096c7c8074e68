"""The processes of a finished job that are still running on this node, and stopping them.

A job's processes are found only through what belongs to that job, never
as "all processes of the user":

- its delegated cgroup subtree (recomputed from the site config, never
  read from the user-owned record) and fiberd's cgroup root when that lies
  inside it or inside Slurm's own cgroup of this job;
- the fiberd named by its record (pid and start time must match, and it
  must run as the job's uid) and every descendant of it;
- processes of the job's uid whose environment names this job on this node
  of this cluster (``SLURM_JOB_ID``, ``SLURMD_NODENAME``,
  ``SLURM_CLUSTER_NAME``, and ``SLURM_CONF`` when the epilog has one:
  slurmstepd sets it in every task's environment, even with
  ``--export=NONE``, and it tells apart clusters that share a host and a
  name): the templates and fibers a crashed fiberd left orphaned where no
  cgroup holds them (proctrack/linuxproc).

``stop_job_processes`` SIGKILLs them all (``cgroup.kill`` for cgroups),
waits a bounded time and returns the ones that provably survived (still
there, same start time, not a zombie), each with its command line. Pid 1,
the caller and its ancestors are never touched.

psutil and the cgroup modules are imported only once there is a process, a
cgroup or a fiberd record to inspect: the epilog runs for every job, and
most jobs leave none of them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from slurm_fiber.homes.slurm.fiberdrecord import FiberdRecord
from slurm_fiber.homes.slurm.jobenv import SlurmJob
from slurm_fiber.record import record

MAX_ENVIRON = 1 << 20
POLL_S = 0.02
ROUNDS = 3


@record(frozen=True)
class JobProcess:
    """A process of the job: pid, start time (to tell a reused pid), why it is the job's,
    and its command line as first seen."""

    pid: int
    start: float
    why: str
    cmd: str = "?"


def _ref(pid: int, why: str) -> JobProcess | None:
    import psutil

    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            start = proc.create_time()
            cmd = " ".join(proc.cmdline())[:120] or proc.name()
        return JobProcess(pid, start, why, cmd)
    except psutil.Error:
        return None


def trusted_root(record: FiberdRecord, delegated: Path | None, mount: Path | None,
                 job_id: int) -> Path | None:
    """fiberd's recorded cgroup root when it is this job's to kill: inside the delegated
    subtree, or inside Slurm's cgroup of this job. Pure apart from resolving the path."""
    if record.cgroup_root is None:
        return None
    root = Path(os.path.realpath(record.cgroup_root))
    if delegated is not None and (root == delegated or delegated in root.parents):
        return root
    if mount is None or mount not in root.parents:
        return None
    from slurm_fiber.homes.slurm.cgroup_layout import parse_cgroup_path

    where = parse_cgroup_path(root.relative_to(mount))
    return root if where is not None and where.job_id == job_id else None


def record_tree(record: FiberdRecord, job: SlurmJob) -> list[JobProcess]:
    """The recorded fiberd and its descendants of the job's uid, if fiberd still runs."""
    if not record.is_running():
        return []
    import psutil

    try:
        fiberd = psutil.Process(record.pid)
        if fiberd.uids().real != job.uid:
            return []
        children = fiberd.children(recursive=True)
    except psutil.Error:
        return []
    found = [_ref(record.pid, "fiberd (its record)")]
    for child in children:
        with contextlib.suppress(psutil.Error):
            if child.uids().real == job.uid:
                found.append(_ref(child.pid, f"descendant of fiberd {record.pid}"))
    return [p for p in found if p is not None]


def environ_names_job(environ: bytes, job: SlurmJob, slurm_conf: str | None) -> bool:
    """Whether a process environment (NUL-separated) names ``job`` on its node. Pure."""
    pairs = dict(item.partition(b"=")[::2] for item in environ.split(b"\0") if b"=" in item)
    wanted = {b"SLURM_JOB_ID": str(job.job_id), b"SLURMD_NODENAME": job.node,
              b"SLURM_CLUSTER_NAME": job.cluster}
    if any(pairs.get(key) != value.encode() for key, value in wanted.items()):
        return False
    return slurm_conf is None or pairs.get(b"SLURM_CONF") == slurm_conf.encode()


def environ_members(job: SlurmJob, slurm_conf: str | None,
                    proc: Path = Path("/proc")) -> list[JobProcess]:
    """Processes of the job's uid whose environment names the job (see environ_names_job)."""
    found: list[JobProcess] = []
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != job.uid:
                continue
            with open(Path(entry.path) / "environ", "rb") as fh:
                environ = fh.read(MAX_ENVIRON)
        except OSError:
            continue
        if environ_names_job(environ, job, slurm_conf):
            ref = _ref(int(entry.name), f"its environment names job {job.job_id}")
            if ref is not None:
                found.append(ref)
    return found


def cgroup_members(cgroup: Path) -> list[JobProcess]:
    """The processes in cgroup subtree ``cgroup`` (none when it is gone)."""
    # Lazy on purpose (here and in _kill_cgroup): only a site that delegates cgroups needs
    # them, and the epilog runs at every job's end.
    from slurm_fiber.core import cgroups

    found = (_ref(pid, f"in cgroup {cgroup}") for pid in cgroups.pids(cgroup))
    return [p for p in found if p is not None]


def _kill_cgroup(root: Path) -> None:
    """SIGKILL every process in cgroup subtree ``root`` (cgroup.kill)."""
    from slurm_fiber.core import cgroups

    cgroups.kill(root)


def protected_pids(proc: Path = Path("/proc")) -> set[int]:
    """Pid 1, this process and its ancestors (slurmd), which are never signalled.

    The ancestors are read from ``<proc>/<pid>/stat`` (the field after the
    command name's closing parenthesis is the state, then the parent pid).
    """
    keep = {1, os.getpid()}
    pid = os.getppid()
    while pid > 1 and pid not in keep:
        keep.add(pid)
        try:
            stat = (proc / str(pid) / "stat").read_bytes()
            pid = int(stat[stat.rindex(b")") + 1:].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return keep


def still_there(process: JobProcess) -> bool:
    """Whether ``process`` still runs: same pid, same start time, not a zombie."""
    import psutil

    try:
        proc = psutil.Process(process.pid)
        return proc.create_time() == process.start and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def describe(process: JobProcess) -> str:
    """``pid <n> (<command line>; <why>)`` for a report line."""
    return f"pid {process.pid} ({process.cmd}; {process.why})"


def stop_job_processes(discover: Callable[[], list[JobProcess]], cgroup_roots: list[Path],
                       wait_s: float) -> tuple[list[JobProcess], list[JobProcess]]:
    """SIGKILL what ``discover()`` finds and everything in ``cgroup_roots``; wait ``wait_s`` s.

    Discovery is repeated (up to ROUNDS times) until it finds nothing new, so
    a child forked while its parent was being killed is caught too. Returns
    (killed, survivors): survivors still ran, unchanged, after the wait.
    Blocks for at most about ``wait_s`` seconds (polling every 20 ms).
    """
    keep = protected_pids()
    targets: dict[int, JobProcess] = {}
    for _ in range(ROUNDS):
        roots = [root for root in cgroup_roots if root.exists()]
        found = discover() + [p for root in roots for p in cgroup_members(root)]
        new = [p for p in found if p.pid not in keep and p.pid not in targets]
        for root in roots:
            _kill_cgroup(root)
        for process in new:
            targets[process.pid] = process
            if still_there(process):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(process.pid, signal.SIGKILL)
        if not new:
            break
    deadline = time.monotonic() + wait_s
    alive = [p for p in targets.values() if still_there(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(POLL_S)
        alive = [p for p in alive if still_there(p)]
    return list(targets.values()), alive
