"""Admission: grants in and out, epochs and scope loss, carried out as the book decides.

``Admission`` is drive's ``Admitter`` (verify, lift, admit, remove). A token is
verified (a refusal audited, with its code); an admission is the ``GrantBook``'s
decision, audited with the token's enforcement record (which limits are enforced, by
what, how devices are confined) before the grant is provisioned (grants.py), and saved
to the book's store off the loop; a Clone that relies on an admission waits until it
is saved (``saved``). Under strict limits a grant whose limits nothing here enforces is
refused (``unenforceable``). ``remove`` denies the UID until its tokens expire and
retires the grant; ``bump_epoch`` stops every fiber and closes every task window of an
older epoch; ``lose_scope``
does so and, when the home says so, removes every grant. Every refusal raises
``AdmitRefused`` with a code and a one-line reason, audited first. Once ``closing`` is
set nothing more is admitted.
"""

from __future__ import annotations

import asyncio
import logging

from slurm_fiber.core.audit.log import AuditEvent
from slurm_fiber.core.book.decisions import Admitted, closed_miss, invalid_token_miss
from slurm_fiber.core.book.misses import Miss
from slurm_fiber.core.runtime.grants import Grants
from slurm_fiber.core.runtime.shared import Parts
from slurm_fiber.core.runtime.trail import AdmitRefused, AuditTrail
from slurm_fiber.core.runtime.upkeep import Upkeep
from slurm_fiber.core.templates.parent import TemplateState
from slurm_fiber.core.trust.grant import FiberSpec, VerifiedToken
from slurm_fiber.core.trust.tokens import TokenRefused, TokenVerifier

log = logging.getLogger("slurm_fiber.core.runtime.admission")


