"""Stale holders: proving a holder's process gone, and the audit of a reclaim.

A holder is provably gone only when its record names this host (``host``)
and a process (the ``@pid:`` suffix of ``session``) and that process no
longer exists, is a zombie, or its pid now belongs to a process started at
another time than the recorded start. Anything less (another host, no pid,
an unreadable record, a process we may not inspect) is not proof, and the
lease stays. Reclaiming is always explicit and leaves one JSON line in
``<leasedir>/audit.jsonl``. psutil is imported only where a process is
inspected (kept out of fiberd, which imports this module: core/runtime/memory.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from slurm_fiber.lease.errors import io_failure
from slurm_fiber.lease.files import Owners, open_area, open_regular
from slurm_fiber.lease.holder import Holder, ProcessRef

AUDIT_FILE = "audit.jsonl"
START_TOLERANCE = 0.02  # create_time has 1/CLK_TCK resolution; records keep two decimals


def process_ref(pid: int) -> ProcessRef:
    """The pid and start time of a live process; raises psutil.NoSuchProcess when none."""
    import psutil

    return ProcessRef(pid, round(psutil.Process(pid).create_time(), 2))


def gone_reason(process: ProcessRef) -> str | None:
    """Why ``process`` is provably gone from this host, or None when it may still run."""
    import psutil

    try:
        proc = psutil.Process(process.pid)
        started = proc.create_time()
        zombie = proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return f"process {process.pid} no longer exists"
    except psutil.Error:
        return None
    if zombie:
        return f"process {process.pid} has exited (zombie)"
    if process.start is not None and abs(started - process.start) > START_TOLERANCE:
        return f"pid {process.pid} now belongs to a process started at {started:.2f}"
    return None


def holder_gone_reason(holder: Holder, this_host: str) -> str | None:
    """Why ``holder``'s session is provably gone, or None when it cannot be proved."""
    process = holder.process()
    if process is None or not holder.host or holder.host != this_host:
        return None
    return gone_reason(process)


def append_audit(lease_dir: Path, owners: Owners, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line to ``<lease_dir>/audit.jsonl``.

    One ``write`` on an O_APPEND descriptor, so concurrent writers never
    interleave lines. The file is opened relative to the lease dir's fd and
    refused when it is a link, a FIFO, a file of several links or (an owned
    area, ``owners``) of an untrusted owner: root never appends to a file a
    job user chose. Raises LeaseError when the line cannot be written.
    """
    line = json.dumps(record, sort_keys=True).encode() + b"\n"
    path = lease_dir / AUDIT_FILE
    try:
        dir_fd = open_area(lease_dir, owners)
    except FileNotFoundError as err:
        raise io_failure(f"append to audit log {path}", err) from None
    try:
        fd = open_regular(dir_fd, AUDIT_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                          "audit log", path, owners)
        try:
            os.write(fd, line)
        except OSError as err:
            raise io_failure(f"append to audit log {path}", err) from None
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
