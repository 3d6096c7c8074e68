"""The readiness file: a small JSON document replaced atomically on every publish.

A reader never sees a partial document: it is replaced whole
(``safefs.replace_file``). The document is ``{"ready": bool, "warm": [uids], "time":
unix seconds}`` and the writer's identity (``writer()``): ``pid``, ``pid_start``
(its start time in clock ticks since boot, /proc/<pid>/stat) and ``boot_id``.

Readiness must not outlive its writer: a fiberd killed with SIGKILL cannot take back
"ready". ``read_ready`` is how a reader on the same host reads the file: a document
whose writer is gone (no such pid, another process with that pid, another boot) or
that names no writer reads ``ready: false`` with ``stale`` saying why. A reader on
another host cannot check the pid; it must treat the file as a hint (the time of the
last publish is in it) and ask fiberd itself (its socket's ``ready``).
"""

from __future__ import annotations

import json
import os

from slurm_fiber.safefs import replace_file


def ready_document(warm: list[str], time: float) -> dict[str, object]:
    """The readiness file's content for the grants in ``warm`` (ready when any is warm)."""
    return {"ready": bool(warm), "warm": sorted(warm), "time": time, **writer()}


_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def writer(pid: int | None = None) -> dict[str, object]:
    """Who writes (default: this process): ``pid``, ``pid_start``, ``boot_id`` (None where
    /proc cannot tell)."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "pid_start": _start_ticks(pid), "boot_id": _boot_id()}


def read_ready(path: str | os.PathLike[str]) -> dict[str, object]:
    """The readiness document at ``path`` as its writer left it, but ``ready`` false with
    ``stale`` (one line) unless its writer is alive: the same boot, a process with its
    pid and start time. Raises OSError (unreadable) or ValueError (not a document)."""
    with open(path, "rb") as f:
        doc = json.loads(f.read(64 * 1024))
    if not isinstance(doc, dict):
        raise ValueError(f"{path} is not a readiness document")
    pid, start, boot = doc.get("pid"), doc.get("pid_start"), doc.get("boot_id")
    why = None
    if not isinstance(pid, int) or isinstance(pid, bool) or start is None:
        why = "the document names no writer"
    elif boot != _boot_id():
        why = "written before this host's last boot"
    elif _start_ticks(pid) != start:
        why = f"its writer (pid {pid}) is gone"
    if why is not None and doc.get("ready"):
        doc["ready"] = False
        doc["stale"] = why
    return doc


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:  # the fields after the command (which may hold spaces and parentheses)
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def _boot_id() -> str | None:
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return None


def write_ready_file(path: str, warm: list[str], time: float) -> None:
    """Publish readiness to ``path`` atomically; blocks on disk I/O, raises OSError."""
    document = json.dumps(ready_document(warm, time), sort_keys=True) + "\n"
    replace_file(path, document.encode())
