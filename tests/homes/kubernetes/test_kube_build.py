"""build_kubernetes_home: fiberd's configuration and a grant Pod's environment to a home."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from slurm_fiber.core.book.health import HealthState
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.devices import Device
from slurm_fiber.core.trust.grant import FiberSpec, ScopeClaim, VerifiedToken
from slurm_fiber.homes import Home, LosesScope
from slurm_fiber.homes.kubernetes.home import KubernetesHome, build_kubernetes_home
from slurm_fiber.homes.kubernetes.incluster import InClusterError
from slurm_fiber.homes.select import load_config
from slurm_fiber.testing.kubernetes.fake import PODS, FakeApiServer

GPU_GRANT = VerifiedToken("g1", "iss", "j", ("aud",), 0.0, 0.0, None,
                          FiberSpec(devices=("gpu",)), b"")


@pytest.fixture
def environ(pod_env: dict[str, str], service_account: Path) -> dict[str, str]:
    """The grant Pod's environment, its service account directory given by override."""
    return {**pod_env, "SLURM_FIBER_KUBE_SERVICE_ACCOUNT_DIR": str(service_account)}


def fiberd_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    grants = tmp_path / "grants"
    grants.mkdir(mode=0o755, exist_ok=True)
    return {"FIBERD_HOME": "kubernetes", "FIBERD_STATE_DIR": str(tmp_path / "state"),
            "FIBERD_GRANTDIR": str(grants), "FIBERD_CGROUP_ROOT": "none",
            "FIBERD_POLL_INTERVAL": "2", "FIBERD_STALE_TTL": "20", **extra}


async def build(env: dict[str, str], clock: FakeClock, environ: dict[str, str]) -> KubernetesHome:
    """The home as fiberd builds it (on the loop it will use)."""
    return await build_kubernetes_home(load_config(env=env), clock, environ)


def test_it_builds_a_home_that_has_read_its_pod_and_claims(
    tmp_path: Path, clock: FakeClock, fake: FakeApiServer, environ: dict[str, str],
    claim_name: str,
) -> None:
    env = fiberd_env(tmp_path, FIBERD_READY_CONDITION="example.com/warm")

    async def check() -> None:
        home = await build(env, clock, environ)
        try:
            assert isinstance(home, Home) and isinstance(home, LosesScope)
            assert home.audience() == "k8s:grants:grant-pod-1"
            assert home.health().read().state is HealthState.FRESH, "one round at build"
            assert ScopeClaim("kubernetes.resource_claim", claim_name) in home.scope()
            assert ScopeClaim("kubernetes.node", "node-1") in home.scope()
            channel, _ = await home.devices(GPU_GRANT)
            assert [d.uuid for d in channel.devices] == ["GPU-aaaa", "GPU-bbbb"]
            assert home.cgroup_root() is None and "none" in home.cgroup_reason()
            health = home.health()
            clock.advance(19)
            assert health.read().state is HealthState.FRESH
            clock.advance(1)
            assert health.read().state is HealthState.STALE, "stale_ttl from the config"
            await home.publish_ready("g1", True)
            pod = fake.store.get(PODS, "grants", "grant-pod-1")
            kinds = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
            assert kinds["example.com/warm"] == "True"
            events = await home.grants()
            await events.aclose()
        finally:
            await home.aclose()

    asyncio.run(check())


def test_static_devices_from_the_config_win_and_a_dead_server_does_not_stop_it(
    tmp_path: Path, clock: FakeClock, fake: FakeApiServer, environ: dict[str, str]
) -> None:
    fake.stop()

    async def check() -> None:
        home = await build(fiberd_env(tmp_path, FIBERD_DEVICES="gpu:0:/dev/nvidia0"), clock,
                           environ)
        try:
            assert home.health().read().state is HealthState.NEVER
            assert [s.key for s in home.scope()][:3] == [
                "kubernetes.namespace", "kubernetes.service_account", "kubernetes.pod"]
            channel, _ = await home.devices(GPU_GRANT)
            assert channel.devices == (Device("gpu", 0, "/dev/nvidia0"),)
        finally:
            await home.aclose()

    asyncio.run(check())


def test_an_environment_that_is_not_a_grant_pods_is_refused(
    tmp_path: Path, clock: FakeClock, environ: dict[str, str]
) -> None:
    del environ["SLURM_FIBER_POD_UID"]
    with pytest.raises(InClusterError, match="SLURM_FIBER_POD_UID is not set"):
        asyncio.run(build(fiberd_env(tmp_path), clock, environ))


def test_the_first_round_may_take_longer_than_a_poll_interval(
    tmp_path: Path, clock: FakeClock, fake: FakeApiServer, environ: dict[str, str]
) -> None:
    env = fiberd_env(tmp_path, FIBERD_POLL_INTERVAL="0.05")

    async def check() -> None:
        fake.set_delay(0.3)  # a cold connection to a loaded API server
        building = asyncio.create_task(build(env, clock, environ))
        while clock.sleepers == 0:
            await asyncio.sleep(0.01)  # the round is out; its budget sleeps
        await clock.advance_and_settle(0.5)  # ten poll intervals, within FIRST_ROUND_BUDGET
        home = await building
        try:
            assert home.health().read().state is HealthState.FRESH
            channel, _ = await home.devices(GPU_GRANT)
            assert len(channel.devices) == 2, "the claims are known before fiberd serves"
        finally:
            await home.aclose()

    asyncio.run(check())
