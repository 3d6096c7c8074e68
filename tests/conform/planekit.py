"""A standalone home given a pretend control plane, so every clause has a home to run on.

The standalone home has no control plane, no scope and no device holds, so
the clauses needing those levers are declared skips against it. To test
those clauses themselves (before the Kubernetes and Slurm stages exist),
``PlaneHome`` wraps the real standalone home with the seam's own building
blocks: a ``HealthPoll`` whose round asks a ``Plane`` (failing while it is
silent), a ``ScopeLossQueue`` fed when the plane says the scope is gone, a
scope claim, and device holds recorded on the plane. ``PlaneStage`` has every
lever. The broken variants each break one of those promises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from slurm_fiber.config import FiberdConfig
from slurm_fiber.conform.stage import Capability, Issuer
from slurm_fiber.core.book.health import SourceHealth
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.devices import Device, DeviceChannel
from slurm_fiber.core.seam import Home, ReleaseDevices, ScopeLostHandler
from slurm_fiber.core.trust.grant import ScopeClaim, VerifiedToken
from slurm_fiber.homes.healthpoll import HealthPoll
from slurm_fiber.homes.scopeloss import ScopeLossQueue
from tests.conform.brokenkit import Wrapped, WrappingStage

STALE_TTL = 1.0


@dataclass
class Plane:
    """What the pretend control plane says; the stage's levers change it."""

    silent: bool = False
    scope_lost: bool = False
    held: set[Device] = field(default_factory=set)


class PlaneHome(Wrapped):
    """The standalone home, with health, scope and device holds from a ``Plane``."""

    removes_grants = False  # scope loss bumps the epoch only

    def __init__(self, inner: Home, plane: Plane, clock: Clock, every: float) -> None:
        super().__init__(inner)
        self.plane = plane
        self._health = SourceHealth(clock, STALE_TTL, control_plane=True)
        self._poll = HealthPoll(self._health, every, clock, self._round)
        self._losses = ScopeLossQueue()

    def health(self) -> SourceHealth:
        return self._health

    def scope(self) -> list[ScopeClaim]:
        return [ScopeClaim("plane.name", "test")]

    def on_scope_lost(self, handler: ScopeLostHandler) -> None:
        async def deliver(reason: str) -> None:
            await handler(reason, self.removes_grants)

        self._losses.on_scope_lost(deliver)

    async def devices(self, grant: VerifiedToken) -> tuple[DeviceChannel, ReleaseDevices]:
        channel, _ = await self.inner.devices(grant)
        self.plane.held |= set(channel.devices)

        def release() -> None:
            self.plane.held -= set(channel.devices)

        return channel, release

    async def run(self) -> None:
        await asyncio.gather(self.inner.run(), self._poll.run(), self._losses.run())

    async def _round(self) -> None:
        if self.plane.silent:
            raise ConnectionError("the plane is silent")
        if self.plane.scope_lost:
            self._losses.lose("the plane says the scope is gone")


class PlaneStage(WrappingStage):
    """Every lever: silence, scope loss and device holds, over ``PlaneHome``."""

    wrapper = PlaneHome
    lacks: Mapping[Capability, str] = {}

    def __init__(self) -> None:
        super().__init__()
        self.plane = Plane()

    async def open(self, workdir: Path, issuer: Issuer) -> None:
        self.plane = Plane()
        await super().open(workdir, issuer)

    def flags(self) -> dict[str, object]:
        return {**super().flags(), "stale_ttl": str(STALE_TTL), "fence_ttl": str(2 * STALE_TTL)}

    def wrap(self, home: Home, clock: Clock, config: FiberdConfig) -> Home:
        return self.wrapper(home, self.plane, clock, config.poll_interval)  # type: ignore[call-arg]

    async def silence(self) -> None:
        self.plane.silent = True

    async def restore(self) -> None:
        self.plane.silent = False

    async def lose_scope(self) -> None:
        self.plane.scope_lost = True

    def held_devices(self) -> frozenset[Device]:
        return frozenset(self.plane.held)


class RemovingPlaneHome(PlaneHome):
    removes_grants = True  # the other way to honour scope loss


class DeafPlaneHome(PlaneHome):
    async def _round(self) -> None:  # answers for the plane even when it is silent
        return None


class ScopeKeepingHome(PlaneHome):
    async def _round(self) -> None:  # never notices the scope is gone
        if self.plane.silent:
            raise ConnectionError("the plane is silent")


class HoardingHome(PlaneHome):
    async def devices(self, grant: VerifiedToken) -> tuple[DeviceChannel, ReleaseDevices]:
        channel, _release = await super().devices(grant)
        return channel, lambda: None  # never gives the devices back


class RemovingPlaneStage(PlaneStage):
    wrapper = RemovingPlaneHome


class DeafPlaneStage(PlaneStage):
    wrapper = DeafPlaneHome


class ScopeKeepingStage(PlaneStage):
    wrapper = ScopeKeepingHome


class HoardingStage(PlaneStage):
    wrapper = HoardingHome
