"""Cgroup carving (v2, v1, hybrid): a child per grant, one per fiber, under the home's root.

Layout under the root (``CgroupRoot`` of the home)::

    <root>/grant-<safe uid>/template                     the grant's warm template (a leaf)
    <root>/grant-<safe uid>/fibers/group-<k>/slot-<n>    one leaf per spare, kept by the
                                                         fiber it becomes

The template lives in its own leaf because cgroup v2 forbids processes in a
cgroup whose ``subtree_control`` enables controllers. Every spare and fiber
of a grant is under its ``fibers`` cgroup, beside the template, so one
``cgroup.kill`` there ends them all and not the template, which reaps them
and reports their exits. Slot leaves come in groups of ``SLOTS_PER_GROUP``:
the kernel's rmdir of a cgroup that ran a process costs time in proportion
to its siblings (measured on 6.x: 9,900 flat leaves in five hierarchies took
4.5-6.8 s to remove, in groups of 100 1.4 s), and a mass stop removes
thousands. A group left empty once its slots are gone is removed
(``remove_if_empty``). Controllers (memory,
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

On a host with cgroup v1 hierarchies (``CgroupManager``'s ``backend``:
``hybrid`` or ``v1``, docs/design.md §4), the same tree is mirrored in the v1
memory, pids, cpu and devices hierarchies under fiberd's own v1 cgroups
(``V1Layout``, ``mirrors``); the limits of those controllers are written and
read back there (``write_limits_v1``), devices are denied but the grant's
own and the pseudo-devices (``confine_devices``), and every process joins
its v1 groups before its primary one (spares do it before any Clone). The cpu
hierarchy stops at the template: a grant's fibers stay in their template's
cpu group (``mirrors``), under the grant's quota like it. OOM
kills are read from ``memory.events`` or the v1 ``memory.oom_control``
(``oom_kills``). With ``v1``, the primary tree is the v1 freezer hierarchy:
stop freezes, kills and thaws; emptiness is polled from ``cgroup.procs``.

Without a usable root (none given, missing, not cgroup v2, not writable, and
no v1 backend) the manager is *uncarved*: ``status.carved`` is False with a one-line reason,
every carve returns None and callers track processes by pidfd alone.

``CgroupManager.sweep()`` removes every grant cgroup left under the root by
a fiberd that died; it assumes the root belongs to one fiberd at a time
(one per job or Pod), which is how homes hand it out.

The module-level helpers (``join``, ``kill``, ``populated``, ``wait_empty``,
``remove_tree``, ``enable_controllers``, ``write_limits``) do plain file I/O
and work on any directory tree, so the limit logic is testable on a fake one;
``mkdir``, ``remove_tree``, ``memory_peak`` and ``oom_kills`` include a
group's registered v1 mirrors.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import re
import signal
import stat
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_fiber.core.cgroups.held_files import forget as forget_held
from slurm_fiber.core.cgroups.held_files import read_held, write_held
from slurm_fiber.core.devices import Device
from slurm_fiber.core.trust.grant import Limits
from slurm_fiber.record import record

if TYPE_CHECKING:
    import asyncio

CONTROLLERS: tuple[str, ...] = ("memory", "pids", "cpu")
BACKEND = "cgroup v2"  # how the enforcement record names what writes these limits
CPU_PERIOD_US = 100_000
SLOTS_PER_GROUP = 100  # slot leaves per group cgroup (see the module doc)
_SAFE_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
_FIBER_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
FIBERS = "fibers"  # a grant cgroup's subtree of slot groups and leaves (GrantCgroup.fibers)


@record(frozen=True)
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


@record(frozen=True)
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


@record(frozen=True)
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


# ---------------------------------------------------------------- file helpers


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


def kill(cgroup: Path) -> None:
    """SIGKILL every process in the subtree; returns at once (see ``wait_empty``).

    Uses ``cgroup.kill``; a v1 freezer group is frozen, signalled and thawed; a
    group with neither (another v1 hierarchy, an older kernel) has each listed pid
    signalled. A cgroup that no longer exists is not an error.
    """
    if (cgroup / "freezer.state").exists():  # v1 freezer
        _freeze_kill(cgroup)
        return
    kill_file = cgroup / "cgroup.kill"
    if kill_file.exists():  # v1 has none, and creating one there is refused (EACCES)
        try:
            kill_file.write_text("1\n")
            return
        except FileNotFoundError:
            pass
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
    loop where that matters. The cgroup's v1 mirrors (``mirrors``) go with it.
    """
    for path in (cgroup, *mirrors(cgroup)):
        _rmtree(path)


