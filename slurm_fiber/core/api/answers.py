"""What a connection answers with beside the op's reply, and how it learns its client left.

``Refusal`` is one refused request or connection as the server's ``audit`` callback
receives it (every refusal is counted and audited through ``ApiServer.refusal``);
``miss_reply`` is the one reply of a Clone that started nothing; ``api_error`` is a
batch item's refusal as validation made it; ``out_of_fds`` tells a failure for want of
descriptors (answered ``busy``, retryable) from a defect (answered ``internal``).
``PeerGone`` is raised by a send the client no longer takes.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from slurm_fiber.core.api.service import Peer
from slurm_fiber.core.book.misses import Miss
from slurm_fiber.protocol.validate import ApiError, ErrorCode

OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)


@dataclass(frozen=True)
class Refusal:
    """One refused request or connection, as given to the audit callback."""

    code: str
    reason: str
    peer: Peer | None
    op: str | None = None
    request_id: int | str | None = None


class PeerGone(Exception):
    """The client closed the connection or stopped taking data."""


def miss_reply(rid: int | str | None, miss: Miss) -> dict[str, object]:
    """A clone that started nothing (always final)."""
    return {"id": rid, "ok": False, "final": True, "miss": miss.to_json()}


def api_error(error: Exception) -> ApiError:
    """A batch item's refusal as validation made it (an ApiError, always)."""
    return error if isinstance(error, ApiError) else ApiError(ErrorCode.BAD_REQUEST, str(error))


def out_of_fds(err: BaseException) -> bool:
    """Whether ``err`` failed for want of descriptors: an OSError, or an error that
    carries its cause's ``errno`` (a failed fork, core/templates/faults.py)."""
    return getattr(err, "errno", None) in OUT_OF_FDS
