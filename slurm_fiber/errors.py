"""The project's one coded-error type.

``CodedError`` is a refusal or failure that carries ``code``, a short name a
program keys on (and an audit record stores), and ``reason``, one line a
person can act on; ``str()`` is the reason. Every exception of the package
that has a code derives from it, so a caller that reports, audits or
translates a failure catches one type and reads the same two attributes.
Standard library only; it sits in the lowest layer so every module may use it.
"""

from __future__ import annotations


class CodedError(Exception):
    """A failure with ``code`` (to key on) and a one-line ``reason`` (for people)."""

    code: str
    reason: str

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