def _rmtree(cgroup: Path) -> None:
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
    """``memory.peak`` in bytes where the v2 memory controller provides it, else the v1
    mirror's ``memory.max_usage_in_bytes``, else None."""
    v2, v1 = _memory_of(cgroup)
    peak = _read_int(v2, "memory.peak") if v2 is not None else None
    if peak is None and v1 is not None:
        peak = _read_int(v1, "memory.max_usage_in_bytes")
    return peak


# ---------------------------------------------------------------- cgroup v1 (and hybrid)

V1_LIMITED: tuple[str, ...] = ("memory", "pids", "cpu", "devices")  # v1 hierarchies carved
V1_NOT_PER_FIBER: tuple[str, ...] = ("cpu",)  # where fibers keep their template's group
V1_TREE_PREFIX = "slurm-fiber."  # + pid: fiberd's carving root in each v1 hierarchy
PROC_MOUNTINFO = "/proc/self/mountinfo"
PROC_CGROUP = "/proc/self/cgroup"
# The pseudo-devices every process may open under a v1 device rule (null, zero, full,
# random, urandom, tty, ptmx and the pts terminals), as runc's default allow list.
PSEUDO_DEVICES: tuple[str, ...] = ("c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm",
                                   "c 1:9 rwm", "c 5:0 rwm", "c 5:2 rwm", "c 136:* rwm")
NVIDIA_MAJOR = 195  # /dev/nvidia<N>; a granted one also needs nvidiactl (255), modeset (254)
_NVIDIA_UVM = ("nvidia-uvm",)  # /proc/devices names whose every minor a granted NVIDIA GPU needs


@record(frozen=True)
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


@record(frozen=True)
class DeviceRule:
    """How a grant's device cgroup fared: ``confined`` when ``devices.deny a`` and the
    allow list hold (read back from ``devices.list``), else ``reason`` says why not."""

    confined: bool
    allowed: tuple[str, ...]
    reason: str


# Mirrors: a carving root (where stop and emptiness are read) -> the v1 roots under which
# the same relative groups carry limits and devices. Registered by the manager so the
# module's path helpers (mkdir, memory_peak, oom_kills, remove_tree, mirrors) see them.
_MIRRORS: dict[Path, tuple[Path, ...]] = {}


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


def _mirror(cgroup: Path, controller: str) -> Path | None:
    """``cgroup``'s mirror in the v1 hierarchy of ``controller``, None without one."""
    found = _mirrored(cgroup)
    if found is None:
        return None
    return next((m / found[1] for m in found[0] if _carries(m, controller)), None)


@functools.lru_cache(maxsize=4096)
def _memory_of(cgroup: Path) -> tuple[str | None, str | None]:
    """Where ``cgroup``'s memory is counted, as path texts: the group itself when its parent
    enables v2 memory (else None), and its v1 memory mirror (else None). Cached as
    ``mirrors`` is: a fiber's end reads its peak, OOM count and usage through them."""
    v1 = _mirror(cgroup, "memory")
    return (str(cgroup) if _v2_memory(cgroup.parent) else None,
            str(v1) if v1 is not None else None)


def _mirrors_changed() -> None:
    """Forget what was derived from the mirrors (after ``_MIRRORS`` changed)."""
    mirrors.cache_clear()
    _memory_of.cache_clear()


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


def mkdir(cgroup: Path) -> None:
    """Create ``cgroup`` and its mirrors (existing ones are fine); hand their
    ``cgroup.procs`` to the account fibers run as, where one is set (``hand_procs``).
    Raises OSError."""
    for path in (cgroup, *mirrors(cgroup)):
        path.mkdir(exist_ok=True)
    if _PROCS_OWNERS:
        _hand_procs(cgroup)


