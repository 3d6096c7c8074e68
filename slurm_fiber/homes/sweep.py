"""The start-up sweep: what a dead predecessor fiberd left behind, cleared before serving.

A fiberd killed with SIGKILL cleans nothing up, and two things of it outlive it:

* **its cgroup tree.** Carving from the hierarchy's root, each fiberd
  delegates itself ``slurm-fiber.<pid>`` (cgroupdelegate), so the next one,
  with another pid, carves a new tree and its own sweep
  (``CgroupManager.sweep``: ``grant-*`` under its root) never sees the old
  one, nor any process that outlived its template's death signal in it.
  With cgroup v1 groups (the hybrid and v1 backends) its ``slurm-fiber.<pid>``
  trees in each v1 hierarchy are swept the same way, after the process tree.
  ``sweep_cgroups`` runs that own sweep and then removes every sibling
  ``slurm-fiber.<pid>`` whose owner is dead: ``cgroup.kill`` (every process
  left in it), a bounded wait until it is empty, then ``rmdir`` bottom-up.
  A tree is touched only when its name is fiberd's (``slurm-fiber.`` and
  digits) and its owner is dead: no live, non-zombie process has that pid
  and nothing lives in its ``_fiberd`` leaf (a fiberd in another pid
  namespace). It runs before the socket serves, so nothing is carved yet.
* **its readiness.** ``ready.json`` (the job's Comment, the Pod's
  condition) still says ready. ``reset_readiness`` publishes "not ready"
  through the home once this fiberd holds the socket (so a live fiberd's
  readiness is never overwritten); the first warm template flips it back.

Both never raise for what they find: failures are logged and reported in
their result, which the caller puts in the audit log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from slurm_fiber.core.cgroups.common import pids as cgroup_pids
from slurm_fiber.core.cgroups.common import populated as cgroup_populated
from slurm_fiber.core.cgroups.common import wait_empty
from slurm_fiber.core.cgroups.groups import kill as cgroup_kill
from slurm_fiber.core.cgroups.groups import remove_tree
from slurm_fiber.core.cgroups.manager import CgroupManager
from slurm_fiber.core.seam import Readiness
from slurm_fiber.homes.cgroupdelegate import SELF_LEAF, TREE_PREFIX

log = logging.getLogger("slurm_fiber.sweep")

TREE_NAME = re.compile(re.escape(TREE_PREFIX) + r"([1-9][0-9]{0,9})")
EMPTY_WITHIN = 10.0  # seconds a swept tree may take to empty after cgroup.kill
READY_RESET_WITHIN = 5.0  # seconds the "not ready" publish may hold up delivery at start


@dataclass(frozen=True)
class SweptTree:
    """A dead predecessor's cgroup tree: its owner pid, the pids killed in it, and whether
    it is gone (``problem`` says why not)."""

    path: Path
    owner: int
    killed: tuple[int, ...]
    removed: bool
    problem: str | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"path": str(self.path), "owner_pid": self.owner,
                                  "killed": list(self.killed), "removed": self.removed}
        if self.problem:
            out["problem"] = self.problem
        return out


@dataclass(frozen=True)
class CgroupSweep:
    """What the start-up sweep removed: the own root's grant cgroups and dead trees."""

    grants: tuple[Path, ...]
    trees: tuple[SweptTree, ...]

    def paths(self) -> list[str]:
        """Every path swept, for the start record."""
        return [str(p) for p in self.grants] + [str(t.path) for t in self.trees]


def owner_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True  # unreadable: assume alive, never sweep on doubt
    state = stat.rpartition(b")")[2].split()[:1]
    return state != [b"Z"]


def dead_trees(parent: Path, own: Path) -> list[tuple[Path, int]]:
    """The ``slurm-fiber.<pid>`` directories beside ``own`` whose owner is dead."""
    found: list[tuple[Path, int]] = []
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return found
    for name in names:
        match = TREE_NAME.fullmatch(name)
        path = parent / name
        if match is None or path == own or not path.is_dir() or path.is_symlink():
            continue
        pid = int(match.group(1))
        if owner_alive(pid) or cgroup_populated(path / SELF_LEAF):
            continue
        found.append((path, pid))
    return found


async def sweep_tree(path: Path, owner: int, within: float = EMPTY_WITHIN) -> SweptTree:
    """Kill what is left in a dead tree, wait (at most ``within`` s) until it is empty,
    remove it bottom-up. Never raises for the tree's state."""
    killed = tuple(cgroup_pids(path))
    try:
        if killed:
            cgroup_kill(path)
            await asyncio.wait_for(wait_empty(path), within)
        await asyncio.to_thread(remove_tree, path)
    except TimeoutError:
        return SweptTree(path, owner, killed, False,
                         f"still populated {within:g} s after cgroup.kill")
    except OSError as err:
        return SweptTree(path, owner, killed, False, f"not removed: {err.strerror or err}")
    return SweptTree(path, owner, killed, True)


async def sweep_cgroups(manager: CgroupManager) -> CgroupSweep:
    """Sweep the own root's leftover grant cgroups, then dead predecessors' trees beside it
    (only when the root is this process's ``slurm-fiber.<pid>``). Call once at start, before
    anything is carved. Blocks up to ``EMPTY_WITHIN`` s per tree that will not empty."""
    grants = tuple(await manager.sweep())
    root = manager.root
    trees: list[SweptTree] = []
    if not manager.carved or root is None:
        return CgroupSweep(grants, ())
    # The processes' own tree first (its kill empties them all), then the v1 groups, always
    # named slurm-fiber.<pid>; the v1 backend carves in freezer, the home's v2 tree after it.
    ours = f"{TREE_PREFIX}{os.getpid()}"
    home = [h] if (h := manager.home_root) is not None and h != root else []
    owns = [r for r in (root, *manager.v1_roots.values(), *home) if r.name == ours]
    for own in owns:
        for path, owner in dead_trees(own.parent, own):
            swept = await sweep_tree(path, owner)
            trees.append(swept)
            if swept.removed:
                log.warning("swept the cgroup tree of dead fiberd %d: %s (killed %d)",
                            owner, path, len(swept.killed))
            else:
                log.error("cgroup tree of dead fiberd %d at %s: %s", owner, path,
                          swept.problem)
    return CgroupSweep(grants, tuple(trees))


async def reset_readiness(home: Readiness, within: float = READY_RESET_WITHIN) -> str:
    """Publish "not ready" through the home (a predecessor's readiness is stale now).

    Call once the socket is this fiberd's and before any grant is delivered. Uses the
    seam's ``publish_ready`` for a UID that holds no template, which publishes the
    home's first state: none warm. A failure is logged and left to the home's
    republishing. Returns what happened, one line for the start record.
    """
    try:
        await asyncio.wait_for(home.publish_ready("", False), within)
    except TimeoutError:
        log.warning("readiness not reset within %g s; the home publishes it again", within)
        return f"not ready: publish pending after {within:g} s"
    except Exception as err:  # the home republishes; say it once here
        log.warning("readiness not reset: %s", err)
        return f"not ready: publish failed ({err})"
    return "not ready: published"
