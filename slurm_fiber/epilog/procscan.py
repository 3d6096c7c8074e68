"""Finding a finished job's processes in /proc at a bounded cost per process.

One pass over /proc, until a deadline, with a fixed amount of work per
process whatever the job made: the owner of ``/proc/<pid>`` (one ``stat``;
a process made non-dumpable shows as root's, and its real uid is then read
from the first bytes of ``status``), then, for the job's uid only, at most
STAT_BYTES of ``stat`` and at most 2 x ENV_PART bytes of ``environ`` (its
head and its tail, located with the ``env_start``/``env_end`` fields of
``stat``). No psutil, no reading a whole environment or command line.

A process of the job's uid is the job's when it is the fiberd its record
names (pid, start time and uid must match) or a descendant of it, or when
its environment names the job (``SLURM_JOB_ID``, ``SLURMD_NODENAME``,
``SLURM_CLUSTER_NAME``, and ``SLURM_CONF`` when the epilog has one):
the templates and fibers a crashed fiberd left where no cgroup holds them.
The environment is the process's own to change, so this pass finds what a
job left behind, not what hides on purpose (a process that drops or buries
the job's variables in the middle of a large environment): that is the
cgroup's job (core/cgroups/teardown.py), and docs/design.md's threat model says so.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from slurm_fiber.homes.slurm.fiberdrecord import START_TOLERANCE, FiberdRecord
from slurm_fiber.homes.slurm.jobenv import SlurmJob

STAT_BYTES = 4096
STATUS_BYTES = 1024
ENV_PART = 8192
CMD_BYTES = 120
CHECK_EVERY = 16  # /proc entries between two looks at the clock
PROC = Path("/proc")


@dataclass(frozen=True)
class Stat:
    """What the epilog needs of ``/proc/<pid>/stat``: state, parent, start (clock ticks
    after boot) and the size of the environment."""

    state: str
    ppid: int
    start: int
    env_size: int


def _read(path: str, size: int, dir_fd: int | None = None) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        return os.read(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_stat(pid: int, proc: Path = PROC, proc_fd: int | None = None) -> Stat | None:
    """``/proc/<pid>/stat`` (at most STAT_BYTES), or None when the process is gone.
    ``proc_fd``: an fd of ``proc``, to spare the path lookups in a scan."""
    path = f"{pid}/stat" if proc_fd is not None else f"{proc}/{pid}/stat"
    raw = _read(path, STAT_BYTES, proc_fd)
    if raw is None:
        return None
    fields = raw[raw.rfind(b")") + 1:].split()
    try:
        env = int(fields[48]) - int(fields[47]) if len(fields) > 48 else 0
        return Stat(fields[0].decode(), int(fields[1]), int(fields[19]), max(env, 0))
    except (IndexError, ValueError):
        return None


def _real_uid(pid: str, proc_fd: int) -> int | None:
    """The real uid of a process whose /proc dir is root's (non-dumpable, or root's)."""
    head = _read(f"{pid}/status", STATUS_BYTES, proc_fd) or b""
    for line in head.split(b"\n"):
        if line.startswith(b"Uid:"):
            with contextlib.suppress(IndexError, ValueError):
                return int(line.split()[1])
    return None


def environ_ends(pid: int, size: int, proc_fd: int) -> bytes:
    """The head and the tail of a process's environment, at most ENV_PART bytes each, joined
    by a NUL (a variable cut at either edge is dropped, never misread)."""
    try:
        fd = os.open(f"{pid}/environ", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc_fd)
    except OSError:
        return b""
    try:
        head = os.pread(fd, ENV_PART, 0)
        if size <= ENV_PART or len(head) < ENV_PART:
            return head
        tail = os.pread(fd, ENV_PART, max(size - ENV_PART, ENV_PART))
    except OSError:
        return b""
    finally:
        os.close(fd)
    if size <= 2 * ENV_PART:  # head and tail meet: the whole environment
        return head + tail
    return head[:head.rfind(b"\0") + 1] + b"\0" + tail[tail.find(b"\0") + 1:]


def environ_names_job(environ: bytes, job: SlurmJob, slurm_conf: str | None) -> bool:
    """Whether a process environment (NUL-separated) names ``job`` on its node. Pure."""
    padded = b"\0" + environ + b"\0"
    wanted = [("SLURM_JOB_ID", str(job.job_id)), ("SLURMD_NODENAME", job.node),
              ("SLURM_CLUSTER_NAME", job.cluster)]
    if slurm_conf is not None:
        wanted.append(("SLURM_CONF", slurm_conf))
    return all(f"\0{key}={value}\0".encode() in padded for key, value in wanted)


def command(pid: int, proc: Path = PROC) -> str:
    """The first CMD_BYTES of a process's command line, for a report ("?" when gone)."""
    try:
        with open(proc / str(pid) / "cmdline", "rb") as f:
            raw = f.read(CMD_BYTES)
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip() or "?"


