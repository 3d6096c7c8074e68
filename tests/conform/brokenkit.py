"""Deliberately broken standalone homes, as stages grant-conform must fail.

Each wraps the real standalone home (built exactly as fiberd builds it) and
breaks one promise of the seam: ``NoRemovalsStage`` never delivers a
removal, ``FlappingReadinessStage`` publishes every rise of readiness as
up-down-up, ``LeakyDevicesStage`` hands every grant all the host's devices
whatever kinds it names, and ``CannotDeliverStage`` has a lever that fails
at run time without having declared it. Run them with
``slurm-fiber conform --home tests.conform.brokenkit:NoRemovalsStage``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from slurm_fiber.config import FiberdConfig
from slurm_fiber.conform.stage import Launch, StageCannot
from slurm_fiber.conform.standalone import DEVICES, StandaloneStage
from slurm_fiber.core.book.health import SourceHealth
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.devices import DeviceChannel
from slurm_fiber.core.seam import EventKind, GrantEvent, Home, ReleaseDevices
from slurm_fiber.core.trust.grant import ScopeClaim, VerifiedToken
from slurm_fiber.homes.problem import ProblemSink
from slurm_fiber.homes.select import BuiltHome, build_home


class Wrapped:
    """A Home that forwards every call to the real one; subclasses break one thing."""

    def __init__(self, inner: Home) -> None:
        self.inner = inner

    def name(self) -> str:
        return self.inner.name()

    async def grants(self) -> AsyncIterator[GrantEvent] | None:
        return await self.inner.grants()

    def health(self) -> SourceHealth:
        return self.inner.health()

    def cgroup_root(self) -> str | None:
        return self.inner.cgroup_root()

    async def publish_ready(self, grant_uid: str, ready: bool) -> None:
        await self.inner.publish_ready(grant_uid, ready)

    def scope(self) -> list[ScopeClaim]:
        return self.inner.scope()

    async def devices(self, grant: VerifiedToken) -> tuple[DeviceChannel, ReleaseDevices]:
        return await self.inner.devices(grant)

    async def run(self) -> None:
        await self.inner.run()

    def close(self) -> list[str]:
        return list(self.inner.close())  # type: ignore[attr-defined]


class NoRemovals(Wrapped):
    async def grants(self) -> AsyncIterator[GrantEvent] | None:
        events = await self.inner.grants()
        if events is None:
            return None

        async def added_only() -> AsyncIterator[GrantEvent]:
            async for event in events:
                if event.kind is EventKind.GRANT_ADDED:
                    yield event

        return added_only()


class FlappingReadiness(Wrapped):
    async def publish_ready(self, grant_uid: str, ready: bool) -> None:
        await self.inner.publish_ready(grant_uid, ready)
        if ready:
            await self.inner.publish_ready(grant_uid, False)
            await self.inner.publish_ready(grant_uid, True)


class LeakyDevices(Wrapped):
    async def devices(self, grant: VerifiedToken) -> tuple[DeviceChannel, ReleaseDevices]:
        _narrowed, release = await self.inner.devices(grant)
        return DeviceChannel.of(DEVICES), release


class WrappingStage(StandaloneStage):
    """The standalone stage with its home (built as fiberd builds it) wrapped by ``wrap``."""

    wrapper: type[Wrapped] = Wrapped

    def wrap(self, home: Home, clock: Clock, config: FiberdConfig) -> Home:
        return self.wrapper(home)

    def launch(self) -> Launch:
        base = super().launch()

        async def build(config: FiberdConfig, clock: Clock, environ: Mapping[str, str],
                        on_problem: ProblemSink) -> BuiltHome:
            built = await build_home(config, clock, environ, on_problem)
            return built.replaced(home=self.wrap(built.home, clock, config))

        return Launch(base.config, base.environ, build)


class NoRemovalsStage(WrappingStage):
    wrapper = NoRemovals


class FlappingReadinessStage(WrappingStage):
    wrapper = FlappingReadiness


class LeakyDevicesStage(WrappingStage):
    wrapper = LeakyDevices


class CannotDeliverStage(StandaloneStage):
    async def deliver(self, uid: str, token: str) -> None:
        raise StageCannot("the grant store is read-only here")
