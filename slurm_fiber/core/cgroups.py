"""Cgroup v2 carving: one child per grant, one per fiber, under the root a home gives.

Layout under the root (``CgroupRoot`` of the home)::

    <root>/grant-<safe uid>/template      the grant's warm template (a leaf)
    <root>/grant-<safe uid>/slot-<n>      one leaf per spare, kept by the fiber it becomes

The template lives in its own leaf because cgroup v2 forbids processes in a
cgroup whose ``subtree_control`` enables controllers. Controllers (memory,
pids, cpu) are enabled in ``subtree_control`` where the parent offers them;
the grant's limits are written on the grant cgroup where its controller is
enabled, and every limit that could not be written is reported as
``not enforced: <why>`` (never silently dropped). ``CgroupManager.predict``
says the same before carving (which controllers are enabled for grant
cgroups), for the admission's enforcement record and ``--strict-limits``;
``CgroupManager.backend`` ("cgroup v2") is how those records name what
enforces a written limit (core.enforcement). Stopping uses
``cgroup.kill`` (a SIGKILL to every process in the subtree, race-free with
concurrent forks); emptiness is learnt from ``cgroup.events``
(``populated 0``), watched with inotify; empty cgroups are removed.

Without a usable root (none given, missing, not cgroup v2, not writable) the
manager is *uncarved*: ``status.carved`` is False with a one-line reason,
every carve returns None and callers track processes by pidfd alone.

``CgroupManager.sweep()`` removes every grant cgroup left under the root by
a fiberd that died; it assumes the root belongs to one fiberd at a time
(one per job or Pod), which is how homes hand it out.

The module-level helpers (``join``, ``kill``, ``populated``, ``wait_empty``,
``remove_tree``, ``enable_controllers``, ``write_limits``) do plain file I/O
and work on any directory tree, so the limit logic is testable on a fake one.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_fiber.core.grant import Limits

if TYPE_CHECKING:
    import asyncio

CONTROLLERS: tuple[str, ...] = ("memory", "pids", "cpu")
BACKEND = "cgroup v2"  # how the enforcement record names what writes these limits
CPU_PERIOD_US = 100_000
_SAFE_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
_FIBER_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class CgroupStatus:
    """Whether fiberd carves cgroups, and why (one line, for status and audit)."""

    carved: bool
    reason: str
    root: Path | None

    @property
    def cause(self) -> str:
        """The reason without the uncarved mode's standard consequences (for limit records)."""
        return self.reason.removesuffix(_UNCARVED)

    def to_json(self) -> dict[str, object]:
        return {"carved": self.carved, "reason": self.reason,
                "root": str(self.root) if self.root else None}


@dataclass(frozen=True)
class LimitOutcome:
    """One limit file: the value asked for and whether the kernel enforces it."""

    file: str  # "memory.max"
    value: str
    enforced: bool
    reason: str = ""  # "not enforced: <why>" when not enforced

    @property
    def limit(self) -> str:
        """The grant limit this file keeps ("memory", "pids", "cpu": its controller)."""
        return self.file.partition(".")[0]

    def to_json(self) -> dict[str, object]:
        return {"file": self.file, "value": self.value, "enforced": self.enforced,
                "reason": self.reason}


@dataclass(frozen=True)
class GrantCgroup:
    """A carved grant: its cgroup, its template's leaf, and how its limits fared."""

    uid: str
    path: Path
    limits: tuple[LimitOutcome, ...]

    @property
    def template(self) -> Path:
        return self.path / "template"

    def slot(self, spare_id: str) -> Path:
        """The leaf a spare fiber process joins, and keeps once it becomes a fiber;
        raises ValueError on an id unsafe as a file name."""
        if not _FIBER_ID.fullmatch(spare_id):
            raise ValueError(f"spare id {spare_id!r} is not [A-Za-z0-9_-]{{1,64}}")
        return self.path / f"slot-{spare_id}"


def safe_name(uid: str) -> str:
    """A directory-safe, collision-free name for a grant UID.

    UIDs made only of ``[A-Za-z0-9._-]`` are used as they are; others get
    their other characters replaced and a hash of the UID appended.
    """
    if _SAFE_NAME.fullmatch(uid) and uid not in {".", ".."}:
        return uid
    digest = hashlib.sha256(uid.encode()).hexdigest()[:10]
    return re.sub(r"[^A-Za-z0-9._-]", "_", uid)[:100] + "-" + digest


