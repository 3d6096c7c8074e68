"""The cgroup leaves of a template's spares: made ahead, recycled, removed in the background.

A spare (core/spares.py) sits in its own leaf, ``slot-<n>`` in a slot group
under the grant's ``fibers`` cgroup (core/cgroups/common.py), the n-th leaf a pool
makes in group n // ``SLOTS_PER_GROUP``. ``LeafPool.take`` gives a free leaf
kept from an ended fiber, else makes one (off the event loop: ``mkdir`` waits
while a migration holds the kernel's cgroup lock). ``give_back`` keeps an
ended fiber's empty leaf for a later spare, unless its memory figures would
carry over to the next fiber (``renew_memory``: a v1 memory mirror's
peak is reset when no more than a small residue is left charged to it; v2's
``memory.peak`` cannot be reset for every reader), it holds sub-cgroups, the pool is closed
or already holds enough; otherwise it is removed in the background. So a
Clone creates and removes no cgroup (on a hybrid host, none of the four
it would otherwise make and remove each time). Removals are queued and done by one
worker thread at a time, in batches (all queued while the last batch ran): an
rmdir takes the kernel's cgroup lock, and thousands of fibers ending at once
(a mass stop) each removing its leaf on its own thread would contend for it,
spinning on both cores while fiberd's loop waits for CPU. A group the pool
has moved past is removed once its last leaf is. Every background removal
(and every kill a caller hands to ``track``) is kept in view: ``settle``
returns once all are done, which ``Template.stop`` waits for. With no grant
cgroup (uncarved) there are no leaves: ``take`` gives None.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from pathlib import Path

from slurm_fiber.core.cgroups.common import SLOTS_PER_GROUP, GrantCgroup, childless
from slurm_fiber.core.cgroups.groups import mkdir as cgroup_mkdir
from slurm_fiber.core.cgroups.groups import mkdir_group, remove_if_empty, remove_tree
from slurm_fiber.core.cgroups.memory import renew_memory

log = logging.getLogger(__name__)


class LeafCreateFailed(Exception):
    """A slot leaf could not be made (one line: the path and why; ``errno`` the cause's)."""

    def __init__(self, reason: str, errno: int | None = None) -> None:
        super().__init__(reason)
        self.errno = errno


class LeafPool:
    """One template's free slot leaves and the removals under way. Not thread-safe;
    use on fiberd's event loop.

    Its slot groups are its own (``group-<pool>-<k>``, ``pool`` unique in this
    fiberd), so it alone decides when one is empty: ``_live`` counts each group's
    leaves from ``take`` (before the mkdir) until their removal is done.
    """

    def __init__(self, cgroup: GrantCgroup | None) -> None:
        self.cgroup = cgroup
        self._name = next(_POOLS)
        self._free: list[Path] = []
        self._pending: set[asyncio.Future[None]] = set()
        self._doomed: list[Path] = []  # queued for removal
        self._remover: asyncio.Future[None] | None = None
        self._made = 0  # leaves made so far: the next one's group is made // SLOTS_PER_GROUP
        self._live: collections.Counter[Path] = collections.Counter()
        self._empty: set[Path] = set()  # groups whose leaves are all removed
        self._groups: dict[Path, asyncio.Future[None]] = {}  # group -> its mkdir

    async def take(self, spare_id: str) -> Path | None:
        """A free slot leaf, else a new one named for ``spare_id``; None when uncarved.
        Raises LeafCreateFailed."""
        if self.cgroup is None:
            return None
        if self._free:
            return self._free.pop()
        group = self._filling()
        leaf = self.cgroup.slot(spare_id, group.name.removeprefix("group-"))
        self._made += 1
        self._live[group] += 1
        self._empty.discard(group)
        made = self._groups.get(group)
        if made is None:  # the group's first leaf makes it; the others wait for that
            made = self._groups[group] = asyncio.ensure_future(
                asyncio.to_thread(mkdir_group, group))
        try:  # off the loop: it waits while a migration holds the kernel's cgroup lock
            await asyncio.shield(made)
            await asyncio.to_thread(cgroup_mkdir, leaf)  # and its v1 mirrors
        except OSError as e:
            if made.done() and made.exception() is not None:
                self._groups.pop(group, None)  # the next leaf tries again
            self._remove([leaf])  # nothing, or a group left empty
            raise LeafCreateFailed(f"cannot create cgroup {leaf}: {e.strerror}",
                                   e.errno) from None
        return leaf

    def give_back(self, leaf: Path, peak: int | None, oom_kills: int | None, *, keep: bool,
                  limit: int) -> None:
        """An ended fiber's leaf, with its memory peak and OOM kill count as read at its
        end: kept for a later spare when ``keep`` (the template still serves), fewer than
        ``limit`` are free, it holds no sub-cgroup and it had no memory peak or its memory
        figures were renewed (``renew_memory``); else removed in the background
        (why, at debug level)."""
        if not keep:
            why: str | None = "its template no longer serves"
        elif len(self._free) >= limit:
            why = f"{limit} free already"
        else:
            why = _not_kept(leaf, peak, oom_kills)
        if why is None:
            self._free.append(leaf)
        else:
            log.debug("leaf %s removed: %s", leaf, why)
            self._remove([leaf])

    def discard(self, leaf: Path) -> None:
        """Remove a leaf nothing runs in any more (a dead spare's), in the background."""
        self._remove([leaf])

    def clear(self) -> None:
        """Remove every free leaf, in the background."""
        self._remove(self._free)
        self._free = []

    def track(self, task: asyncio.Future[None]) -> None:
        """Keep a background removal (or a spare's kill) in view for ``settle``."""
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def settle(self) -> None:
        """Return once every tracked task, including those added meanwhile, is done."""
        while self._pending:
            await asyncio.gather(*list(self._pending))

    def _filling(self) -> Path:
        """The group the next new leaf goes in (the pool is carved)."""
        assert self.cgroup is not None
        return self.cgroup.group(f"{self._name}-{self._made // SLOTS_PER_GROUP}")

    def _remove(self, leaves: list[Path]) -> None:
        """Queue ``leaves`` for removal; start the remover unless it runs (it takes them)."""
        self._doomed += leaves
        if self._doomed and (self._remover is None or self._remover.done()):
            self._remover = asyncio.ensure_future(self._remove_queued())
            self.track(self._remover)

    async def _remove_queued(self) -> None:
        """Remove the queued leaves, a batch per thread hop, until the queue is empty; with
        each batch the groups left empty that no new leaf will go in."""
        while self._doomed:
            batch, self._doomed = self._doomed, []
            for leaf in batch:
                self._live[leaf.parent] -= 1
                if self._live[leaf.parent] <= 0:
                    del self._live[leaf.parent]
                    self._empty.add(leaf.parent)
            groups = self._empty - {self._filling()}
            self._empty -= groups
            for group in groups:
                self._groups.pop(group, None)
            await asyncio.to_thread(_remove_leaves, batch, groups)


_POOLS = itertools.count()


def _not_kept(leaf: Path, peak: int | None, oom_kills: int | None) -> str | None:
    """Why an ended fiber's leaf cannot serve the next one (None: it can)."""
    if not childless(leaf):  # a fiber may make sub-groups in its own leaf
        return "it holds sub-cgroups or is gone"
    return None if peak is None else renew_memory(leaf, oom_kills)


def _remove_leaves(leaves: list[Path], groups: set[Path]) -> None:
    """rmdir each leaf and its mirrors, then the empty ``groups`` (in a worker thread); a
    failure is logged."""
    for leaf in leaves:
        try:
            remove_tree(leaf)
        except OSError as e:
            log.warning("cannot remove the fiber cgroup %s: %s", leaf, e.strerror)
    for group in groups:
        remove_if_empty(group)
