"""The record a job's fiberd leaves in the job's state dir, so the epilog can find what survived.

fiberd-run writes ``<state dir>/fiberd.json`` once it listens (``write_record``)
and removes it when it stops cleanly (``remove_record``). The record names
the fiberd process (pid and start time, so a reused pid is never mistaken
for it), its socket, the cgroup subtree it carves (None when uncarved) and
its uid. The epilog reads it (``read_record``) to stop a fiberd that outlived
its job and, through the cgroup root, everything it started; a record that
is missing, truncated or junk reads as None with the reason, never raises.
Writing is atomic (safefs.write_atomic), so a reader sees a whole record or
none; reading never follows a link, never blocks on a FIFO and reads at
most MAX_RECORD_BYTES, so a job user's planted record cannot stall the
epilog (which runs as root and reads it). fiberd takes its own start time from /proc
(``start_time``), as psutil computes it; psutil is imported only to inspect the recorded
process (kept out of fiberd: core/runtime/memory.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from slurm_fiber import safefs

RECORD_NAME = "fiberd.json"
MAX_RECORD_BYTES = 8192
START_TOLERANCE = 0.02  # psutil create_time has 1/CLK_TCK resolution


@dataclass(frozen=True)
class FiberdRecord:
    """fiberd as it recorded itself: ``start`` is its process start time (Unix seconds)."""

    pid: int
    start: float
    socket: str
    cgroup_root: str | None
    uid: int

    def is_running(self) -> bool:
        """Whether the recorded process still runs (same pid, same start time, not a zombie)."""
        import psutil

        try:
            proc = psutil.Process(self.pid)
            same = abs(proc.create_time() - self.start) <= START_TOLERANCE
            return same and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False


def record_path(state_dir: Path) -> Path:
    """Where the record of the job whose state dir is ``state_dir`` lives."""
    return state_dir / RECORD_NAME


def start_time(pid: int) -> float:
    """When process ``pid`` started, in Unix seconds, as psutil's ``create_time`` has it
    (``is_running`` compares the two): its start in clock ticks after boot (/proc/<pid>/stat)
    plus the boot time (/proc/stat ``btime``). Raises OSError."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        ticks = int(f.read().rpartition(b")")[2].split()[19])
    with open("/proc/stat", "rb") as f:
        btime = next((float(line.split()[1]) for line in f if line.startswith(b"btime ")), None)
    if btime is None:
        raise OSError("no btime in /proc/stat")
    return ticks / os.sysconf("SC_CLK_TCK") + btime


def this_process(socket: Path, cgroup_root: Path | None) -> FiberdRecord:
    """The record for the calling process (fiberd-run) with its socket and cgroup root."""
    pid = os.getpid()
    return FiberdRecord(pid=pid, start=round(start_time(pid), 2),
                        socket=str(socket), uid=os.geteuid(),
                        cgroup_root=None if cgroup_root is None else str(cgroup_root))


def write_record(state_dir: Path, record: FiberdRecord) -> None:
    """Replace the record in ``state_dir`` atomically (mode 0644). Raises OSError.

    ``state_dir`` must be root's, this user's or the record's uid's, and
    writable by no one else, all the way from "/" (safefs); the write is
    safefs.write_atomic.
    """
    data = json.dumps(asdict(record), sort_keys=True).encode() + b"\n"
    dir_fd = safefs.open_dir(state_dir, trusted_owners=(os.geteuid(), record.uid))
    try:
        safefs.write_atomic(dir_fd, RECORD_NAME, data, mode=0o644)
    finally:
        os.close(dir_fd)


def remove_record(state_dir: Path) -> None:
    """Remove the record (a missing one is fine). Raises OSError for other failures."""
    record_path(state_dir).unlink(missing_ok=True)


def _int(doc: dict[str, object], key: str, low: int) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**32:
        raise ValueError(f"{key} is not an id")
    return value


def parse_record(raw: bytes) -> FiberdRecord:
    """A record from its bytes. Pure; raises ValueError (one line) for anything else."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError("not a JSON document") from None
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    start, sock, root = doc.get("start"), doc.get("socket"), doc.get("cgroup_root")
    if isinstance(start, bool) or not isinstance(start, int | float) or start < 0:
        raise ValueError("start is not a time")
    if not isinstance(sock, str) or not isinstance(root, str | None):
        raise ValueError("socket or cgroup_root is not a path")
    if root is not None and (not os.path.isabs(root) or "\0" in root):
        raise ValueError("cgroup_root is not an absolute path")
    return FiberdRecord(pid=_int(doc, "pid", 1), start=float(start), socket=sock,
                        cgroup_root=root, uid=_int(doc, "uid", 0))


def read_record(state_dir: Path, owner: int | None = None) -> tuple[FiberdRecord | None,
                                                                     str | None]:
    """(the record, None), or (None, why there is none). Never blocks (a FIFO, a link, a
    hard link or an oversize file at the record's name is refused) and never raises.

    ``owner`` is the uid the state dir and the record may belong to besides
    root (the job user, for the epilog); None: this process's uid.
    """
    path = record_path(state_dir)
    owners = (0, os.geteuid() if owner is None else owner)
    try:
        dir_fd = safefs.open_dir(state_dir, trusted_owners=owners)
        try:
            raw = safefs.read_file(dir_fd, RECORD_NAME, max_bytes=MAX_RECORD_BYTES,
                                   owners=owners)
        finally:
            os.close(dir_fd)
    except safefs.UnsafePath as err:
        return None, str(err)
    except OSError as err:
        return None, f"{path}: {err.strerror}"
    try:
        return parse_record(raw), None
    except ValueError as err:
        return None, f"{path}: {err}"
