"""Where fiberd may carve cgroups: a configured root, or a subtree of its own cgroup v2.

``resolve_cgroup_root`` turns the ``cgroup_root`` setting into a placement:
a path (used as given when it is a cgroup v2 directory), ``"delegate"`` or
``None`` (run uncarved). Delegation finds the unified hierarchy in
``/proc/self/mountinfo`` and this process's cgroup in ``/proc/self/cgroup``,
then, for the no-internal-processes rule, moves the whole process into a
leaf child named ``_fiberd`` (a name no grant UID can take, since UIDs start
with a letter or digit) and hands out the parent to carve. Already in a
``_fiberd`` leaf (a restart), it carves that leaf's parent and moves
nothing. In the hierarchy's root, which belongs to the whole host, it first
creates ``slurm-fiber.<pid>`` and delegates that instead, unless the caller
says the root is its own (``root_is_ours``): a container sees its own cgroup
as "/" of its cgroup namespace (or as the root of the cgroup2 mount it was
given), and then carves that root itself, the nested-delegation pattern.

A placement without a root always carries a one-line reason; nothing here
raises for a machine that lacks a usable cgroup v2. ``Delegation.undo``
moves the process back and removes what delegation created. A fiberd killed
before it could undo leaves its ``slurm-fiber.<pid>`` tree; the next
fiberd's start-up sweep (homes.sweep) removes it.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field

SELF_LEAF = "_fiberd"
TREE_PREFIX = "slurm-fiber."  # + pid: the tree a fiberd delegates itself in the hierarchy's root
DELEGATE = "delegate"
PROC_MOUNTINFO = "/proc/self/mountinfo"
PROC_CGROUP = "/proc/self/cgroup"


def unified_mount(mountinfo: str) -> tuple[str, str] | None:
    """The first cgroup2 mount in a mountinfo text: (mount point, root inside the fs)."""
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields = head.split()
        if sep and tail.split()[:1] == ["cgroup2"] and len(fields) >= 5:
            return _unescape(fields[4]), _unescape(fields[3])
    return None


def own_cgroup(proc_cgroup: str) -> str | None:
    """This process's cgroup v2 path (the ``0::`` line), None when it has none."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def _unescape(value: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040)."""
    for code in ("040", "011", "012", "134"):
        value = value.replace("\\" + code, chr(int(code, 8)))
    return value


@dataclass
class Delegation:
    """What delegation did: the ``root`` to carve, the ``leaf`` this process moved into.

    ``origin`` is the cgroup the process was in before, ``created`` the
    directories delegation made (outermost first), ``moved`` whether the
    process was moved at all.
    """

    root: str
    leaf: str
    origin: str
    created: list[str] = field(default_factory=list)
    moved: bool = False

    def undo(self) -> list[str]:
        """Move this process back to ``origin`` and remove what delegation created.

        Call it at shutdown, after fiberd removed its own cgroups. Never
        raises; returns one line per step that failed (empty: all undone).
        Idempotent.
        """
        failures: list[str] = []
        if self.moved:
            try:
                _move_self(self.origin)
                self.moved = False
            except OSError as err:
                failures.append(f"cannot move fiberd back to {self.origin}: {err.strerror}")
                return failures
        for path in reversed(self.created):
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError as err:
                failures.append(f"cannot remove {path}: {err.strerror}")
        self.created = [p for p in self.created if os.path.isdir(p)]
        return failures


@dataclass(frozen=True)
class Placement:
    """Where fiberd carves: ``root`` (None: nowhere), ``reason`` in one line, any delegation."""

    root: str | None
    reason: str
    delegation: Delegation | None = None


