"""Cgroup v1 (and hybrid) hosts: the v1 hierarchies, the mirrors of a carved tree in them, v1 files.

On a host with v1 hierarchies the carving root's tree is mirrored, group for group,
in the v1 memory, pids, cpu and devices hierarchies under fiberd's own v1 cgroups
(``V1Layout`` reads them from /proc; ``register_mirrors`` records a carving root's
mirrors; ``mirrors`` answers where a group's are). A process joins every mirror of its
group. The cpu hierarchy stops at the template: a grant's fibers stay in their
template's cpu group (``V1_NOT_PER_FIBER``), under the grant's quota like it.
``write_limits_v1`` writes a grant's limits in its v1 groups and reads each back;
``freeze_kill`` ends a v1 freezer group's processes race-free (freeze, kill, thaw).
Plain file work: the manager decides what is carved where.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slurm_fiber.core.cgroups.common import FIBERS, LimitOutcome, limit_plan, pids
from slurm_fiber.core.trust.grant import Limits

V1_LIMITED: tuple[str, ...] = ("memory", "pids", "cpu", "devices")  # v1 hierarchies carved
V1_NOT_PER_FIBER: tuple[str, ...] = ("cpu",)  # where fibers keep their template's group
V1_TREE_PREFIX = "slurm-fiber."  # + pid: fiberd's carving root in each v1 hierarchy
PROC_MOUNTINFO = "/proc/self/mountinfo"
PROC_CGROUP = "/proc/self/cgroup"


@dataclass(frozen=True)
class V1Layout:
    """The cgroup v1 hierarchies of this host: controller -> mount point, and this
    process's own cgroup in each (``/proc/self/cgroup``)."""

    mounts: dict[str, Path]
    own: dict[str, str]

    @classmethod
    def of_self(cls, mountinfo: str = PROC_MOUNTINFO, proc_cgroup: str = PROC_CGROUP
                ) -> V1Layout:
        """Read from /proc; an unreadable file reads as no v1 hierarchy. Never raises."""
        try:
            info = Path(mountinfo).read_text()
            own = Path(proc_cgroup).read_text()
        except OSError:
            return cls({}, {})
        return cls.parse(info, own)

    @classmethod
    def parse(cls, mountinfo: str, proc_cgroup: str) -> V1Layout:
        """A hierarchy mounted whole (mount root "/") wins over a bind mount of one of its
        groups (e.g. a Slurm test cluster's CgroupMountpoint); with only such a bind
        mount, ``own`` is taken relative to the group it shows."""
        mounts: dict[str, Path] = {}
        shown: dict[str, str] = {}  # controller -> the group its chosen mount shows
        for line in mountinfo.splitlines():
            head, sep, tail = line.partition(" - ")
            fields, rest = head.split(), tail.split()
            if not sep or rest[:1] != ["cgroup"] or len(fields) < 5 or len(rest) < 3:
                continue
            for option in rest[2].split(","):
                if option not in mounts or (shown[option] != "/" and fields[3] == "/"):
                    mounts[option], shown[option] = Path(fields[4]), fields[3]
        own: dict[str, str] = {}
        for line in proc_cgroup.splitlines():
            _, _, entry = line.partition(":")
            names, _, path = entry.partition(":")
            for name in names.split(","):
                if name:
                    base = shown.get(name, "/").rstrip("/")
                    inside = path == base or path.startswith(base + "/")
                    own[name] = (path[len(base):] or "/") if base and inside else path
        return cls(mounts, own)

    def root(self, controller: str, name: str) -> Path | None:
        """Where fiberd carves in ``controller``'s hierarchy: ``name`` under this process's
        own cgroup there; None when the controller has no v1 hierarchy."""
        mount = self.mounts.get(controller)
        if mount is None:
            return None
        return mount / self.own.get(controller, "/").strip("/") / name


# Mirrors: a carving root (where stop and emptiness are read) -> the v1 roots under which
# the same relative groups carry limits and devices. Registered by the manager so the
# path helpers (groups.mkdir, memory.memory_peak, memory.oom_kills, groups.remove_tree,
# mirrors) see them.
_MIRRORS: dict[Path, tuple[Path, ...]] = {}
# What else caches answers derived from the mirrors (memory.memory_of): cleared with them.
MIRRORS_CHANGED: list[Callable[[], None]] = []


def register_mirrors(root: Path, v1_roots: tuple[Path, ...]) -> None:
    """Record that the carving root ``root``'s groups are mirrored under ``v1_roots``."""
    _MIRRORS[root] = v1_roots
    _mirrors_changed()


def drop_mirrors(root: Path) -> None:
    """Forget ``root``'s mirrors (its manager closed). A root never registered is fine."""
    _MIRRORS.pop(root, None)
    _mirrors_changed()


def _mirrors_changed() -> None:
    mirrors.cache_clear()
    for forget in MIRRORS_CHANGED:
        forget()


