"""What a group's memory controller says at a fiber's end: its peak, its OOM kills, a renewal.

A group's memory is counted in its v2 files where its parent enables v2 memory, else in
its v1 memory mirror (hybrid and v1 hosts), else nowhere: ``memory_peak`` reads
``memory.peak`` or ``memory.max_usage_in_bytes``, ``oom_kills`` the ``oom_kill`` count
of ``memory.events`` or ``memory.oom_control``; both answer None where nothing counts.
``renew_memory`` lets an ended fiber's leaf be handed to the next fiber only where it
will then report that fiber's own figures. Reads through held file descriptors
(held_files); never raises for a file that cannot be read.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from slurm_fiber.core.cgroups.common import read_int
from slurm_fiber.core.cgroups.held_files import read_held, write_held
from slurm_fiber.core.cgroups.v1 import MIRRORS_CHANGED, mirror
from slurm_fiber.core.cgroups.v2 import v2_memory

RENEW_RESIDUE = 1 << 20  # bytes a v1 leaf may hold charged and still be renewed (see below)


@functools.lru_cache(maxsize=4096)
def memory_of(cgroup: Path) -> tuple[str | None, str | None]:
    """Where ``cgroup``'s memory is counted, as path texts: the group itself when its parent
    enables v2 memory (else None), and its v1 memory mirror (else None). Cached as
    ``mirrors`` is: a fiber's end reads its peak, OOM count and usage through them."""
    v1 = mirror(cgroup, "memory")
    return (str(cgroup) if v2_memory(cgroup.parent) else None,
            str(v1) if v1 is not None else None)


def memory_peak(cgroup: Path) -> int | None:
    """``memory.peak`` in bytes where the v2 memory controller provides it, else the v1
    mirror's ``memory.max_usage_in_bytes``, else None."""
    v2, v1 = memory_of(cgroup)
    peak = read_int(v2, "memory.peak") if v2 is not None else None
    if peak is None and v1 is not None:
        peak = read_int(v1, "memory.max_usage_in_bytes")
    return peak


def renew_memory(cgroup: Path, kills: int | None) -> str | None:
    """Make an ended fiber's empty leaf report memory afresh for the next fiber, where that
    can be done for every reader: with only a v1 memory mirror counting (``memory_peak``,
    ``oom_kills``), no OOM kill counted and at most ``RENEW_RESIDUE`` still charged to it,
    its ``memory.max_usage_in_bytes`` is reset, so the next fiber's peak is its own plus
    that residue. The residue is what v1 leaves behind any process (kernel objects, the
    per-CPU charge batches of 64 pages: 100-700 KiB were measured after a `true`, a call
    or a 64 MiB Python, never 0, often half of it freed some 50 ms later), about v1's own
    accounting granularity; a fiber that left more (files in the page cache) has its leaf
    removed. None once the leaf reports as a new one would (also where no memory
    controller counts at all); else why not, one line: v2's ``memory.peak`` counts (a
    reset holds only for the file descriptor that wrote it), past the residue, an OOM kill
    counted or unknown, or a file that cannot be read or written. ``kills``: its OOM kill
    count as read at the fiber's end (``oom_kills``; None: unknown, not renewed)."""
    v2, v1 = memory_of(cgroup)
    if v2 is not None and os.path.exists(f"{v2}/memory.peak"):
        return "cgroup v2 memory.peak counts it (a reset holds for one reader only)"
    if v1 is None:
        return None
    if kills != 0:
        return "its OOM kill count is unknown" if kills is None else f"{kills} OOM kills counted"
    usage = read_int(v1, "memory.usage_in_bytes")
    if usage is None:
        return f"{v1}/memory.usage_in_bytes cannot be read"
    if usage > RENEW_RESIDUE:
        return f"{usage} bytes still charged to it (more than {RENEW_RESIDUE})"
    try:
        write_held(v1, "memory.max_usage_in_bytes", b"0")
    except OSError as e:
        return f"its memory.max_usage_in_bytes cannot be reset: {e.strerror}"
    return None


def oom_kills(cgroup: Path) -> int | None:
    """Processes the kernel OOM-killed in this group: ``memory.events`` ``oom_kill`` (v2),
    else the v1 mirror's ``memory.oom_control`` ``oom_kill`` (polled, read at a fiber's
    end; the v1 count is the victim's own group's). None where neither exists."""
    v2, v1 = memory_of(cgroup)
    for group, name in ((v2, "memory.events"), (v1, "memory.oom_control")):
        if group is None:
            continue
        try:
            text = read_held(group, name)
        except OSError:
            continue
        for line in text.splitlines():
            key, _, count = line.partition(" ")
            if key == "oom_kill" and count.isdigit():
                return int(count)
    return None


MIRRORS_CHANGED.append(memory_of.cache_clear)
