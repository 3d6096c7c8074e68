"""A carved group in every hierarchy it lives in: made, killed, emptied and removed whole.

A group of a grant's tree exists in the carving root's hierarchy (v2, or the v1 freezer)
and in its v1 mirrors (v1.mirrors). ``mkdir`` makes it in all of them and, for a root
fiberd, hands its leaves' ``cgroup.procs`` to the account fibers run as (``hand_procs``;
nothing else is handed); ``kill`` ends every process in the subtree (``cgroup.kill``,
a v1 freezer's freeze-kill-thaw, else each listed pid); ``empty`` kills and waits for
``populated 0``; ``remove_tree`` and ``remove_if_empty`` rmdir the group and its
mirrors. A group that is gone is not an error. These operations trust the tree they
are given: they are fiberd's, on the tree it carved (the hooks' bounded operations on
a tree a job user may have shaped are in teardown.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from slurm_fiber.core.cgroups.common import pids, populated, rmtree, wait_empty
from slurm_fiber.core.cgroups.v1 import freeze_kill, mirrors
from slurm_fiber.core.cgroups.v2 import enable_controllers

# Carving root -> (uid, v2 tree) of the account a root fiberd's templates and fibers run
# as (core/identity.py). That account may write only the ``cgroup.procs`` of its grants'
# leaves (template, slots) and, in a v2 tree, of the grant's own group (a move between
# two leaves needs write access at their common ancestor): it moves between its grant's
# groups, never out of its grant, and writes no limit or device rule.
_PROCS_OWNERS: dict[Path, tuple[int, bool]] = {}


def hand_procs(root: Path, uid: int, v2: bool) -> None:
    """From now on, chown to ``uid`` the ``cgroup.procs`` of each leaf made below the
    carving root ``root`` (and, when ``v2``, of each grant's group). Nothing else is."""
    _PROCS_OWNERS[root] = (uid, v2)


def forget_procs_owner(root: Path) -> None:
    """Stop handing ``root``'s new leaves to anyone (its manager closed)."""
    _PROCS_OWNERS.pop(root, None)


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


def mkdir(cgroup: Path) -> None:
    """Create ``cgroup`` and its mirrors (existing ones are fine); hand their
    ``cgroup.procs`` to the account fibers run as, where one is set (``hand_procs``).
    Raises OSError."""
    for path in (cgroup, *mirrors(cgroup)):
        path.mkdir(exist_ok=True)
    if _PROCS_OWNERS:
        _hand_procs(cgroup)


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


def remove_tree(cgroup: Path) -> None:
    """rmdir the cgroup and its children, deepest first. A gone cgroup is fine.

    Raises OSError (EBUSY) when a cgroup in it is still populated. Blocks
    while another cgroup operation holds the kernel's cgroup lock (a
    migration can hold it for an RCU grace period): run it off the event
    loop where that matters. The cgroup's v1 mirrors (``mirrors``) go with it.
    """
    for path in (cgroup, *mirrors(cgroup)):
        rmtree(path)


def kill(cgroup: Path) -> None:
    """SIGKILL every process in the subtree; returns at once (see ``wait_empty``).

    Uses ``cgroup.kill``; a v1 freezer group is frozen, signalled and thawed; a
    group with neither (another v1 hierarchy, an older kernel) has each listed pid
    signalled. A cgroup that no longer exists is not an error.
    """
    if (cgroup / "freezer.state").exists():  # v1 freezer
        freeze_kill(cgroup)
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
    import asyncio  # here, not at the top: the epilog uses the synchronous helpers only

    await asyncio.to_thread(remove_tree, cgroup)