@functools.lru_cache(maxsize=4096)
def mirrors(cgroup: Path) -> tuple[Path, ...]:
    """The v1 groups ``cgroup`` is mirrored in (a process joins them all); () for none.
    Cached (cleared as mirrors are registered or dropped): a leaf the pool hands out again
    is asked at each spawn and each end.

    Groups under a grant's ``fibers`` have no cpu mirror (``V1_NOT_PER_FIBER``): a fiber
    stays in its template's cpu group, under the grant's quota as the template is. The
    kernel reschedules a running process that changes cpu group; a template moving itself
    back from a leaf it had just spawned a program in gave that program its CPU and waited
    for it to yield while another CPU idled (docs/design.md, "cgroup v1 and hybrid
    hosts"). What is lost: the grant's CPU is shared per thread among its template and
    fibers, not per fiber."""
    found = _mirrored(cgroup)
    if found is None:
        return ()
    roots, relative = found
    if relative.split("/")[1:2] == [FIBERS]:
        roots = tuple(m for m in roots if not any(_carries(m, c) for c in V1_NOT_PER_FIBER))
    return tuple(m / relative for m in roots)


def mirror(cgroup: Path, controller: str) -> Path | None:
    """``cgroup``'s mirror in the v1 hierarchy of ``controller``, None without one."""
    found = _mirrored(cgroup)
    if found is None:
        return None
    return next((m / found[1] for m in found[0] if _carries(m, controller)), None)


def _mirrored(cgroup: Path) -> tuple[tuple[Path, ...], str] | None:
    """The v1 roots of the carving root ``cgroup`` is in (or is), and its path relative
    to it ("" for the root itself); None when it is in none. Compared as strings: a
    fiber's end asks several times, and thousands end at a mass stop."""
    text = str(cgroup)
    for root, roots in _MIRRORS.items():
        base = str(root)
        if text == base:
            return roots, ""
        if text.startswith(base + "/"):
            return roots, text[len(base) + 1:]
    return None


@functools.cache
def _carries(v1root: Path, controller: str) -> bool:
    """Whether the v1 group ``v1root`` is of ``controller``'s hierarchy (asked once per
    root: a fiber's end reads its memory mirror twice, and thousands end at a stop)."""
    return (v1root / f"{controller}.{_PROBE_FILE[controller]}").exists()


_PROBE_FILE = {"memory": "limit_in_bytes", "pids": "max", "cpu": "cfs_quota_us",
               "devices": "list", "freezer": "state"}


def _write_read(path: Path, value: str) -> str:
    """Write ``value`` to a control file and read it back (stripped). Raises OSError."""
    path.write_text(value + "\n")
    return path.read_text().strip()


def write_limits_v1(groups: dict[str, Path], limits: Limits) -> list[LimitOutcome]:
    """Write the grant's limits in its v1 groups (controller -> group) and read each back;
    limits whose controller has no group here are left out (the caller's v2 covers them)."""
    out: list[LimitOutcome] = []
    for controller, file, value in limit_plan(limits):
        group = groups.get(controller)
        if group is None:
            continue
        by = f"cgroup v1 {controller}"
        try:
            if controller == "memory":
                file = "memory.limit_in_bytes"
                # Swap too, where swap accounting is on; memsw may never be below the
                # limit, so it goes first when raising, after when lowering.
                memsw = group / "memory.memsw.limit_in_bytes"
                with contextlib.suppress(OSError):
                    memsw.write_text(value + "\n")
                back_n = int(_write_read(group / file, value))
                with contextlib.suppress(OSError):
                    memsw.write_text(value + "\n")
                ok = abs(back_n - int(value)) < (os.sysconf("SC_PAGE_SIZE") or 4096)
                back = str(back_n)
            elif controller == "pids":
                back_s = _write_read(group / file, value)
                ok, back = back_s == value, back_s
            else:
                quota, period = value.split()
                _write_read(group / "cpu.cfs_period_us", period)
                file, value = "cpu.cfs_quota_us", quota
                back_s = _write_read(group / file, quota)
                ok, back = back_s == quota, back_s
        except (OSError, ValueError) as e:
            why = e.strerror if isinstance(e, OSError) else str(e)
            out.append(LimitOutcome(file, value, False,
                                    f"not enforced: writing {group / file} failed: {why}", by))
            continue
        out.append(LimitOutcome(file, value, True, "", by) if ok else LimitOutcome(
            file, value, False, f"not enforced: {group / file} reads back {back}", by))
    return out


def freeze_kill(group: Path) -> None:
    """SIGKILL every process of a v1 freezer group race-free: freeze, signal, thaw."""
    state = group / "freezer.state"
    with contextlib.suppress(OSError):
        state.write_text("FROZEN\n")
    for _ in range(1000):  # FREEZING -> FROZEN takes a scheduler round per task
        with contextlib.suppress(OSError):
            if state.read_text().strip() != "FREEZING":
                break
    for pid in pids(group):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        state.write_text("THAWED\n")