class Admission:
    """Grants in and out of one fiberd (see the module doc)."""

    def __init__(self, parts: Parts, verifier: TokenVerifier, trail: AuditTrail,
                 grants: Grants, upkeep: Upkeep) -> None:
        self.parts = parts
        self.verifier = verifier
        self.trail = trail
        self.grants = grants
        self.upkeep = upkeep
        self._saving: asyncio.Task[None] | None = None  # writing deferred admissions

    # ------------------------------------------------------------ Admitter (drive)

    def verify(self, raw: bytes | str) -> VerifiedToken:
        """Verify a raw token; a refusal is audited and raised as TokenRefused."""
        try:
            return self.verifier.verify(raw)
        except TokenRefused as err:
            # As every refusal and miss: reason for a person, detail the machine code.
            miss = invalid_token_miss(err)
            self.trail.write(AuditEvent.REFUSE, code=miss.code.value, reason=miss.reason,
                             detail=miss.detail)
            raise

    def lift(self, uid: str) -> bool:
        """Lift a removal denial (the home delivered the grant again); True when one held."""
        lifted = self.parts.book.lift(uid)
        if lifted:
            self.trail.write(AuditEvent.LIFT, uid=uid,
                             reason="the home delivered the grant again")
        return lifted

    async def admit(self, vt: VerifiedToken) -> Admitted:
        """Admit a verified token and warm its grant's template (returns before it is warm).

        Raises AdmitRefused (denied, expired, closed, devices or cgroup
        refused, or under strict limits ``unenforceable``), audited with its
        code and reason. The admit record carries the token's enforcement
        record (which of its limits are enforced, by what; how devices are
        confined).
        """
        parts, grants = self.parts, self.grants
        if parts.closing:
            raise self.trail.refuse(vt, closed_miss())
        expected = grants.expected(vt.spec.limits)
        if parts.settings.strict_limits:
            grants.refuse_unenforceable(vt, expected)
        outcome = parts.book.admit(vt, defer_save=True)
        if isinstance(outcome, Miss):
            raise self.trail.refuse(vt, outcome)
        self._save_soon()
        grants.unenforceable.pop(vt.uid, None)
        self.trail.write(AuditEvent.ADMIT, uid=vt.uid, jti=vt.jti, issuer=vt.issuer,
                         lease_end=outcome.lease_end.wall, new_grant=outcome.new_grant,
                         leeway=vt.leeway_used, enforcement=expected.to_json())
        async with grants.lock(vt.uid):
            grant = grants.get(vt.uid)
            spec = self.book_spec(vt.uid) or outcome.spec
            if grant is None or grant.template.state is TemplateState.STOPPED:
                await grants.provision(vt, spec)
            elif grant.spec != spec:
                await grants.replace_template(grant, spec)
        self.upkeep.rearm()  # a renewal may move deadlines
        await asyncio.sleep(0)  # a batch of admissions lets the loop answer in between
        return outcome

    async def remove(self, uid: str) -> None:
        """Remove the grant: deny the UID until its tokens expire, stop its fibers and
        template, release its devices and cgroup; returns once its fibers are gone."""
        removed = self.parts.book.remove(uid)
        self.grants.unenforceable.pop(uid, None)
        self.trail.write(AuditEvent.REMOVE, uid=uid, jtis=list(removed.jtis),
                         denied_until=removed.until)
        await self.grants.retire(uid, "removed")

    async def admit_inline(self, raw: bytes) -> str | Miss:
        """Verify and (when new) admit a token carried by a Clone; never lifts a denial.
        The grant's UID, or the miss."""
        try:
            vt = self.verify(raw)
        except TokenRefused as err:
            return invalid_token_miss(err)
        held = self.parts.book.grant(vt.uid)
        if held is None or vt.jti not in held.jtis:
            try:
                await self.admit(vt)
            except AdmitRefused as err:
                return err.miss
        return vt.uid

    def book_spec(self, uid: str) -> FiberSpec | None:
        """The spec in force for ``uid`` (the newest token's), None when not held."""
        view = self.parts.book.grant(uid)  # one grant's view, not all G of them
        return view.spec if view is not None else None

    # ------------------------------------------------------------ epochs and scope

    async def bump_epoch(self, reason: str) -> int:
        """Start a new epoch and stop every fiber of an older one; returns once they are gone."""
        epoch = self.parts.book.bump_epoch(reason)
        self.trail.epoch_reason = reason
        self.trail.write(AuditEvent.EPOCH_BUMP, epoch=epoch, reason=reason)
        self.upkeep.rearm()
        closing = [w.close("revoked") for w in list(self.parts.windows.values())
                   if w.epoch < epoch]
        grants = list(self.grants)
        self.trail.note_releases([f for g in grants for f in g.template.fibers.values()
                                  if f.epoch < epoch], "revoked")
        await asyncio.gather(*closing, *(g.template.stop_fibers(self.parts.settings.grace,
                                                                before_epoch=epoch)
                                         for g in grants))
        return epoch

    async def lose_scope(self, reason: str, removes_grants: bool) -> None:
        """A home lost its scope: bump the epoch and, when ``removes_grants``, remove every
        grant. The home's ``LosesScope`` handler; never raises but cancellation."""
        self.trail.write(AuditEvent.SCOPE_LOSS, reason=reason, removes_grants=removes_grants)
        try:
            await self.bump_epoch(reason)
            if removes_grants:
                for grant in self.parts.book.grants():
                    await self.remove(grant.uid)
        except Exception:
            log.exception("scope loss %r not fully carried out", reason)

    # ------------------------------------------------------------ state saves

    def _save_soon(self) -> None:
        """Start writing deferred admissions unless a save is under way (that one's end
        starts the next): admissions made meanwhile share one save."""
        if self._saving is None or self._saving.done():
            self._saving = self.parts.spawn(self._save_unsaved())

    async def _save_unsaved(self) -> None:
        """Write the book's deferred admissions off the loop, until none is left. A failed
        save raises (logged as a failed task) and leaves them unsaved: the next admission,
        Clone or shutdown tries again."""
        book = self.parts.book
        store = book.store
        while store is not None:
            stamp, state = store.stamp(), book.take_unsaved()
            if state is None:
                return
            try:
                await asyncio.to_thread(store.write, stamp, state)
            except OSError:
                book.unsave()
                raise

    async def saved(self) -> None:
        """Return once every admission made so far is saved; OSError when a save fails."""
        while self.parts.book.unsaved or (self._saving is not None and not self._saving.done()):
            self._save_soon()
            assert self._saving is not None
            await asyncio.shield(self._saving)
