"""What every cgroup backend shares: the grant tree's names, the value types and plain file work.

A grant's tree under the carving root (``CgroupRoot`` of the home)::

    <root>/grant-<safe uid>/template                     the grant's warm template (a leaf)
    <root>/grant-<safe uid>/fibers/group-<k>/slot-<n>    one leaf per spare, kept by the
                                                         fiber it becomes

The template has a leaf of its own (cgroup v2 holds no process in a cgroup whose
``subtree_control`` enables controllers); every spare and fiber is under ``fibers``, so
one kill there ends them all and not the template; slot leaves come in groups of
``SLOTS_PER_GROUP``. ``GrantCgroup`` names these paths, ``LimitOutcome`` says how one
limit fared (never silently dropped), ``CgroupStatus`` whether fiberd carves at all.

The helpers here (``join``, ``populated``, ``pids``, ``childless``, ``rmtree``,
``read_int``, ``wait_empty``) do plain file I/O on one directory tree, whichever
hierarchy it is in; they never follow a symbolic link while walking, and a group that
is gone is not an error. They know nothing of v1 mirrors (groups.py does).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_fiber.core.cgroups.devices import DeviceRule
from slurm_fiber.core.cgroups.held_files import forget as forget_held
from slurm_fiber.core.cgroups.held_files import read_held
from slurm_fiber.core.trust.grant import Limits

if TYPE_CHECKING:
    import asyncio

CONTROLLERS: tuple[str, ...] = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
SLOTS_PER_GROUP = 100  # slot leaves per group cgroup (the kernel's rmdir cost grows with siblings)
_SAFE_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
_FIBER_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
FIBERS = "fibers"  # a grant cgroup's subtree of slot groups and leaves (GrantCgroup.fibers)
UNCARVED = "; running uncarved: processes tracked by pidfd, limits not enforced"


@dataclass(frozen=True)
class CgroupStatus:
    """Whether fiberd carves cgroups, and why (one line, for status and audit)."""

    carved: bool
    reason: str
    root: Path | None

    @property
    def cause(self) -> str:
        """The reason without the uncarved mode's standard consequences (for limit records)."""
        return self.reason.removesuffix(UNCARVED)

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
    backend: str = ""  # what enforces it when not the manager's backend ("cgroup v1 memory")

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
    devices: DeviceRule | None = None  # the grant's device confinement (v1 devices only)

    @property
    def template(self) -> Path:
        return self.path / "template"

    @property
    def fibers(self) -> Path:
        """The parent of every slot leaf (spares and fibers), not of the template."""
        return self.path / FIBERS

    def group(self, name: str) -> Path:
        """The slot group ``name`` (a cgroup under ``fibers``)."""
        return self.fibers / f"group-{name}"

    def slot(self, spare_id: str, group: str = "0") -> Path:
        """The leaf a spare fiber process joins, and keeps once it becomes a fiber, in
        slot group ``group``; raises ValueError on an id unsafe as a file name."""
        if not _FIBER_ID.fullmatch(spare_id):
            raise ValueError(f"spare id {spare_id!r} is not [A-Za-z0-9_-]{{1,64}}")
        return self.group(group) / f"slot-{spare_id}"


def safe_name(uid: str) -> str:
    """A directory-safe, collision-free name for a grant UID.

    UIDs made only of ``[A-Za-z0-9._-]`` are used as they are; others get
    their other characters replaced and a hash of the UID appended.
    """
    if _SAFE_NAME.fullmatch(uid) and uid not in {".", ".."}:
        return uid
    digest = hashlib.sha256(uid.encode()).hexdigest()[:10]
    return re.sub(r"[^A-Za-z0-9._-]", "_", uid)[:100] + "-" + digest


def join(cgroup: Path, pid: int = 0) -> None:
    """Move ``pid`` (0: the caller) into ``cgroup``. Raises OSError on failure."""
    (cgroup / "cgroup.procs").write_text(f"{pid}\n")


def populated(cgroup: Path) -> bool:
    """Whether any process lives in the subtree (False once the cgroup is gone)."""
    try:
        text = read_held(str(cgroup), "cgroup.events")  # at every fiber's end: kept open
    except FileNotFoundError:  # gone, or a v1 group (no events file): look at its pids
        return any(procs.split() for procs in _procs_by_group(cgroup))
    return "\npopulated 1\n" in "\n" + text


def pids(cgroup: Path) -> list[int]:
    """Pids in the subtree (empty when it is gone)."""
    return [int(p) for procs in _procs_by_group(cgroup) for p in procs.split()]


def _procs_by_group(cgroup: Path) -> Iterator[str]:
    """The ``cgroup.procs`` text of ``cgroup`` and of each group below it, lazily (a
    group's children are listed only after its own pids were taken: a v1 fiber's end
    asks whether its leaf is empty, and a live process answers at once). Groups that
    vanish meanwhile are skipped; symlinks are not followed (the epilog reads a job's
    groups as root: cgroupfs holds none, and a name that were one is not opened). A group
    that is ``childless`` is not listed (a fiber's leaf, mostly)."""
    stack = [os.fspath(cgroup)]
    while stack:
        group = stack.pop()
        try:
            fd = os.open(os.path.join(group, "cgroup.procs"),
                         os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            continue
        try:
            procs = b"".join(iter(functools.partial(os.read, fd, 65536), b"")).decode()
        finally:
            os.close(fd)
        yield procs
        if childless(group):
            continue
        with contextlib.suppress(FileNotFoundError), os.scandir(group) as entries:
            stack += [e.path for e in entries if e.is_dir(follow_symlinks=False)]


def childless(group: str | Path) -> bool:
    """Whether the cgroup ``group`` exists and holds no sub-group, from one ``lstat``:
    cgroupfs (kernfs) keeps a directory's link count at 2 plus its sub-directories (a
    filesystem that does not count them says 1: not childless). Never raises."""
    try:
        st = os.lstat(group)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_nlink == 2


def has_children(group: Path) -> bool:
    """Whether ``group`` holds a sub-directory (False when it cannot be listed)."""
    try:
        with os.scandir(group) as entries:
            return any(e.is_dir(follow_symlinks=False) for e in entries)
    except OSError:
        return False


def rmtree(cgroup: Path) -> None:
    forget_held(str(cgroup))
    try:
        os.rmdir(cgroup)  # the common case: an empty leaf
        return
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
    for dirpath, _, _ in sorted(os.walk(cgroup), key=lambda w: -len(w[0])):
        forget_held(dirpath)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(dirpath)


def read_int(group: str, name: str) -> int | None:
    """The first number in ``group``'s control file ``name`` (kept open: core/
    held_files.py; a fiber's end reads several of its leaf's), None when unreadable."""
    try:
        return int(read_held(group, name).split()[0])
    except (OSError, ValueError, IndexError):
        return None


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
