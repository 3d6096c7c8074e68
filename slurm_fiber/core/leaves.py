"""The cgroup leaves of a template's spares: made ahead, recycled, removed in the background.

A spare (core/spares.py) sits in its own leaf, ``slot-<n>`` under the grant's
cgroup. ``LeafPool.take`` gives a free leaf kept from an ended fiber, else
makes one (off the event loop: ``mkdir`` waits while a migration holds the
kernel's cgroup lock). ``give_back`` keeps an ended fiber's empty leaf for a
later spare, unless it had a memory controller (its ``memory.peak`` would
carry over), holds sub-cgroups, the pool is closed or already holds enough;
otherwise it is removed in the background. So a Clone creates and removes no
cgroup. Every background removal (and every kill a caller hands to
``track``) is kept in view: ``settle`` returns once all are done, which
``Template.stop`` waits for. With no grant cgroup (uncarved) there are no
leaves: ``take`` gives None.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from slurm_fiber.core import cgroups
from slurm_fiber.core.cgroups import GrantCgroup

log = logging.getLogger(__name__)


class LeafCreateFailed(Exception):
    """A slot leaf could not be made (one line: the path and why)."""


class LeafPool:
    """One template's free slot leaves and the removals under way. Not thread-safe;
    use on fiberd's event loop."""

    def __init__(self, cgroup: GrantCgroup | None) -> None:
        self.cgroup = cgroup
        self._free: list[Path] = []
        self._pending: set[asyncio.Future[None]] = set()

    async def take(self, spare_id: str) -> Path | None:
        """A free slot leaf, else a new one named for ``spare_id``; None when uncarved.
        Raises LeafCreateFailed."""
        if self.cgroup is None:
            return None
        if self._free:
            return self._free.pop()
        leaf = self.cgroup.slot(spare_id)
        try:  # off the loop: it waits while a migration holds the kernel's cgroup lock
            await asyncio.to_thread(cgroups.mkdir, leaf)  # and its v1 mirrors
        except OSError as e:
            raise LeafCreateFailed(f"cannot create cgroup {leaf}: {e.strerror}") from None
        return leaf

    def give_back(self, leaf: Path, peak: int | None, *, keep: bool, limit: int) -> None:
        """An ended fiber's leaf: kept for a later spare when ``keep`` (the template still
        serves), it had no memory peak, holds no sub-cgroup and fewer than ``limit`` are
        free; else removed in the background."""
        if keep and peak is None and len(self._free) < limit and _bare(leaf):
            self._free.append(leaf)
        else:
            self.track(asyncio.ensure_future(_remove_leaf(leaf)))

    def clear(self) -> None:
        """Remove every free leaf, in the background."""
        for leaf in self._free:
            self.track(asyncio.ensure_future(_remove_leaf(leaf)))
        self._free.clear()

    def track(self, task: asyncio.Future[None]) -> None:
        """Keep a background removal (or a spare's kill) in view for ``settle``."""
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def settle(self) -> None:
        """Return once every tracked task, including those added meanwhile, is done."""
        while self._pending:
            await asyncio.gather(*list(self._pending))


def _bare(leaf: Path) -> bool:
    """Whether ``leaf`` exists and holds no sub-cgroup (a fiber may have made some)."""
    try:
        with os.scandir(leaf) as entries:
            return not any(e.is_dir(follow_symlinks=False) for e in entries)
    except OSError:
        return False


async def _remove_leaf(leaf: Path) -> None:
    try:
        await asyncio.to_thread(cgroups.remove_tree, leaf)
    except OSError as e:
        log.warning("cannot remove the fiber cgroup %s: %s", leaf, e.strerror)
