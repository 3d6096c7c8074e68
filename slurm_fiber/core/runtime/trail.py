"""The runtime's audit trail: which record is written when, and how durable it is before going on.

Decisions (admit, refuse, remove, epoch bump, scope loss, Clone, miss) are written before
they are answered, durable per the log's policy; one that cannot be written raises
``AuditWriteFailed`` instead of being answered. A Clone's record is made durable by the
helper process (``write_durably``) while the loop goes on. Observations are cheaper:
a fiber's exit record (``fiber_exit``) is written with the other exits of the same loop
step in one append, before any task woken by the exit runs, and under ``always`` made
durable by the next decision's fsync or within ``EXIT_SYNC_DELAY``. A stop of a running
fiber is recorded once per fiber with its cause (``note_releases``), and the fiber is
told its reason; a stop goes ahead even when its record cannot be written (logged).
Audited fields that are None are left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import Sequence

from slurm_fiber.core.audit.log import AuditEvent, AuditLog, AuditWriteFailed, FsyncPolicy
from slurm_fiber.core.audit.syncer import AuditSyncer
from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.fibers.fiber import Fiber
from slurm_fiber.core.runtime.shared import Parts
from slurm_fiber.core.trust.grant import VerifiedToken
from slurm_fiber.errors import CodedError

log = logging.getLogger("slurm_fiber.core.runtime.trail")

EXIT_SYNC_DELAY = 0.1  # seconds a fiber_exit record may wait for an fsync it shares


class AdmitRefused(CodedError):
    """An admission the core refused: ``code`` and a one-line ``reason`` (audited already)."""

    def __init__(self, miss: Miss) -> None:
        super().__init__(miss.code.value, miss.reason)
        self.miss = miss


class AuditTrail:
    """Writes the runtime's records to ``audit`` (see the module doc)."""

    def __init__(self, audit: AuditLog, parts: Parts) -> None:
        self.audit = audit
        self.parts = parts
        self.epoch_reason = ""  # why the epoch was last bumped (a revoked fiber's reason)
        self._released: set[str] = set()  # fiber ids whose release is audited
        self._exits: list[tuple[str, dict[str, object]]] = []  # fiber_exit records to write
        self._exit_sync: asyncio.Task[None] | None = None  # the fsync they wait for
        self._syncer: AuditSyncer | None = None  # fsyncs Clone records off the loop

    # ------------------------------------------------------------ decisions

    def write(self, event: AuditEvent, **fields: object) -> None:
        self.audit.write(event, **present(**fields))

    async def write_durably(self, event: AuditEvent, **fields: object) -> None:
        """Write a decision's record and return once it is durable, as ``write`` does, but
        under ``audit_fsync = always`` with the fsync made by the helper process
        (core/audit/syncer.py, started on first use) while the loop goes on. Raises
        AuditWriteFailed (a record whose fsync failed stays in the file, its durability
        unknown)."""
        await self.write_many_durably([(event, fields)])

    async def write_many_durably(self, records: Sequence[tuple[str, dict[str, object]]],
                                 ) -> None:
        """``write_durably`` of several records in one append and one fsync."""
        if self.audit.fsync is not FsyncPolicy.ALWAYS:
            self.audit.write_many([(event, present(**fields)) for event, fields in records])
            return
        if self._syncer is None:
            self._syncer = AuditSyncer(self.audit.fileno(), self.parts.settings.python)
        self.audit.write_many([(event, present(**fields)) for event, fields in records],
                              durable=False)
        appended = self.audit.appended
        try:
            await self._syncer.synced()
        except OSError as err:
            raise AuditWriteFailed(err.errno or errno.EIO, f"audit log {self.audit.path}: "
                                   f"records written, not made durable "
                                   f"({err.strerror or err})") from None
        self.audit.synced_through(appended)

    def refuse(self, vt: VerifiedToken, miss: Miss, **fields: object) -> AdmitRefused:
        """Audit an admission's refusal; the exception to raise."""
        self.write(AuditEvent.REFUSE, uid=vt.uid, jti=vt.jti, code=miss.code.value,
                   reason=miss.reason, detail=miss.detail, **fields)
        return AdmitRefused(miss)

    def miss(self, uid: str | None, miss: Miss, caller: dict[str, int]) -> Miss:
        """Audit a Clone's miss; the miss to answer."""
        book = self.parts.book
        self.write(AuditEvent.MISS, uid=uid, code=miss.code.value, reason=miss.reason,
                   detail=miss.detail, epoch=book.epoch,
                   health_age=self.parts.home.liveness.health().read().age, **caller)
        return miss

    # ------------------------------------------------------------ fiber exits

    def fiber_exit(self, fiber: Fiber) -> None:
        """Queue an ended fiber's ``fiber_exit`` record: written with the other exits of
        this loop step, in one append (``write_exits``), before any task woken by the exit
        runs (they are scheduled after it). It is an observation, not a decision: under
        ``audit_fsync = always`` its fsync is the next decision's (a busy fiberd fsyncs
        once per task, not twice) or ``_sync_exits``' within ``EXIT_SYNC_DELAY``."""
        self._released.discard(fiber.id)
        end = fiber.exit
        if not self._exits:
            asyncio.get_running_loop().call_soon(self.write_exits)
        self._exits.append((AuditEvent.FIBER_EXIT, present(
            uid=fiber.uid, fiber=fiber.id, epoch=fiber.epoch,
            exit=end.to_json() if end else None)))

    def write_exits(self) -> None:
        records, self._exits = self._exits, []
        try:
            self.audit.write_many(records, durable=False)
        except OSError as err:
            log.error("%d fiber exits unaudited: %s", len(records), err)
        if self.audit.unsynced and self._exit_sync is None:
            self._exit_sync = self.parts.spawn(self._sync_exits())

    async def _sync_exits(self) -> None:
        """Make the exit records durable ``EXIT_SYNC_DELAY`` after the first of them,
        unless a decision's fsync did meanwhile (then this costs nothing)."""
        try:
            await self.parts.clock.sleep(EXIT_SYNC_DELAY)
            self.audit.sync()
        except OSError as err:
            log.error("fsync of the audit log's fiber exits failed: %s", err)
        finally:
            self._exit_sync = None

    def unstarted(self, fiber: Fiber) -> None:
        """The exit of a fiber killed because its Clone could not be audited, when the log
        takes it."""
        with contextlib.suppress(OSError):
            self.write(AuditEvent.FIBER_EXIT, uid=fiber.uid, fiber=fiber.id, epoch=fiber.epoch,
                       cause="audit_failed", exit=fiber.exit.to_json() if fiber.exit else None)

    # ------------------------------------------------------------ releases

    def note_release(self, fiber: Fiber, cause: str, **fields: object) -> None:
        """Audit that fiberd is stopping a running fiber and why (once per fiber), and tell
        the fiber its reason (``stop_reason``), which its exit event carries.

        A stop goes ahead even when its record cannot be written (a full disk):
        stopping is never the decision an audit failure may hold back; it is logged.
        """
        self.note_releases([fiber], cause, **fields)

    def note_releases(self, fibers: Sequence[Fiber], cause: str, **fields: object) -> None:
        """``note_release`` of many fibers at once: their records in one append."""
        records: list[tuple[str, dict[str, object]]] = []
        for fiber in fibers:
            if fiber.id in self._released or not fiber.running:
                continue
            fiber.note_reason(*self.stop_reason(fiber, cause, fields))
            self._released.add(fiber.id)
            records.append((AuditEvent.RELEASE, present(
                uid=fiber.uid, fiber=fiber.id, epoch=fiber.epoch, cause=cause, **fields)))
        try:
            self.audit.write_many(records)
        except AuditWriteFailed as err:
            log.error("stopping %d fibers (%s) unaudited: %s", len(records), cause, err)

    def stop_reason(self, fiber: Fiber, cause: str,
                    fields: dict[str, object]) -> tuple[str, str]:
        """The fiber's reason code and line for a release ``cause`` (audit's word)."""
        book = self.parts.book
        view = book.grant(fiber.uid)
        seconds = view.spec.limits.seconds if view is not None else None
        fence = book.fence_ttl
        match cause:
            case "seconds":
                return "deadline", (f"deadline {seconds:g} s (limits.seconds) reached"
                                    if seconds is not None else "deadline reached")
            case "lease" | "expired":
                return "lease_end", (f"the lease of grant {fiber.uid!r} ended (no renewed "
                                     "token was delivered)")
            case "fence":
                return "fence", ("fenced: the control plane was silent for over "
                                 f"{fence:g} s" if fence else "fenced: the control plane "
                                 "was silent")
            case "removed":
                return "removed", f"grant {fiber.uid!r} was removed"
            case "revoked":
                why = f" ({self.epoch_reason})" if self.epoch_reason else ""
                return "epoch", f"epoch {fiber.epoch} was revoked{why}"
            case "stop_request":
                return "stopped", (f"stopped on request (uid {fields.get('caller_uid')}, "
                                   f"pid {fields.get('caller_pid')})")
            case "shutdown":
                return "fiberd_shutdown", "fiberd is shutting down"
        return cause, f"stopped by fiberd ({cause})"

    def close(self) -> None:
        """Stop the fsync helper (at shutdown, after the last record)."""
        if self._syncer is not None:
            self._syncer.close()


def present(**fields: object) -> dict[str, object]:
    """The audit fields that have a value (None is left out)."""
    return {k: v for k, v in fields.items() if v is not None}


def audit_failed(err: AuditWriteFailed) -> Miss:
    """The miss of a Clone that was refused because its audit record could not be written."""
    return Miss(MissCode.AUDIT_FAILED, f"nothing started: the audit log cannot be written "
                f"({err.strerror or err}); retry once it has room", retry_after=1.0)
