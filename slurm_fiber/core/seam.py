"""The seam between the invariant core and the environment that holds a grant.

A home (a standalone host, a Kubernetes grant Pod, a Slurm allocation) differs
from another only in how signed grants arrive ahead of time, how
control-plane liveness is observed, how readiness is published and which
cgroup subtree fiberd owns. ``Home`` is that difference as a Protocol; a home
is conformant iff grant-conform passes against it with ``slurm_fiber.core``
unmodified. ``GrantEvent`` is what a home delivers.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from slurm_fiber.core.book.health import SourceHealth
from slurm_fiber.core.devices import DeviceChannel
from slurm_fiber.core.trust.grant import ScopeClaim, VerifiedToken


class EventKind(enum.Enum):
    """What the home delivered."""

    # A signed token to pre-admit (warm the template before the first Clone).
    # fiberd verifies it like any other.
    GRANT_ADDED = "grant_added"
    # A grant the home no longer holds. Its running fibers are released and
    # the UID is refused until every token for it has expired, or the home
    # delivers it again.
    GRANT_REMOVED = "grant_removed"


@dataclass(frozen=True)
class GrantEvent:
    """One delivery: ``token`` is set for GRANT_ADDED, ``uid`` for GRANT_REMOVED."""

    kind: EventKind
    token: bytes = b""
    uid: str = ""

    @classmethod
    def added(cls, token: bytes) -> GrantEvent:
        """A GRANT_ADDED event carrying ``token`` (raw, unverified)."""
        return cls(EventKind.GRANT_ADDED, token=token)

    @classmethod
    def removed(cls, uid: str) -> GrantEvent:
        """A GRANT_REMOVED event naming ``uid``."""
        return cls(EventKind.GRANT_REMOVED, uid=uid)


ReleaseDevices = Callable[[], None]


@runtime_checkable
class Home(Protocol):
    """What fiberd wires around the core. All methods are called on fiberd's event loop.

    Errors are raised as exceptions; a method documented "never raises" must not.
    """

    def name(self) -> str:
        """The home's name as ``fiberd --home`` spells it ("standalone", "slurm", ...)."""
        ...

    async def grants(self) -> AsyncIterator[GrantEvent] | None:
        """Open grant delivery: events ahead of traffic, and removals.

        A home that delivers nothing returns None, and grants then arrive only
        inside Clone requests. Raises when delivery cannot start (e.g. a
        refused grantdir). Iteration ends when delivery closes; cancelling
        the consuming task stops it.
        """
        ...

    def health(self) -> SourceHealth:
        """The control-plane liveness the miss codes key on (always the same object)."""
        ...

    def cgroup_root(self) -> str | None:
        """The delegated cgroup v2 subtree the runtime may carve; None when there is none."""
        ...

    async def publish_ready(self, grant_uid: str, ready: bool) -> None:
        """Tell the control plane that the grant's template is warm, or no longer is.

        A readiness gate, a status stream, or nothing. Raises the publish error.
        """
        ...

    def scope(self) -> list[ScopeClaim]:
        """What this home asserts about where it runs; empty on a standalone host.

        Scope is stamped on audit records and is never a third validity term: a
        home that loses it revokes fences (the core's epoch bump) or grants
        (GRANT_REMOVED), and the core keeps min(lease, fence).
        """
        ...

    async def devices(self, grant: VerifiedToken) -> tuple[DeviceChannel, ReleaseDevices]:
        """Provision the grant's device channel and return it with how to release it.

        A static set, a DRA claim, the allocation's GRES. The release callable
        is idempotent and never raises. Raises when the devices cannot be had.
        """
        ...

    async def run(self) -> None:
        """Drive whatever the home needs in the background (polls, watches) until cancelled."""
        ...


# ``handler(reason, removes_grants)``: the core bumps the epoch (ending every
# fence) and, when ``removes_grants``, also removes every grant of the home.
ScopeLostHandler = Callable[[str, bool], Awaitable[None]]


@runtime_checkable
class LosesScope(Protocol):
    """A home whose scope can be lost (its job ends, its Pod is deleted).

    fiberd registers one handler before ``run`` starts; the home delivers
    each loss once, in order, on the task ``run`` owns (a ScopeLossQueue).
    Homes without a scope (standalone) do not implement it.
    """

    def on_scope_lost(self, handler: ScopeLostHandler) -> None:
        """Set the handler every loss of scope is delivered to. Never raises."""
        ...
