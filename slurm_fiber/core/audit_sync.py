"""Group commit of audit records: one fsync, off the event loop, for all written before it.

Under the ``always`` policy every record must be on disk before the decision
it records is answered (docs/design.md, Audit). An fsync per record on
fiberd's loop blocks the loop for the disk's latency twice per fiber (its
``clone`` and its ``fiber_exit``), so that a map's other fibers wait too.
Instead the runtime appends a hot-path record without the fsync
(``AuditLog.append_many``) and awaits ``GroupCommit.durable(seq)``: an fsync
runs in a worker thread and covers every record written before it began;
records written meanwhile share the next one. So the answer still follows
the fsync of its record, and the loop serves the other fibers in the while.
Under ``interval`` and ``never`` a record is as durable as the policy asks
once written, and ``durable`` returns at once.
"""

from __future__ import annotations

import asyncio

from slurm_fiber.core.audit import AuditLog


class GroupCommit:
    """The fsyncs of one audit log, shared by everyone waiting. Use on fiberd's loop."""

    def __init__(self, audit: AuditLog) -> None:
        self.audit = audit
        self._flight: asyncio.Future[None] | None = None

    async def durable(self, seq: int) -> None:
        """Return once record ``seq`` (written) is durable per the log's policy: at once when
        it is, else after an fsync that began after it was written (one in a worker
        thread, shared with every record written before it began). Raises AuditWriteFailed
        when that fsync fails. Cancelling a waiter does not cancel the shared fsync."""
        while self.audit.synced < seq:
            flight = self._flight
            if flight is None or flight.done():
                flight = self._flight = asyncio.ensure_future(asyncio.to_thread(self.audit.sync))
            await asyncio.shield(flight)
