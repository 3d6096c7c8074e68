"""The runtime's periodic work: every fiber's deadline, lease expiry, pruning, idle spares.

``Upkeep`` holds the one deadline timer every running fiber is bound to: a fiber's
deadline is the book's answer, asked again when it comes and on every ``rearm`` (an
admission, a renewal or an epoch bump may move it); a fiber past it is stopped with its
cause recorded. ``maintain`` runs, every interval until cancelled, the cooling of
grants whose lease ended (their fibers were stopped at their deadlines already), the
pruning of long-expired grants from the book, and the dismissal of idle grants' spares;
a failed round is logged and the next one runs. Re-warming a template that died or
stopped answering is the template's own (templates/lifecycle.py).
"""

from __future__ import annotations

import logging

from slurm_fiber.core.audit.log import AuditEvent
from slurm_fiber.core.book.decisions import Start
from slurm_fiber.core.fibers.fiber import DeadlineTimer, Fiber
from slurm_fiber.core.runtime.grants import Grants
from slurm_fiber.core.runtime.shared import Parts
from slurm_fiber.core.runtime.trail import AuditTrail

log = logging.getLogger("slurm_fiber.core.runtime.upkeep")


class Upkeep:
    """Deadlines, expiry, pruning and idle spares of one fiberd (see the module doc)."""

    def __init__(self, parts: Parts, trail: AuditTrail, grants: Grants) -> None:
        self.parts = parts
        self.trail = trail
        self.grants = grants
        self._deadlines = DeadlineTimer(parts.clock, parts.settings.grace)  # every fiber's

    def bound(self, fiber: Fiber, decision: Start) -> None:
        """Stop the fiber at its live deadline (the book's answer, asked again by the one
        deadline timer when it comes and on every rearm)."""
        book, clock = self.parts.book, self.parts.clock

        def due() -> float:
            last = book.deadline(fiber.uid, decision.epoch, decision.started)
            if clock.mono() >= last.at:
                self.trail.note_release(fiber, last.cause.value)
            return last.at

        self._deadlines.add(fiber, due)

    def rearm(self) -> None:
        """Ask every fiber's deadline again (after a change that may move them)."""
        self._deadlines.rearm()

    async def expire_due(self) -> list[str]:
        """Cool the templates of grants whose lease ended, then prune long-expired grants.

        Their fibers were stopped at their deadlines already. Returns the UIDs cooled.
        """
        cooled = []
        book = self.parts.book
        for uid in book.expired_uids():
            if uid in self.grants:
                self.trail.write(AuditEvent.EXPIRE, uid=uid, reason="lease ended")
                await self.grants.retire(uid, "expired")
                cooled.append(uid)
        book.prune(self.parts.settings.prune_after)
        return cooled

    async def maintain(self, every: float = 1.0) -> None:
        """Run expiry, pruning and the shedding of idle grants' spares every ``every``
        clock seconds until cancelled."""
        while True:
            await self.parts.clock.sleep(every)
            try:
                await self.expire_due()
            except OSError as err:
                log.error("upkeep failed: %s", err)
            self._shed_idle_spares()

    def _shed_idle_spares(self) -> None:
        """Dismiss the spares of grants not cloned for ``spares_idle``
        (``Template.shed_idle_spares``), each said in the log."""
        for grant in self.grants:
            if grant.template.shed_idle_spares():
                log.info("grant %s: not cloned for %g s, its spares dismissed until its "
                         "next Clone", grant.uid, self.parts.settings.spares_idle)

    async def close(self) -> None:
        """Stop the deadline timer (at shutdown, once every grant is stopped)."""
        self._deadlines.close()
        await self._deadlines.wait_closed()
