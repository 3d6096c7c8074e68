"""Homes as small ports: ``HomePorts`` asks each port of the home that provides it and
stands a default in for each it does not, and the built-in homes declare every port."""

from __future__ import annotations

import asyncio
from pathlib import Path

from slurm_fiber.core.book.health import SourceHealth
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.devices import DeviceChannel
from slurm_fiber.core.seam import (
    CgroupRoot,
    DeviceSource,
    GrantSource,
    Home,
    HomePorts,
    Liveness,
    Readiness,
)
from slurm_fiber.homes.kubernetes.home import KubernetesHome
from slurm_fiber.homes.slurm.home import SlurmHome
from slurm_fiber.homes.standalone import StandaloneHome


class BareHome:
    """A home that is only a name and background work: no port at all."""

    def name(self) -> str:
        return "bare"

    async def run(self) -> None:
        return None


def test_a_home_without_ports_gets_every_default(clock: FakeClock) -> None:
    health = SourceHealth(clock, 5.0, control_plane=False)
    ports = HomePorts(BareHome(), health)
    assert isinstance(BareHome(), Home) and ports.provided() == []
    assert ports.name() == "bare" and ports.scope_loss is None

    async def ask() -> None:
        assert await ports.grant_source.grants() is None
        await ports.readiness.publish_ready("g1", True)
        channel, release = await ports.device_source.devices(None)  # type: ignore[arg-type]
        assert channel == DeviceChannel()
        release()

    asyncio.run(ask())
    assert ports.liveness.health() is health and health.read().fresh
    assert ports.liveness.scope() == [] and ports.cgroups.cgroup_root() is None


def test_a_home_is_asked_for_the_ports_it_provides(tmp_path: Path, clock: FakeClock) -> None:
    class Partial(BareHome):
        def cgroup_root(self) -> str | None:
            return str(tmp_path)

    ports = HomePorts(Partial(), SourceHealth(clock, 5.0, control_plane=False))
    assert ports.provided() == ["cgroup_root"] and ports.cgroups.cgroup_root() == str(tmp_path)


def test_the_built_in_homes_declare_their_ports() -> None:
    every = (Home, GrantSource, Liveness, Readiness, DeviceSource, CgroupRoot)
    for home in (StandaloneHome, SlurmHome, KubernetesHome):
        assert all(port in home.__mro__ for port in every), home