# Carving root -> (uid, v2 tree) of the account a root fiberd's templates and fibers run
# as (core/identity.py). That account may write only the ``cgroup.procs`` of its grants'
# leaves (template, slots) and, in a v2 tree, of the grant's own group (a move between
# two leaves needs write access at their common ancestor): it moves between its grant's
# groups, never out of its grant, and writes no limit or device rule.
_PROCS_OWNERS: dict[Path, tuple[int, bool]] = {}


def _hand_procs(cgroup: Path) -> None:
    text = str(cgroup)
    for root, (uid, v2) in _PROCS_OWNERS.items():
        if not text.startswith(str(root) + "/"):
            continue
        parts = text[len(str(root)) + 1:].split("/")
        if len(parts) == 1 and v2:
            os.chown(cgroup / "cgroup.procs", uid, -1)
        elif len(parts) > 1 and (parts[-1] == "template" or parts[-1].startswith("slot-")):
            for path in (cgroup, *mirrors(cgroup)):
                os.chown(path / "cgroup.procs", uid, -1)
        return


def mkdir_group(group: Path) -> None:
    """Create a slot group (``GrantCgroup.group``) and its mirrors, with the controllers
    its leaves need enabled (v2). Raises OSError."""
    mkdir(group)
    if (group / "cgroup.subtree_control").exists():
        enable_controllers(group)


def remove_if_empty(cgroup: Path) -> None:
    """rmdir ``cgroup`` and its mirrors if nothing is under them (no child, no
    process); a busy or gone one is left as it is. Never raises."""
    for path in (cgroup, *mirrors(cgroup)):
        with contextlib.suppress(OSError):
            os.rmdir(path)


@functools.lru_cache(maxsize=4096)
def _v2_memory(parent: Path) -> bool:
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


RENEW_RESIDUE = 1 << 20  # bytes a v1 leaf may hold charged and still be renewed (see below)


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
    v2, v1 = _memory_of(cgroup)
    if v2 is not None and os.path.exists(f"{v2}/memory.peak"):
        return "cgroup v2 memory.peak counts it (a reset holds for one reader only)"
    if v1 is None:
        return None
    if kills != 0:
        return "its OOM kill count is unknown" if kills is None else f"{kills} OOM kills counted"
    usage = _read_int(v1, "memory.usage_in_bytes")
    if usage is None:
        return f"{v1}/memory.usage_in_bytes cannot be read"
    if usage > RENEW_RESIDUE:
        return f"{usage} bytes still charged to it (more than {RENEW_RESIDUE})"
    try:
        write_held(v1, "memory.max_usage_in_bytes", b"0")
    except OSError as e:
        return f"its memory.max_usage_in_bytes cannot be reset: {e.strerror}"
    return None


def _read_int(group: str, name: str) -> int | None:
    """The first number in ``group``'s control file ``name`` (kept open: core/
    held_files.py; a fiber's end reads several of its leaf's), None when unreadable."""
    try:
        return int(read_held(group, name).split()[0])
    except (OSError, ValueError, IndexError):
        return None


def oom_kills(cgroup: Path) -> int | None:
    """Processes the kernel OOM-killed in this group: ``memory.events`` ``oom_kill`` (v2),
    else the v1 mirror's ``memory.oom_control`` ``oom_kill`` (polled, read at a fiber's
    end; the v1 count is the victim's own group's). None where neither exists."""
    v2, v1 = _memory_of(cgroup)
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


