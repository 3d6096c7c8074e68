"""The socket's refusals in the audit log, rate-limited per caller.

Every refused connection or request is audited (threat model, rule 5), and a
caller refused in a loop cannot grow the log without bound:

- a refusal of a request (one naming its ``op``) is a decision on that request
  and is written whole;
- a refusal of a connection or of bytes that never made a request (``forbidden``,
  ``busy``, ``timeout``, ``bad_frame``) is rate-limited: ``RefusalLog.refused``
  writes the first of each (caller uid, code) in a window of ``window`` seconds
  whole (``api_refuse`` with its reason and caller) and counts the ones after it;
  once the window has passed (``flush_due``, or the next refusal of that key) it
  writes one ``api_refuse`` record per key that repeated, with ``repeated``,
  ``first_time`` and ``last_time`` (wall seconds); ``flush`` writes what is counted
  at once (at shutdown, before the stop record);
- at most ``max_keys`` keys are tracked in a window; any other key's refusals are
  counted under caller uid ``None``. So the log grows by at most
  ``2 * (max_keys + 1)`` records per window, and no refusal goes uncounted.

A failed write (a full disk) is logged and its counts dropped; it never raises.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from slurm_fiber.core.api.server import Refusal
from slurm_fiber.core.audit.log import AuditEvent, AuditLog
from slurm_fiber.core.clock import Clock

log = logging.getLogger("slurm_fiber.core.audit.refusals")

WINDOW = 60.0
MAX_KEYS = 64

Key = tuple[int | None, str]


@dataclass
class _Count:
    """Refusals of one key counted (not written) since its whole record."""

    opened: float  # clock mono of the key's whole record: its window's start
    repeated: int = 0
    first_time: float = 0.0
    last_time: float = 0.0


class RefusalLog:
    """Audits refusals (``refused``, the API server's audit callback), rate-limited."""

    def __init__(self, audit: AuditLog, clock: Clock, *, window: float = WINDOW,
                 max_keys: int = MAX_KEYS) -> None:
        self.audit = audit
        self.clock = clock
        self.window = window
        self.max_keys = max_keys
        self._counts: dict[Key, _Count] = {}

    def refused(self, refusal: Refusal) -> None:
        """Audit one refusal: whole when it opens its key's window, else counted."""
        peer = refusal.peer
        uid = peer.uid if peer else None
        if refusal.op is not None:  # a request's refusal: a decision, written whole
            self._write(AuditEvent.API_REFUSE, code=refusal.code, reason=refusal.reason,
                        op=refusal.op, caller_uid=uid, caller_pid=peer.pid if peer else None)
            return
        key: Key = (uid, refusal.code)
        if key not in self._counts and len(self._counts) >= self.max_keys:
            key = (None, refusal.code)
        now = self.clock.mono()
        count = self._counts.get(key)
        if count is not None and now - count.opened >= self.window:
            self._write_count(key, count)
            count = None
        if count is None:
            self._counts[key] = _Count(now)
            self._write(AuditEvent.API_REFUSE, code=refusal.code, reason=refusal.reason,
                        op=None, caller_uid=key[0],
                        caller_pid=peer.pid if peer and key[0] is not None else None)
            return
        wall = self.clock.wall()
        if not count.repeated:
            count.first_time = wall
        count.repeated += 1
        count.last_time = wall

    def flush_due(self) -> None:
        """Write the counts of every key whose window has passed (and forget the key)."""
        now = self.clock.mono()
        for key, count in list(self._counts.items()):
            if now - count.opened >= self.window:
                self._write_count(key, count)

    def flush(self) -> None:
        """Write every count now (shutdown)."""
        for key, count in list(self._counts.items()):
            self._write_count(key, count)

    async def run(self) -> None:
        """``flush_due`` once per window, until cancelled (fiberd's upkeep)."""
        while True:
            await self.clock.sleep(self.window)
            self.flush_due()

    def _write_count(self, key: Key, count: _Count) -> None:
        del self._counts[key]
        if count.repeated:
            uid, code = key
            self._write(AuditEvent.API_REFUSE, code=code, caller_uid=uid,
                        repeated=count.repeated, first_time=round(count.first_time, 6),
                        last_time=round(count.last_time, 6), op=None,
                        reason=f"{count.repeated} more refusal(s) of this caller and code, "
                               f"counted, not written one by one")

    def _write(self, event: str, **fields: object) -> None:
        try:
            self.audit.write(event, **fields)
        except OSError as err:
            log.error("audit of a refusal failed: %s", err)
