"""The cgroup v2 files of a carved tree: controllers, limits, and whether a root can be carved.

A grant's limits are written where their controller is enabled in ``subtree_control``
(``enable_controllers`` asks for memory, pids and cpu where the parent offers them); a
limit that could not be written comes back as a ``LimitOutcome`` saying ``not enforced:
<why>``, never dropped. ``probe`` tells whether a root is a cgroup v2 directory this
process can make groups in; ``v2_memory`` whether a group's memory is counted in v2
files. ``BACKEND`` is how enforcement records name what enforces these limits. Plain
file work; the manager decides where it is done.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

from slurm_fiber.core.cgroups.common import (
    CONTROLLERS,
    UNCARVED,
    CgroupStatus,
    LimitOutcome,
    limit_plan,
)
from slurm_fiber.core.trust.grant import Limits

BACKEND = "cgroup v2"  # how the enforcement record names what writes these limits


def controllers(cgroup: Path) -> set[str]:
    """The controllers the parent offers this cgroup (its ``cgroup.controllers``)."""
    try:
        return set((cgroup / "cgroup.controllers").read_text().split())
    except FileNotFoundError:
        return set()


def enable_controllers(cgroup: Path, wanted: tuple[str, ...] = CONTROLLERS) -> set[str]:
    """Enable each wanted, offered controller for the children; return those enabled.

    All are asked for in one write; if the kernel refuses that, each is
    asked for on its own so one refusal does not block the others.
    """
    offered = [name for name in wanted if name in controllers(cgroup)]
    control = cgroup / "cgroup.subtree_control"
    try:
        if offered:
            control.write_text(" ".join(f"+{name}" for name in offered) + "\n")
    except OSError:
        for name in offered:
            with contextlib.suppress(OSError):
                control.write_text(f"+{name}\n")
    try:
        enabled = {c.lstrip("+") for c in control.read_text().split()}
    except FileNotFoundError:
        return set()
    return enabled & set(wanted)


def write_limits(cgroup: Path, limits: Limits) -> tuple[LimitOutcome, ...]:
    """Write the grant's limits where their controller is enabled; report every limit.

    A limit whose controller the cgroup lacks, or whose write the kernel
    refuses, comes back ``enforced=False`` with ``not enforced: <why>``.
    """
    enabled = controllers(cgroup)
    out: list[LimitOutcome] = []
    for controller, file, value in limit_plan(limits):
        if controller not in enabled:
            why = f"not enforced: the {controller} controller is not enabled for {cgroup}"
            offered = controllers(cgroup.parent)
            if controller not in offered:
                why += (f" (nor offered to {cgroup.parent}: its cgroup v2 offers "
                        f"{' '.join(sorted(offered)) or 'none'})")
            out.append(LimitOutcome(file, value, False, why))
            continue
        try:
            (cgroup / file).write_text(value + "\n")
        except OSError as e:
            out.append(LimitOutcome(file, value, False,
                                    f"not enforced: writing {file} failed: {e.strerror}"))
            continue
        out.append(LimitOutcome(file, value, True))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def v2_memory(parent: Path) -> bool:
    """Whether the children of ``parent`` have v2 memory files (its subtree_control
    enables ``memory``; True when that cannot be read but for a missing file). Asked
    once per parent, whose controllers are set when it is made, not twice per ended
    fiber: on a hybrid host both reads failed for every one (``memory_peak`` and
    ``oom_kills`` were a fifth of fiberd's time in a mass stop, profiled)."""
    try:
        return "memory" in (parent / "cgroup.subtree_control").read_text().split()
    except FileNotFoundError:
        return False
    except OSError:
        return True


def probe(root: Path | None, why_none: str) -> CgroupStatus:
    suffix = UNCARVED
    if root is None:
        return CgroupStatus(False, why_none + suffix, None)
    if not (root / "cgroup.controllers").is_file():
        return CgroupStatus(False, f"{root} is not a cgroup v2 directory" + suffix, root)
    probe = root / f".probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return CgroupStatus(False, f"cannot create cgroups under {root}: {e.strerror}" + suffix,
                            root)
    return CgroupStatus(True, f"carving under {root}", root)


def events_populated(group: Path) -> bool | None:
    """Whether anything runs in ``group`` (its ``cgroup.events``); None when it does not
    exist or cannot be read."""
    try:
        text = (group / "cgroup.events").read_text()
    except OSError:
        return None
    return "\npopulated 1" in "\n" + text


def cgroup2_mount(mountinfo: str) -> Path | None:
    """The first cgroup2 mount point in /proc/self/mountinfo text, or None. Pure."""
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " in line and line.split(" - ", 1)[1].split()[:1] == ["cgroup2"] and len(fields) > 4:
            return Path(fields[4].replace("\\040", " "))
    return None


DELEGATED_FILES = ("cgroup.procs", "cgroup.threads", "cgroup.subtree_control")


def delegate(path: Path, uid: int, gid: int) -> None:
    """Create cgroup ``path`` (and its parents) and delegate it to uid:gid as the kernel's
    cgroup v2 documentation describes (the directory and ``DELEGATED_FILES``). Idempotent.

    Raises OSError when the cgroup cannot be created or given away (no
    cgroup2 there, read-only, not root).
    """
    missing = [p for p in (*reversed(path.parents), path) if not p.exists()]
    path.mkdir(mode=0o755, parents=True, exist_ok=True)
    for created in missing:
        os.chmod(created, 0o755)  # slurmd's umask must not hide the subtree from the user
    if not (path / "cgroup.procs").exists():
        raise FileNotFoundError(2, "not a cgroup v2 directory (no cgroup.procs)", str(path))
    os.chown(path, uid, gid, follow_symlinks=False)
    for name in DELEGATED_FILES:
        target = path / name
        if target.exists():
            os.chown(target, uid, gid, follow_symlinks=False)
