"""The cgroup manager: which backend carves a grant's tree where, and what a grant's record says.

One ``CgroupManager`` per fiberd, on the carving root its home gives. It chooses the
backend (fiberd's ``cgroup_backend``; ``auto`` picks ``hybrid`` when the v2 root is
usable and a limit controller the v2 tree lacks has a v1 hierarchy, ``v2`` when the v2
root is usable, ``v1`` when only v1 hierarchies are, else uncarved), carves each
grant's tree (common.GrantCgroup) at admission with its limits and device rule, says
beforehand how a grant's limits would fare (``predict``: the admission's enforcement
record and ``--strict-limits``), removes grants and a dead fiberd's leftovers
(``sweep``). It decides; the backends do the file work: v2.py (controllers, limits),
v1.py (mirrors, v1 limits, the freezer), devices.py (the v1 device rule), groups.py
(a group in all its hierarchies), memory.py (peaks and OOM kills at a fiber's end).

Without a usable root (none given, missing, not cgroup v2, not writable, and no v1
backend) the manager is *uncarved*: ``status.carved`` is False with a one-line reason,
every carve returns None and callers track processes by pidfd alone; every limit is
reported ``not enforced`` with that reason, never silently dropped. ``sweep`` assumes
the root belongs to one fiberd at a time (one per job or Pod), which is how homes hand
it out.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterable
from pathlib import Path

from slurm_fiber.core.cgroups.common import (
    CONTROLLERS,
    UNCARVED,
    CgroupStatus,
    GrantCgroup,
    LimitOutcome,
    has_children,
    limit_plan,
    rmtree,
    safe_name,
)
from slurm_fiber.core.cgroups.devices import confine_devices, kept_rule
from slurm_fiber.core.cgroups.groups import (
    forget_procs_owner,
    hand_procs,
    kill_and_remove,
    mkdir,
)
from slurm_fiber.core.cgroups.v1 import (
    V1_LIMITED,
    V1_TREE_PREFIX,
    V1Layout,
    drop_mirrors,
    register_mirrors,
    write_limits_v1,
)
from slurm_fiber.core.cgroups.v2 import (
    BACKEND,
    controllers,
    enable_controllers,
    probe,
    write_limits,
)
from slurm_fiber.core.devices import Device
from slurm_fiber.core.trust.grant import Limits

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
        self.status = probe(root, why_none)
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
                                              f"{self.status.cause}" + UNCARVED, self.root)
            self.mode = "none"
            return
        hierarchies = wanted + (["freezer"] if backend == "v1" else [])
        if backend == "v1" and "freezer" not in layout.mounts:
            self.status = CgroupStatus(False, "cgroup_backend v1 needs a v1 freezer hierarchy"
                                       + UNCARVED, None)
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
                                                      f"{e.strerror}" + UNCARVED, path)
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
            register_mirrors(self.root, tuple(made.values()))
        where = ", ".join(f"{c} {p}" for c, p in made.items()) or "none"
        self.status = CgroupStatus(True, f"{self.status.reason}; {backend}: v1 groups in "
                                         f"{where}", self.root)

    def hand_procs(self, uid: int) -> None:
        """Let ``uid`` (the account a root fiberd's fibers run as) move its processes
        between its grants' leaves: the ``cgroup.procs`` of each leaf made from now on
        (and of each grant's group in a v2 tree) is chowned to it. Nothing else is."""
        if self.root is not None and self.carved:
            hand_procs(self.root, uid, self.mode != "v1")

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
            rule = (confine_devices(group, devices) if fresh or not has_children(group)
                    else kept_rule(group, devices))
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
            drop_mirrors(self.root)
            forget_procs_owner(self.root)
        roots = [*self.v1_roots.values(), *([self.root] if self.mode == "v1" and self.root
                                            else [])]
        for path in roots:
            for attempt in range(50):  # a group's last exiting task may hold it a moment
                try:
                    rmtree(path)
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or attempt == 49:
                        failures.append(f"cannot remove {path}: {e.strerror}")
                        break
                    time.sleep(0.01)
        return failures