def device_rules(devices: Iterable[Device]) -> tuple[tuple[str, ...], str | None]:
    """The v1 allow rules for a grant's devices (besides ``PSEUDO_DEVICES``), or a reason
    they cannot be listed (a device without a node path, a path that is no device)."""
    rules: list[str] = []
    for device in devices:
        if not device.path:
            return (), f"{device.kind} {device.index} has no device node path to allow"
        try:
            st = os.stat(device.path)
        except OSError as e:
            return (), f"cannot stat {device.path}: {e.strerror}"
        kind = "c" if stat.S_ISCHR(st.st_mode) else "b" if stat.S_ISBLK(st.st_mode) else None
        if kind is None:
            return (), f"{device.path} is not a device node"
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        rules.append(f"{kind} {major}:{minor} rwm")
        if kind == "c" and major == NVIDIA_MAJOR and "/dev/" in device.path:
            rules += [f"c {NVIDIA_MAJOR}:255 rwm", f"c {NVIDIA_MAJOR}:254 rwm"]
            rules += [f"c {m}:* rwm" for m in _char_majors(_NVIDIA_UVM)]
    return tuple(dict.fromkeys(rules)), None


def _char_majors(names: tuple[str, ...]) -> list[int]:
    try:
        text = Path("/proc/devices").read_text().partition("Block devices:")[0]
    except OSError:
        return []
    return [int(m) for m, n in re.findall(r"^\s*(\d+) (\S+)$", text, re.M) if n in names]


def confine_devices(group: Path, devices: Iterable[Device]) -> DeviceRule:
    """``devices.deny a``, then allow the pseudo-devices and the grant's own, on a group
    with no children yet (v1 refuses ``deny a`` below one); read back ``devices.list``."""
    extra, why = device_rules(devices)
    if why is not None:
        return DeviceRule(False, (), f"not confined: {why}")
    allowed = PSEUDO_DEVICES + extra
    try:
        (group / "devices.deny").write_text("a\n")
        for rule in allowed:
            (group / "devices.allow").write_text(rule + "\n")
        listed = set((group / "devices.list").read_text().split("\n"))
    except OSError as e:
        return DeviceRule(False, (), f"not confined: writing {group}/devices.* failed: "
                                     f"{e.strerror}")
    if "a *:* rwm" in listed or not set(allowed) <= listed:
        return DeviceRule(False, (), f"not confined: {group}/devices.list reads "
                                     f"{' | '.join(sorted(listed - {''}))}")
    return DeviceRule(True, allowed, f"devices.deny a; allowed: {', '.join(allowed)}")


def _freeze_kill(group: Path) -> None:
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


# ---------------------------------------------------------------- the manager


BACKEND_CHOICES: tuple[str, ...] = ("auto", "v2", "v1", "hybrid")


