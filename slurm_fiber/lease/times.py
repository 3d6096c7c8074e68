"""Time stamps as the lease records write them: RFC 3339 in UTC.

The package keeps time as Unix seconds (floats) and converts only at the
file edge. Writers emit ``2026-01-02T03:04:05.123456Z``; readers accept any
RFC 3339 form a shell's ``date -u +%Y-%m-%dT%H:%M:%SZ`` or Go writes.
"""

from __future__ import annotations

from datetime import UTC, datetime


def to_rfc3339(unix: float) -> str:
    """Format Unix seconds as RFC 3339 UTC with microseconds; never fails for real times."""
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_rfc3339(text: str) -> float:
    """Parse an RFC 3339 time stamp to Unix seconds.

    Raises ValueError (with the offending text) when ``text`` is not one; a
    stamp without a zone is refused rather than guessed.
    """
    try:
        stamp = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        raise ValueError(f"{text!r} is not an RFC 3339 time") from None
    if stamp.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone")
    return stamp.timestamp()