# ---------------------------------------------------------------- file helpers


def join(cgroup: Path, pid: int = 0) -> None:
    """Move ``pid`` (0: the caller) into ``cgroup``. Raises OSError on failure."""
    (cgroup / "cgroup.procs").write_text(f"{pid}\n")


def populated(cgroup: Path) -> bool:
    """Whether any process lives in the subtree (False once the cgroup is gone)."""
    try:
        text = (cgroup / "cgroup.events").read_text()
    except FileNotFoundError:
        return False
    return re.search(r"^populated 1$", text, re.M) is not None


def pids(cgroup: Path) -> list[int]:
    """Pids in the subtree (empty when it is gone)."""
    out: list[int] = []
    for dirpath, _, _ in os.walk(cgroup):
        with contextlib.suppress(FileNotFoundError):
            out += [int(p) for p in Path(dirpath, "cgroup.procs").read_text().split()]
    return out


def kill(cgroup: Path) -> None:
    """SIGKILL every process in the subtree; returns at once (see ``wait_empty``).

    Uses ``cgroup.kill``; on kernels without it, signals each listed pid.
    A cgroup that no longer exists is not an error.
    """
    try:
        (cgroup / "cgroup.kill").write_text("1\n")
        return
    except FileNotFoundError:
        if not cgroup.exists():
            return
    for pid in pids(cgroup):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def wait_empty(cgroup: Path, recheck: float = 0.5) -> None:
    """Return once ``populated 0`` (or the cgroup is gone). Never raises for a gone cgroup.

    Woken by inotify on ``cgroup.events``; ``recheck`` seconds is only a
    safety net for a missed wake-up, not a timing rule.
    """
    if not populated(cgroup):
        return
    import asyncio  # here, not at the top: the Slurm epilog uses the file helpers only

    loop = asyncio.get_running_loop()
    with _inotify(cgroup / "cgroup.events") as fd:
        while populated(cgroup):
            woke: asyncio.Future[None] = loop.create_future()
            if fd is not None:
                loop.add_reader(fd, _wake, woke)
            try:
                await asyncio.wait_for(woke, recheck)
            except TimeoutError:
                pass
            finally:
                if fd is not None:
                    loop.remove_reader(fd)
                    _drain(fd)


def remove_tree(cgroup: Path) -> None:
    """rmdir the cgroup and its children, deepest first. A gone cgroup is fine.

    Raises OSError (EBUSY) when a cgroup in it is still populated. Blocks
    while another cgroup operation holds the kernel's cgroup lock (a
    migration can hold it for an RCU grace period): run it off the event
    loop where that matters.
    """
    try:
        os.rmdir(cgroup)  # the common case: an empty leaf
        return
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
    for dirpath, _, _ in sorted(os.walk(cgroup), key=lambda w: -len(w[0])):
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(dirpath)


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


def limit_plan(limits: Limits) -> list[tuple[str, str, str]]:
    """(controller, file, value) for every limit the grant sets, in a fixed order."""
    plan: list[tuple[str, str, str]] = []
    if limits.memory is not None:
        plan.append(("memory", "memory.max", str(int(limits.memory))))
    if limits.pids is not None:
        plan.append(("pids", "pids.max", str(int(limits.pids))))
    if limits.cpu is not None:
        quota = max(1000, round(limits.cpu * CPU_PERIOD_US))
        plan.append(("cpu", "cpu.max", f"{quota} {CPU_PERIOD_US}"))
    return plan


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