def resolve_cgroup_root(
    setting: str | None,
    *,
    mountinfo_path: str = PROC_MOUNTINFO,
    cgroup_path: str = PROC_CGROUP,
    root_is_ours: bool = False,
) -> Placement:
    """Turn the ``cgroup_root`` setting into a placement; never raises.

    ``None``: run uncarved. A path: used when it is a cgroup v2 directory.
    ``"delegate"``: a subtree of this process's own cgroup; this moves the
    whole process (all its threads) into a leaf, so call it once, early,
    from fiberd itself. ``root_is_ours``: the mounted hierarchy's root is
    this container's own cgroup (see ``delegate``). Blocks briefly on /proc
    and cgroupfs.
    """
    if setting is None:
        return Placement(None, "cgroup_root is none: fiberd runs uncarved")
    if setting != DELEGATE:
        return _configured(setting)
    try:
        mountinfo = _read(mountinfo_path)
        cgroup = _read(cgroup_path)
    except OSError as err:
        return Placement(None, f"cannot read this process's cgroups: {err.strerror}")
    return delegate(mountinfo, cgroup, root_is_ours=root_is_ours)


def _configured(path: str) -> Placement:
    if not os.path.isdir(path):
        return Placement(None, f"cgroup_root {path} does not exist or is not a directory")
    if not os.path.isfile(os.path.join(path, "cgroup.procs")):
        return Placement(None, f"cgroup_root {path} is not a cgroup v2 directory (no cgroup.procs)")
    if not os.access(path, os.W_OK):
        return Placement(None, f"cgroup_root {path} is not writable by fiberd")
    return Placement(path, f"cgroup_root {path} from configuration")


def delegate(mountinfo: str, proc_cgroup: str, *, root_is_ours: bool = False) -> Placement:
    """Delegate a subtree of this process's cgroup, given the two /proc texts; never raises.

    A process in the mounted hierarchy's root carves a ``slurm-fiber.<pid>``
    child of it, or with ``root_is_ours`` (a container, whose cgroup
    namespace root is its own cgroup) the root itself.
    """
    mount = unified_mount(mountinfo)
    if mount is None:
        return Placement(None, "no cgroup v2 (unified) hierarchy is mounted")
    mount_point, mount_root = mount
    cgroup = own_cgroup(proc_cgroup)
    if cgroup is None:
        return Placement(None, "this process has no cgroup v2 membership (cgroup v1 only)")
    relative = _relative(cgroup, mount_root)
    if relative is None:
        return Placement(
            None, f"this process's cgroup {cgroup} is outside the mounted hierarchy {mount_point}"
        )
    here = os.path.join(mount_point, relative) if relative else mount_point
    ours = root_is_ours and not relative
    try:
        delegation = _carve(here, is_root=not relative and not ours)
    except OSError as err:
        return Placement(None, f"cannot delegate a cgroup under {here}: {err.strerror}")
    whose = "the container's cgroup namespace root" if ours else "fiberd's own cgroup"
    return Placement(delegation.root, f"delegated from {whose} {here}", delegation)


def _relative(cgroup: str, mount_root: str) -> str | None:
    """The cgroup's path below the mount point ("" for the mount's root), None outside it."""
    root = mount_root.rstrip("/")
    if cgroup != root and not cgroup.startswith(root + "/"):
        return None
    rest = cgroup[len(root):].strip("/")
    return None if ".." in rest.split("/") else rest


def _carve(here: str, *, is_root: bool) -> Delegation:
    """Move this process into a ``_fiberd`` leaf and return the delegation; raises OSError."""
    if os.path.basename(here) == SELF_LEAF:
        return Delegation(os.path.dirname(here), here, here)
    created: list[str] = []
    root = here
    try:
        if is_root:
            root = os.path.join(here, f"{TREE_PREFIX}{os.getpid()}")
            os.mkdir(root)
            created.append(root)
        leaf = os.path.join(root, SELF_LEAF)
        if _mkdir_new(leaf):
            created.append(leaf)
        _move_self(leaf)
    except OSError:
        Delegation(root, root, here, created).undo()
        raise
    return Delegation(root, leaf, here, created, moved=True)


def _mkdir_new(path: str) -> bool:
    """Create ``path``; False when it already existed."""
    try:
        os.mkdir(path)
    except OSError as err:
        if err.errno != errno.EEXIST:
            raise
        return False
    return True


def _move_self(cgroup_dir: str) -> None:
    with open(os.path.join(cgroup_dir, "cgroup.procs"), "w") as procs:
        procs.write(str(os.getpid()))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()