class CgroupManager:
    """Carves grant and fiber cgroups under one root; uncarved when the root is unusable.

    Construct once per fiberd (it probes the root: a mkdir/rmdir, no
    blocking waits). All methods are safe to call in uncarved mode: carving
    returns None and removal does nothing. Not thread-safe: used on the loop,
    but ``carve_grant``, which fiberd runs in a worker thread (its mkdirs wait on
    the kernel's cgroup lock), one admission at a time.

    ``backend`` (fiberd's ``cgroup_backend``) picks where limits, devices, stop
    and emptiness live; ``auto`` takes ``hybrid`` when the v2 root is usable and
    a limit controller the v2 tree lacks has a v1 hierarchy, ``v2`` when the v2
    root is usable, ``v1`` when only v1 hierarchies are, else uncarved:

    * ``v2``: everything in the v2 tree (limits where its controllers are).
    * ``hybrid``: the v2 tree keeps processes, stop (``cgroup.kill``), emptiness
      (``cgroup.events``) and moves; each limit whose controller has a v1
      hierarchy is written there (memory, pids, cpu), and devices are confined
      by the v1 devices hierarchy. Same group names in every hierarchy.
    * ``v1``: the v1 freezer hierarchy keeps processes and stop (freeze, kill,
      thaw), emptiness is polled from ``cgroup.procs``; limits and devices as
      in hybrid.

    The v1 groups mirror the carving root's tree: ``<mount>/<fiberd's own v1
    cgroup>/slurm-fiber.<pid>/grant-<uid>/...`` (the v2 tree's own name when fiberd
    delegated from the hierarchy's root); a process joins each (``mirrors``).
    """

    def __init__(self, root: Path | None, why_none: str = "no cgroup root given",
                 backend: str = "v2", v1: V1Layout | None = None) -> None:
        """``why_none``: the home's reason when it gives no root (shown in status and
        audit); ``backend``: fiberd passes its ``cgroup_backend`` (default ``auto``), the
        default here is v2 only, so a manager built on a test tree never makes v1 groups;
        ``v1``: the host's v1 layout (default: read from /proc)."""
        if backend not in BACKEND_CHOICES:
            raise ValueError(f"cgroup_backend {backend!r} is not one of "
                             f"{', '.join(BACKEND_CHOICES)}")
        self.root = root
        self.home_root = root  # the home's root (a v2 tree), even when v1 carves instead
        self.status = _probe(root, why_none)
        self._root_enabled: set[str] | None = None
        self.v1_roots: dict[str, Path] = {}  # controller -> fiberd's v1 carving root
        self.mode = "v2" if self.carved else "none"
        self.backend = BACKEND
        layout = V1Layout.of_self() if v1 is None and backend != "v2" else v1
        if backend == "v2" or layout is None:
            return
        self._choose_v1(backend, layout, why_none)

    def _choose_v1(self, backend: str, layout: V1Layout, why_none: str) -> None:
        # Always this fiberd's own name (the v2 tree's when it delegated from the hierarchy's
        # root): unique per fiberd in hierarchies other fiberds share, and sweepable by pid.
        name = f"{V1_TREE_PREFIX}{os.getpid()}"
        wanted = [c for c in V1_LIMITED if c in layout.mounts]
        v2_lacks = not self.carved or any(c not in self.root_controllers() for c in CONTROLLERS)
        if backend == "auto":
            if self.carved and wanted and v2_lacks:
                backend = "hybrid"
            elif self.carved or "freezer" not in layout.mounts:
                return
            else:
                backend = "v1"
        if backend == "hybrid" and not self.carved:
            self.status = CgroupStatus(False, f"cgroup_backend hybrid needs the v2 tree: "
                                              f"{self.status.cause}" + _UNCARVED, self.root)
            self.mode = "none"
            return
        hierarchies = wanted + (["freezer"] if backend == "v1" else [])
        if backend == "v1" and "freezer" not in layout.mounts:
            self.status = CgroupStatus(False, "cgroup_backend v1 needs a v1 freezer hierarchy"
                                       + _UNCARVED, None)
            self.mode = "none"
            return
        made: dict[str, Path] = {}
        refused: list[str] = []
        for controller in hierarchies:
            path = layout.root(controller, name)
            if path is None:
                continue
            try:
                path.mkdir(exist_ok=True)
            except OSError as e:
                if backend == "v1" and controller == "freezer":
                    self.status = CgroupStatus(False, f"cannot create cgroups under {path}: "
                                                      f"{e.strerror}" + _UNCARVED, path)
                    self.mode = "none"
                    return
                refused.append(f"cannot create {path}: {e.strerror}")
                continue
            made[controller] = path
        if backend == "hybrid" and not made:  # e.g. a job user: v1 hierarchies are root's
            self.status = CgroupStatus(True, f"{self.status.reason}; no cgroup v1 groups "
                                             f"({refused[0] if refused else 'none mounted'}), "
                                             f"v2 only", self.root)
            return
        if backend == "v1":
            self.root = made.pop("freezer")
            self.status = CgroupStatus(True, f"carving under {self.root} (cgroup v1)", self.root)
        self.v1_roots = made
        self.mode = backend
        if self.root is not None:
            _MIRRORS[self.root] = tuple(made.values())
            _mirrors_changed()
        where = ", ".join(f"{c} {p}" for c, p in made.items()) or "none"
        self.status = CgroupStatus(True, f"{self.status.reason}; {backend}: v1 groups in "
                                         f"{where}", self.root)

    def hand_procs(self, uid: int) -> None:
        """Let ``uid`` (the account a root fiberd's fibers run as) move its processes
        between its grants' leaves: the ``cgroup.procs`` of each leaf made from now on
        (and of each grant's group in a v2 tree) is chowned to it. Nothing else is."""
        if self.root is not None and self.carved:
            _PROCS_OWNERS[self.root] = (uid, self.mode != "v1")

    def describe(self) -> str:
        """One line for people: the backend and where stop, emptiness, limits and devices
        live (``fiberctl status``, the quickstart)."""
        if not self.carved:
            return "uncarved"
        stop = ("cgroup v1 freezer" if self.mode == "v1" else "cgroup v2 cgroup.kill")
        events = ("polling cgroup.procs" if self.mode == "v1" else "cgroup v2 cgroup.events")
        limits = [f"{c} v1" if c in self.v1_roots else f"{c} v2" if c in self.root_controllers()
                  else f"{c} none" for c in CONTROLLERS]
        devices = "v1" if "devices" in self.v1_roots else "env only"
        return (f"{self.mode}: stop by {stop}, emptiness by {events}, limits: "
                f"{', '.join(limits)}, devices: {devices}")

    def root_controllers(self) -> set[str]:
        """The v2 controllers enabled for grant cgroups (enabling the offered ones on first
        use). Empty when uncarved or when the root is v1. Blocks briefly on cgroupfs."""
        if not self.carved or self.root is None or self.mode == "v1":
            return set()
        if self._root_enabled is None:
            self._root_enabled = enable_controllers(self.root)
        return self._root_enabled

    def predict(self, limits: Limits) -> tuple[LimitOutcome, ...] | None:
        """How ``carve_grant`` would fare with ``limits``, without carving: None when
        uncarved, else one outcome per limit set, enforced where its controller is
        enabled for grant cgroups (v2) or has a v1 group. (A write the kernel refuses
        is only seen by carving.)"""
        if not self.carved or self.root is None:
            return None
        enabled = self.root_controllers()
        offered = controllers(self.root) if self.mode != "v1" else set()
        out = []
        for controller, file, value in limit_plan(limits):
            if controller in self.v1_roots:
                out.append(LimitOutcome(file, value, True, "", f"cgroup v1 {controller}"))
                continue
            if controller in enabled:
                out.append(LimitOutcome(file, value, True))
                continue
            if self.mode == "v1":
                why = "not mounted as a cgroup v1 hierarchy here"
            else:
                why = (f"not enabled for cgroups under {self.root}" if controller in offered
                       else f"not available to {self.root} (its cgroup v2 offers: "
                            f"{' '.join(sorted(offered)) or 'none'}"
                            + (")" if self.mode == "v2" else "; no cgroup v1 hierarchy either)"))
            out.append(LimitOutcome(file, value, False,
                                    f"not enforced: the {controller} controller is {why}"))
        return tuple(out)

    @property
    def confines_devices(self) -> bool:
        """Whether grants' devices are confined by a v1 device cgroup here."""
        return self.carved and "devices" in self.v1_roots

    @property
    def carved(self) -> bool:
        return self.status.carved

    def grant_path(self, uid: str) -> Path | None:
        """Where the grant's cgroup is (or would be); None when uncarved."""
        if not self.carved or self.root is None:
            return None
        return self.root / f"grant-{safe_name(uid)}"

    def carve_grant(self, uid: str, limits: Limits,
                    devices: Iterable[Device] = ()) -> GrantCgroup | None:
        """Create (or reuse) the grant's cgroup and template leaf, write its limits and,
        with a v1 devices hierarchy, confine it to ``devices`` and the pseudo-devices.

        Called at admission, not on the Clone path. Returns None when
        uncarved; raises OSError when the root refuses a mkdir.
        """
        path = self.grant_path(uid)
        if path is None or self.root is None:
            return None
        self.root_controllers()
        fresh = not path.exists()
        mkdir(path)
        rule = None
        if "devices" in self.v1_roots:
            group = self.v1_roots["devices"] / path.name
            rule = (confine_devices(group, devices) if fresh or not _has_children(group)
                    else self._kept_rule(group, devices))
        outcomes: list[LimitOutcome] = []
        if self.mode != "v1":
            enable_controllers(path)
        v1 = write_limits_v1({c: r / path.name for c, r in self.v1_roots.items()}, limits)
        v1_limits = {o.limit for o in v1}
        if self.mode != "v1":
            outcomes = [o for o in write_limits(path, limits) if o.limit not in v1_limits]
        else:
            outcomes = [LimitOutcome(f, v, False, "not enforced: the {c} controller is not "
                                                  "mounted as a cgroup v1 hierarchy here")
                        for c, f, v in limit_plan(limits) if c not in v1_limits]
        order = [c for c, _, _ in limit_plan(limits)]
        merged = sorted([*outcomes, *v1], key=lambda o: order.index(o.limit))
        grant = GrantCgroup(uid, path, tuple(merged), rule)
        mkdir(grant.template)
        mkdir(grant.fibers)
        if self.mode != "v1":
            enable_controllers(grant.fibers)
        return grant

    @staticmethod
    def _kept_rule(group: Path, devices: Iterable[Device]) -> DeviceRule:
        """A re-carved grant (a renewal) keeps the rule written at admission: v1 refuses
        ``deny a`` on a group with children. Said as it reads back."""
        extra, why = device_rules(devices)
        try:
            listed = set((group / "devices.list").read_text().split("\n")) - {""}
        except OSError as e:
            return DeviceRule(False, (), f"not confined: {group}/devices.list: {e.strerror}")
        if why is not None or "a *:* rwm" in listed:
            return DeviceRule(False, (), f"not confined: {why or 'everything is allowed'}")
        return DeviceRule(True, PSEUDO_DEVICES + extra,
                          f"devices.deny a; allowed: {', '.join(sorted(listed))}")

    async def remove_grant(self, uid: str) -> None:
        """Kill everything left in the grant's cgroup, wait until empty, remove it."""
        path = self.grant_path(uid)
        if path is not None:
            await kill_and_remove(path)

    async def sweep(self) -> list[Path]:
        """Remove every grant cgroup under the root and its v1 mirrors (a dead fiberd's
        leftovers). Called at fiberd start before any grant is carved. Returns the
        removed paths; an uncarved manager removes nothing.
        """
        if not self.carved or self.root is None:
            return []
        removed: list[Path] = []
        for child in sorted(self.root.iterdir()):
            if child.is_dir() and child.name.startswith("grant-"):
                await kill_and_remove(child)
                removed.append(child)
        for v1root in self.v1_roots.values():  # mirrors left without a primary group
            for child in sorted(v1root.iterdir()):
                if child.is_dir() and child.name.startswith("grant-"):
                    await kill_and_remove(child)
                    removed.append(child)
        return removed

    def close(self) -> list[str]:
        """Remove the v1 carving roots (call at shutdown, after the grants are removed).
        Never raises; blocks at most ~0.5 s per root still busy with an exiting task;
        one line per root that could not be removed."""
        failures = []
        if self.root is not None:
            _MIRRORS.pop(self.root, None)
            _PROCS_OWNERS.pop(self.root, None)
            _mirrors_changed()
        roots = [*self.v1_roots.values(), *([self.root] if self.mode == "v1" and self.root
                                            else [])]
        for path in roots:
            for attempt in range(50):  # a group's last exiting task may hold it a moment
                try:
                    _rmtree(path)
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or attempt == 49:
                        failures.append(f"cannot remove {path}: {e.strerror}")
                        break
                    time.sleep(0.01)
        return failures


def _has_children(group: Path) -> bool:
    try:
        with os.scandir(group) as entries:
            return any(e.is_dir(follow_symlinks=False) for e in entries)
    except OSError:
        return False


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
    "BACKEND",
    "BACKEND_CHOICES",
    "CONTROLLERS",
    "PSEUDO_DEVICES",
    "SLOTS_PER_GROUP",
    "CgroupManager",
    "CgroupStatus",
    "DeviceRule",
    "GrantCgroup",
    "LimitOutcome",
    "V1Layout",
    "confine_devices",
    "controllers",
    "device_rules",
    "empty",
    "enable_controllers",
    "join",
    "kill",
    "kill_and_remove",
    "limit_plan",
    "memory_peak",
    "mirrors",
    "mkdir",
    "mkdir_group",
    "oom_kills",
    "pids",
    "populated",
    "remove_if_empty",
    "remove_tree",
    "safe_name",
    "wait_empty",
    "write_limits",
    "write_limits_v1",
]