def memory_peak(cgroup: Path) -> int | None:
    """``memory.peak`` in bytes where the memory controller provides it, else None."""
    try:
        return int((cgroup / "memory.peak").read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- the manager


class CgroupManager:
    """Carves grant and fiber cgroups under one root; uncarved when the root is unusable.

    Construct once per fiberd (it probes the root: a mkdir/rmdir, no
    blocking waits). All methods are safe to call in uncarved mode: carving
    returns None and removal does nothing. Not thread-safe; used on the loop.
    """

    backend = BACKEND

    def __init__(self, root: Path | None, why_none: str = "no cgroup root given") -> None:
        """``why_none``: the home's reason when it gives no root (shown in status and audit)."""
        self.root = root
        self.status = _probe(root, why_none)
        self._root_enabled: set[str] | None = None

    def root_controllers(self) -> set[str]:
        """The controllers enabled for grant cgroups (enabling the offered ones on first use).

        Empty when uncarved. Blocks briefly on cgroupfs.
        """
        if not self.carved or self.root is None:
            return set()
        if self._root_enabled is None:
            self._root_enabled = enable_controllers(self.root)
        return self._root_enabled

    def predict(self, limits: Limits) -> tuple[LimitOutcome, ...] | None:
        """How ``carve_grant`` would fare with ``limits``, without carving: None when
        uncarved, else one outcome per limit set, enforced where its controller is
        enabled for grant cgroups. (A write the kernel refuses is only seen by carving.)"""
        if not self.carved or self.root is None:
            return None
        enabled = self.root_controllers()
        offered = controllers(self.root)
        out = []
        for controller, file, value in limit_plan(limits):
            if controller in enabled:
                out.append(LimitOutcome(file, value, True))
                continue
            why = (f"not enabled for cgroups under {self.root}" if controller in offered else
                   f"not available to {self.root} (its cgroup v2 offers: "
                   f"{' '.join(sorted(offered)) or 'none'})")
            out.append(LimitOutcome(file, value, False,
                                    f"not enforced: the {controller} controller is {why}"))
        return tuple(out)

    @property
    def carved(self) -> bool:
        return self.status.carved

    def grant_path(self, uid: str) -> Path | None:
        """Where the grant's cgroup is (or would be); None when uncarved."""
        if not self.carved or self.root is None:
            return None
        return self.root / f"grant-{safe_name(uid)}"

    def carve_grant(self, uid: str, limits: Limits) -> GrantCgroup | None:
        """Create (or reuse) the grant's cgroup and template leaf and write its limits.

        Called at admission, not on the Clone path. Returns None when
        uncarved; raises OSError when the root refuses a mkdir.
        """
        path = self.grant_path(uid)
        if path is None or self.root is None:
            return None
        self.root_controllers()
        path.mkdir(exist_ok=True)
        enable_controllers(path)
        (path / "template").mkdir(exist_ok=True)
        return GrantCgroup(uid, path, write_limits(path, limits))

    async def remove_grant(self, uid: str) -> None:
        """Kill everything left in the grant's cgroup, wait until empty, remove it."""
        path = self.grant_path(uid)
        if path is not None:
            await kill_and_remove(path)

    async def sweep(self) -> list[Path]:
        """Remove every grant cgroup under the root (a dead fiberd's leftovers).

        Called at fiberd start before any grant is carved. Returns the
        removed paths; an uncarved manager removes nothing.
        """
        if not self.carved or self.root is None:
            return []
        removed: list[Path] = []
        for child in sorted(self.root.iterdir()):
            if child.is_dir() and child.name.startswith("grant-"):
                await kill_and_remove(child)
                removed.append(child)
        return removed


async def empty(cgroup: Path) -> None:
    """Return once nothing runs in the subtree: at once when it is empty already (no
    ``cgroup.kill``, which would wait on the kernel's cgroup lock), else after
    ``cgroup.kill`` and ``populated 0``."""
    if populated(cgroup):
        kill(cgroup)
        await wait_empty(cgroup)


async def kill_and_remove(cgroup: Path) -> None:
    """``empty`` the subtree, then rmdir it all (off the event loop)."""
    await empty(cgroup)
    import asyncio

    await asyncio.to_thread(remove_tree, cgroup)


_UNCARVED = "; running uncarved: processes tracked by pidfd, limits not enforced"


def _probe(root: Path | None, why_none: str) -> CgroupStatus:
    suffix = _UNCARVED
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


# ---------------------------------------------------------------- inotify

_IN_MODIFY = 0x2
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def _inotify(file: Path) -> Iterator[int | None]:
    """An inotify fd watching ``file`` for modification, or None where unavailable."""
    fd = _libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
    if fd < 0:
        yield None
        return
    try:
        if _libc.inotify_add_watch(fd, os.fsencode(file), _IN_MODIFY) < 0:
            yield None
        else:
            yield fd
    finally:
        os.close(fd)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass


__all__ = [
    "BACKEND", "CONTROLLERS", "CgroupManager", "CgroupStatus", "GrantCgroup", "LimitOutcome",
    "controllers", "empty", "enable_controllers", "join", "kill", "kill_and_remove", "limit_plan",
    "memory_peak", "pids", "populated", "remove_tree", "safe_name", "wait_empty",
    "write_limits",
]
