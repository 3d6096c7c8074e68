"""Group commit for the audit log: one fsync, off the event loop, for every record before it.

Under ``audit_fsync = always`` a Clone's record must be durable before the Clone
is answered. Fsyncing it on the event loop stalls everything else fiberd does
for the disk's time (0.1-0.3 ms here, more on a busy or network disk), once per
Clone. ``GroupSync.durable()`` instead waits, without blocking the loop, for an
fsync run in a worker thread (``AuditLog.sync``, which holds no lock while the
disk works) that began after the caller's record was written: Clones decided
while one fsync runs share the next. A caller returns only once an fsync that
covers its record has returned (``AuditLog.synced_seq``), so the guarantee is
the one a synchronous fsync gives; only the waiting moves off the loop.

Under ``interval`` and ``never`` there is nothing to wait for: the policy
already decides when records become durable. Not thread-safe: one event loop.
"""

from __future__ import annotations

import asyncio

from slurm_fiber.core.audit import AuditLog, FsyncPolicy


class GroupSync:
    """Shares fsyncs of ``log`` among the coroutines that wait for durability."""

    def __init__(self, log: AuditLog) -> None:
        self.log = log
        self._task: asyncio.Future[None] | None = None  # the fsync running now

    async def durable(self) -> None:
        """Return once every record written so far is durable (under ``always``; at once
        under the other policies). Raises OSError when the fsync fails (the records are in
        the file, their durability unknown); cancelling the caller does not cancel the
        fsync others wait for."""
        if self.log.fsync is not FsyncPolicy.ALWAYS:
            return
        wanted = self.log.seq
        while self.log.synced_seq < wanted:
            if self._task is None:
                self._task = asyncio.ensure_future(self._sync())
            await asyncio.shield(self._task)

    async def _sync(self) -> None:
        """One fsync in a worker thread (records written from now on wait for the next)."""
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.log.sync)
        finally:
            self._task = None
