"""The seam between the invariant core and the environment that holds a grant.

A home (a standalone host, a Kubernetes grant Pod, a Slurm allocation) differs
from another only in how signed grants arrive ahead of time, how
control-plane liveness is observed, how readiness is published and which
cgroup subtree fiberd owns. ``Home`` is what every home is (a name, background
work); each of those differences is a small port (``GrantSource``,
``Liveness`` and ``LosesScope``, ``Readiness``, ``DeviceSource``,
``CgroupRoot``) a home declares by subclassing it, and ``HomePorts`` is how the
runtime asks a home: each port the home provides, else that port's default. A
home is conformant iff grant-conform passes against it with
``slurm_fiber.core`` unmodified. ``GrantEvent`` is what a home delivers.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
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
class GrantOrigin:
    """Where a delivered token came from, as the home knows it from its own side, without
    reading the token: ``path`` (a file, a Secret key) and ``owner`` (the uid owning it,
    None when that means nothing). Once the token is verified, fiberd calls ``held`` (when
    set) with the UID it names: that, never the token's unverified claims, is which grant
    the origin holds. ``held`` never raises."""

    path: str
    owner: int | None = None
    held: Callable[[str], None] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class GrantEvent:
    """One delivery: ``token`` (and, when the home knows it, ``origin``) is set for
    GRANT_ADDED, ``uid`` for GRANT_REMOVED."""

    kind: EventKind
    token: bytes = b""
    uid: str = ""
    origin: GrantOrigin | None = None

    @classmethod
    def added(cls, token: bytes, origin: GrantOrigin | None = None) -> GrantEvent:
        """A GRANT_ADDED event carrying ``token`` (raw, unverified) from ``origin``."""
        return cls(EventKind.GRANT_ADDED, token=token, origin=origin)

    @classmethod
    def removed(cls, uid: str) -> GrantEvent:
        """A GRANT_REMOVED event naming ``uid``."""
        return cls(EventKind.GRANT_REMOVED, uid=uid)


ReleaseDevices = Callable[[], None]


@runtime_checkable
class Home(Protocol):
    """What every home is: a name and its background work. What else it provides it
    declares by the ports below (subclass each one it implements); ``HomePorts`` fills
    in a default for each port a home does not provide. All methods are called on
    fiberd's event loop; errors are raised as exceptions; a method documented "never
    raises" must not.
    """

    def name(self) -> str:
        """The home's name as ``fiberd --home`` spells it ("standalone", "slurm", ...)."""
        ...

    async def run(self) -> None:
        """Drive whatever the home needs in the background (polls, watches) until cancelled."""
        ...


@runtime_checkable
class GrantSource(Protocol):
    """Port: grants delivered ahead of traffic. Without it, grants arrive only inside Clones."""

    async def grants(self) -> AsyncIterator[GrantEvent] | None:
        """Open grant delivery: events ahead of traffic, and removals.

        A home that delivers nothing returns None, and grants then arrive only
        inside Clone requests. Raises when delivery cannot start (e.g. a
        refused grantdir). Iteration ends when delivery closes; cancelling
        the consuming task stops it.
        """
        ...


@runtime_checkable
class Liveness(Protocol):
    """Port: the control plane's liveness and the scope the home asserts. Without it there
    is no control plane (health always fresh, fences never end by silence) and no scope."""

    def health(self) -> SourceHealth:
        """The control-plane liveness the miss codes key on (always the same object)."""
        ...

    def scope(self) -> list[ScopeClaim]:
        """What this home asserts about where it runs; empty on a standalone host.

        Scope is stamped on audit records and is never a third validity term: a
        home that loses it revokes fences (the core's epoch bump) or grants
        (GRANT_REMOVED), and the core keeps min(lease, fence). A home whose
        scope can be lost also implements ``LosesScope``.
        """
        ...


@runtime_checkable
class Readiness(Protocol):
    """Port: readiness published to the control plane. Without it nothing is published."""

    async def publish_ready(self, grant_uid: str, ready: bool) -> None:
        """Tell the control plane that the grant's template is warm, or no longer is.

        A readiness gate, a status stream, or a file. Raises the publish error.
        """
        ...


@runtime_checkable
class DeviceSource(Protocol):
    """Port: the devices a grant's fibers may see. Without it a grant gets none."""

    async def devices(self, grant: VerifiedToken) -> tuple[DeviceChannel, ReleaseDevices]:
        """Provision the grant's device channel and return it with how to release it.

        A static set, a DRA claim, the allocation's GRES. The release callable
        is idempotent and never raises. Raises when the devices cannot be had.
        """
        ...


@runtime_checkable
class CgroupRoot(Protocol):
    """Port: a delegated cgroup subtree. Without it fiberd carves none (``cgroup_root``
    none)."""

    def cgroup_root(self) -> str | None:
        """The delegated cgroup v2 subtree the runtime may carve; None when there is none."""
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


def _no_release() -> None:
    return None


class _NoGrants:
    async def grants(self) -> AsyncIterator[GrantEvent] | None:
        return None


@dataclass
class _NoControlPlane:
    health_: SourceHealth

    def health(self) -> SourceHealth:
        return self.health_

    def scope(self) -> list[ScopeClaim]:
        return []


class _Unpublished:
    async def publish_ready(self, grant_uid: str, ready: bool) -> None:
        return None


class _NoDevices:
    async def devices(self, grant: VerifiedToken) -> tuple[DeviceChannel, ReleaseDevices]:
        return DeviceChannel(), _no_release


class _NoCgroupRoot:
    def cgroup_root(self) -> str | None:
        return None


class HomePorts:
    """A home as the runtime and fiberd's wiring ask it: one attribute per port, the home
    itself where it provides the port, else the port's default (no delivery, no
    control plane and no scope, nothing published, no devices, no cgroup root).
    ``scope_loss`` is the home when it ``LosesScope``, else None.
    """

    def __init__(self, home: Home, no_control_plane: SourceHealth) -> None:
        """``no_control_plane``: the health the liveness default reports (one that has no
        control plane, so always fresh); unused when the home provides liveness."""
        self.home = home
        self.grant_source: GrantSource = home if isinstance(home, GrantSource) else _NoGrants()
        self.liveness: Liveness = (home if isinstance(home, Liveness)
                                   else _NoControlPlane(no_control_plane))
        self.readiness: Readiness = home if isinstance(home, Readiness) else _Unpublished()
        self.device_source: DeviceSource = (home if isinstance(home, DeviceSource)
                                            else _NoDevices())
        self.cgroups: CgroupRoot = home if isinstance(home, CgroupRoot) else _NoCgroupRoot()
        self.scope_loss: LosesScope | None = home if isinstance(home, LosesScope) else None

    def name(self) -> str:
        return self.home.name()

    def provided(self) -> list[str]:
        """The ports the home itself provides, by name (for status and the start record)."""
        return [name for name, port in (
            ("grant_source", GrantSource), ("liveness", Liveness), ("readiness", Readiness),
            ("devices", DeviceSource), ("cgroup_root", CgroupRoot), ("scope_loss", LosesScope),
        ) if isinstance(self.home, port)]