def boot_time(proc: Path = PROC) -> float:
    """The boot time in Unix seconds (/proc/stat ``btime``); 0.0 when unreadable."""
    try:
        with open(proc / "stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


@dataclass(frozen=True)
class Found:
    """A process of the job: pid, start (clock ticks after boot, to tell a reused pid) and
    why it is the job's."""

    pid: int
    start: int
    why: str


def scan(job: SlurmJob, slurm_conf: str | None, fiberd: FiberdRecord | None,
         deadline: float, proc: Path = PROC) -> tuple[list[Found], bool]:
    """The job's processes (see the module doc), and whether the pass ended before
    ``deadline`` (False: some processes were not looked at)."""
    mine: dict[int, tuple[Stat, str | None]] = {}
    complete = True
    proc_fd = os.open(proc, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with os.scandir(proc) as entries:
            for n, entry in enumerate(entries):
                if n % CHECK_EVERY == 0 and time.monotonic() >= deadline:
                    complete = False
                    break
                if not entry.name.isdigit():
                    continue
                try:
                    owner = entry.stat(follow_symlinks=False).st_uid
                except OSError:
                    continue
                if owner != job.uid and not (
                        owner == 0 and _real_uid(entry.name, proc_fd) == job.uid):
                    continue
                pid = int(entry.name)
                st = read_stat(pid, proc, proc_fd)
                if st is None or st.state in ("Z", "X"):
                    continue
                env = environ_ends(pid, st.env_size, proc_fd)
                mine[pid] = (st, f"its environment names job {job.job_id}"
                             if environ_names_job(env, job, slurm_conf) else None)
    finally:
        os.close(proc_fd)
    found = [Found(pid, st.start, why) for pid, (st, why) in mine.items() if why is not None]
    if fiberd is not None:
        found += _fiberd_tree(fiberd, mine, {f.pid for f in found}, proc)
    return found, complete


def _fiberd_tree(fiberd: FiberdRecord, mine: dict[int, tuple[Stat, str | None]],
                 seen: set[int], proc: Path) -> list[Found]:
    """The recorded fiberd (same pid, start time and the job's uid) and its descendants
    among the job uid's processes ``mine``."""
    entry = mine.get(fiberd.pid)
    if entry is None:
        return []
    ticks = os.sysconf("SC_CLK_TCK")
    if abs(boot_time(proc) + entry[0].start / ticks - fiberd.start) > START_TOLERANCE:
        return []
    children: dict[int, list[int]] = {}
    for pid, (st, _) in mine.items():
        children.setdefault(st.ppid, []).append(pid)
    found = [] if fiberd.pid in seen else [Found(fiberd.pid, entry[0].start,
                                                 "fiberd (its record)")]
    todo = list(children.get(fiberd.pid, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        if pid not in seen:
            found.append(Found(pid, mine[pid][0].start, f"descendant of fiberd {fiberd.pid}"))
    return found
