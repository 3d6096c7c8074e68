"""Miss codes: the only way a Clone that starts no fiber answers.

The set is closed and matches DESIGN §4's table (which includes ``unenforceable``,
final: a fiberd run with ``strict_limits`` refuses a grant asking for limits it cannot
enforce, and ``audit_failed``, retryable: the Clone's audit record could not be
written, so nothing was left running). Each miss carries a one-line reason a person
can act on and, where retrying makes sense, when to retry. Callers (fiberctl, homes,
conform) key on ``code`` and ``retryable``, never on text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class MissCode(enum.StrEnum):
    INVALID_TOKEN = "invalid_token"
    DENIED = "denied"
    UNKNOWN_GRANT = "unknown_grant"
    SOURCE_STALE = "source_stale"
    EXPIRED = "expired"
    FENCED = "fenced"
    COLD = "cold"
    WARM_FAILED = "warm_failed"
    CAPACITY = "capacity"
    CLOSED = "closed"
    UNENFORCEABLE = "unenforceable"  # strict limits: the grant asks for limits not enforced here
    AUDIT_FAILED = "audit_failed"  # the Clone's audit record could not be written

    @property
    def retryable(self) -> bool:
        """Whether the same Clone may succeed later without anything else changing."""
        return self in _RETRYABLE


# DENIED is retryable only after `until`; it is listed as retryable because a
# redelivery or the passing of `until` can make the same request succeed.
_RETRYABLE = frozenset(
    {
        MissCode.DENIED,
        MissCode.SOURCE_STALE,
        MissCode.FENCED,
        MissCode.COLD,
        MissCode.CAPACITY,
        MissCode.AUDIT_FAILED,
    }
)


@dataclass(frozen=True)
class Miss:
    """A Clone that started nothing.

    ``reason`` is one line for a person; ``detail`` is a machine code where the
    row has one (the token reason code for invalid_token, the warm error class
    for warm_failed). ``retry_after`` is seconds from now (cold, capacity,
    source_stale, fenced); ``until`` is the Unix time a denial ends.
    """

    code: MissCode
    reason: str
    detail: str | None = None
    retry_after: float | None = None
    until: float | None = None

    @property
    def retryable(self) -> bool:
        return self.code.retryable

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"code": self.code.value, "reason": self.reason,
                                  "retryable": self.retryable}
        if self.detail is not None:
            out["detail"] = self.detail
        if self.retry_after is not None:
            out["retry_after"] = round(self.retry_after, 3)
        if self.until is not None:
            out["until"] = self.until
        return out
