"""The one error type of the lease package for bad input and failed I/O.

Every ``LeaseError`` carries a single line a person can act on (which file or
resource, what is wrong, what to do); callers print ``str(err)`` as is. A
refused claim is a :class:`slurm_fiber.lease.rules.Refusal` instead.
"""

from __future__ import annotations


class LeaseError(Exception):
    """Bad input or a failed read/write; ``str()`` is one line, never a traceback."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def io_failure(what: str, err: OSError) -> LeaseError:
    """A LeaseError for an OS call that failed: ``cannot <what>: <reason>``."""
    return LeaseError(f"cannot {what}: {err.strerror or err}")
