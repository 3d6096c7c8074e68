"""One task window, fiberd's side of the template: the order out, the reports in, the leaves.

``WindowLink`` sends a template one ``window`` order (core/templates/child/window_run.py)
and turns what comes back into ``Batch``es, in order: the starts and ends the template
reported, and, once the template is gone without its last report, what fiberd learns
from the window's leaves. Guarantees:

- every task that ran is in some batch: a reported start or, for a leaf whose CPU
  figures (``cpu.stat`` ``usage_usec``, which every cgroup2 group has) grew past what
  fiberd read before the order went out while no start was reported there, a *lost*
  start of that leaf's task (the template gives its n-th task the n-th leaf); every
  start is followed by its end or, once the template is gone, a lost end. Uncarved, a
  task the template never reported cannot be found: said as not enforced;
- ``kill`` SIGKILLs everything in the window's leaves (``cgroup.kill``): what fiberd
  does at the window's deadline, a fence, a removal, an epoch bump and a stop, whatever
  the template does; ``close`` also tells the template to start nothing more;
- the last batch has ``done``; after it nothing of the window runs in its leaves (the
  template said so, or it is dead and the leaves were killed).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from slurm_fiber.core.cgroups.common import populated
from slurm_fiber.core.cgroups.groups import kill as cgroup_kill
from slurm_fiber.core.cgroups.v1 import mirrors

START_FIELDS = ("key", "pid", "leaf")
END_FIELDS = ("key", "pid", "status", "cpu", "maxrss", "refused")


@dataclass
class Batch:
    """What one report (or the template's loss) told: starts and ends as dicts; ``lost``
    when they were learnt from the leaves, not reported; ``done`` for the last."""

    starts: list[dict[str, object]] = field(default_factory=list)
    ends: list[dict[str, object]] = field(default_factory=list)
    done: bool = False
    lost: bool = False
    error: str | None = None


def cpu_usage(leaf: Path) -> int | None:
    """The leaf's ``usage_usec`` (cgroup2 ``cpu.stat``), None when it cannot be read."""
    try:
        with open(leaf / "cpu.stat", "rb") as f:
            for line in f.read(4096).splitlines():
                name, _, value = line.partition(b" ")
                if name == b"usage_usec":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


class WindowLink:
    """fiberd's end of one window in one template (module doc). Not thread-safe: used on
    the event loop, fed by the template's ``_dispatch`` (``reported``) and its death
    (``gone``)."""

    def __init__(self, window_id: str, keys: list[str], leaves: list[Path | None]) -> None:
        self.id = window_id
        self.keys = keys
        self.leaves = leaves
        self.baseline = [cpu_usage(leaf) if leaf is not None else None for leaf in leaves]
        self.batches: asyncio.Queue[Batch] = asyncio.Queue()
        self.started: dict[str, int] = {}  # key -> leaf index, reported and not ended
        self.pids: dict[str, int] = {}  # key -> pid, reported and not ended (uncarved kill)
        self.used: set[int] = set()  # leaf indexes a start was reported in
        self.finished = False

    def reported(self, msg: dict[str, object]) -> None:
        """A ``window_report`` from the template."""
        if self.finished:
            return
        batch = Batch(done=bool(msg.get("done")), error=_text(msg.get("error")))
        for raw in _rows(msg.get("starts")):
            start = dict(zip(START_FIELDS, raw, strict=False))
            index = start.get("leaf")
            if isinstance(index, int) and 0 <= index < len(self.leaves):
                self.started[str(start.get("key"))] = index
                self.used.add(index)
            if isinstance(pid := start.get("pid"), int) and pid > 1:
                self.pids[str(start.get("key"))] = pid
            batch.starts.append(start)
        for raw in _rows(msg.get("ends")):
            end = dict(zip(END_FIELDS, raw, strict=False))
            self.started.pop(str(end.get("key")), None)
            self.pids.pop(str(end.get("key")), None)
            batch.ends.append(end)
        self.finished = batch.done
        self.batches.put_nowait(batch)

    def gone(self) -> None:
        """The template is gone (its last report read, if it sent one): kill the leaves and
        put the batch of what no report told (lost starts and ends), done."""
        if self.finished:
            return
        self.kill()
        batch = Batch(done=True, lost=True)
        for index, leaf in enumerate(self.leaves):
            if leaf is None or index in self.used:
                continue
            before, now = self.baseline[index], cpu_usage(leaf)
            if before is not None and now is not None and now > before:
                # the template gives the n-th task it takes the n-th leaf: the key is known
                key = self.keys[index] if index < len(self.keys) else None
                batch.starts.append({"key": key, "pid": None, "leaf": index,
                                     "usage_usec": now - before})
                if key is not None:
                    self.started[key] = index
        for key in list(self.started):
            batch.ends.append({"key": key, "pid": None, "status": None, "cpu": None,
                               "maxrss": None, "refused": None})
        self.started.clear()
        self.pids.clear()
        self.finished = True
        self.batches.put_nowait(batch)

    def kill(self) -> None:
        """SIGKILL whatever runs in the window's leaves and, uncarved, the process group of
        each fiber whose start was reported and its end not (its pid is the template's
        unreaped child until the template reaps it and reports; between the two it could
        be reused: not enforced uncarved, where fiberd holds no pidfd of a window fiber).
        Never raises."""
        for pid in self.pids.values():
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        for leaf in self.leaves:
            if leaf is not None:
                with contextlib.suppress(OSError):
                    if populated(leaf):
                        cgroup_kill(leaf)

    def order(self, size: int, left: float, seconds: float | None,
              tasks: list[dict[str, object]]) -> dict[str, object]:
        """The ``window`` message for the template."""
        return {"t": "window", "id": self.id, "size": size, "left": left, "seconds": seconds,
                "tasks": tasks,
                "leaves": [[str(leaf) if leaf else None,
                            [str(m) for m in mirrors(leaf)] if leaf else []]
                           for leaf in self.leaves]}


def _rows(value: object) -> list[list[object]]:
    return [row for row in value if isinstance(row, list)] if isinstance(value, list) else []


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
