"""delivery: drive feeds a home's grant deliveries into the core.

On GRANT_ADDED it verifies the token, lifts any denial of its UID and admits
it; on GRANT_REMOVED it removes the UID. A delivery the core refuses (a bad
token, an admission that fails) becomes a reported ``Problem`` and never
stops delivery. ``drive`` returns when the home's delivery ends, at once
when the home delivers nothing, or when its task is cancelled.
"""

from __future__ import annotations

from typing import Protocol

from slurm_fiber.core.seam import EventKind, GrantEvent, GrantOrigin, GrantSource, Home
from slurm_fiber.core.trust.grant import VerifiedToken, valid_uid
from slurm_fiber.homes.healthpoll import error_message
from slurm_fiber.homes.problem import Problem, ProblemSink, log_problem


class Admitter(Protocol):
    """The part of the core drive calls. All of it runs on the event loop."""

    def verify(self, raw: bytes) -> VerifiedToken:
        """Verify a raw token; raises (the core's TokenRefused) when it is refused."""
        ...

    def lift(self, uid: str) -> bool:
        """Lift a removal denial of ``uid``; True when there was one."""
        ...

    async def admit(self, vt: VerifiedToken) -> object:
        """Admit the verified grant (warm its template); raises when it cannot.

        What it returns (the core's Admitted) is not used here."""
        ...

    async def remove(self, uid: str) -> None:
        """Remove the grant: release its fibers and deny the UID until its tokens expire."""
        ...


def _reason(err: BaseException) -> str:
    """The one-line reason of a refusal: the core's ``.reason`` when it has one."""
    reason = getattr(err, "reason", None)
    return str(reason) if reason else error_message(err)


async def deliver(event: GrantEvent, core: Admitter, on_problem: ProblemSink) -> None:
    """Apply one delivery to the core; a refusal is reported to ``on_problem``, never raised.

    Cancellation propagates.
    """
    if event.kind is EventKind.GRANT_ADDED:
        origin = event.origin
        try:
            vt = core.verify(event.token)
        except Exception as err:
            code = str(getattr(err, "code", "") or "token_refused")
            where = "delivered token" if origin is None else _origin(origin)
            on_problem(Problem(code, where, _reason(err)))
            return
        if origin is not None and origin.held is not None:
            origin.held(vt.uid)  # what the origin holds is what verification found
        try:
            core.lift(vt.uid)
            await core.admit(vt)
        except Exception as err:
            on_problem(Problem("admit_failed", vt.uid, _reason(err)))
        return
    if not valid_uid(event.uid):
        on_problem(Problem("bad_uid", repr(event.uid), "removal names no valid grant UID"))
        return
    try:
        await core.remove(event.uid)
    except Exception as err:
        on_problem(Problem("remove_failed", event.uid, _reason(err)))


def _origin(origin: GrantOrigin) -> str:
    owner = "" if origin.owner is None else f" (owned by uid {origin.owner})"
    return f"token from {origin.path}{owner}"


async def drive(home: Home, core: Admitter, on_problem: ProblemSink = log_problem) -> None:
    """Feed ``home.grants()`` into ``core`` until delivery ends or this task is cancelled
    (at once when the home is no GrantSource).

    Blocks for the life of delivery, one event at a time in delivery order.
    A delivery that cannot start or that breaks is reported (code
    ``grants_failed``) and drive returns; nothing here raises but
    cancellation.
    """
    try:
        if not isinstance(home, GrantSource):
            return
        events = await home.grants()
        if events is None:
            return
        async for event in events:
            await deliver(event, core, on_problem)
    except Exception as err:
        on_problem(Problem("grants_failed", home.name(), error_message(err)))
