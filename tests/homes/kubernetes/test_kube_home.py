"""KubernetesHome against the fake API server over real HTTPS, timed by the FakeClock.

Rounds are driven with ``poll.once()`` (or by ``run`` on clock ticks); scope
loss is delivered by the home's own ScopeLossQueue task. Nothing here
patches the client: the home's code path is the one a real API server sees.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from slurm_fiber.core.book.health import HealthState
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.devices import Device
from slurm_fiber.core.trust.grant import FiberSpec, VerifiedToken
from slurm_fiber.homes import Home, LosesScope
from slurm_fiber.homes.kubernetes.api import ApiFailure, KubeApi
from slurm_fiber.homes.kubernetes.home import DevicesUnknown, KubernetesHome
from slurm_fiber.homes.kubernetes.incluster import InClusterConfig
from slurm_fiber.testing.kubernetes.fake import (
    DEFAULT_GATE,
    PODS,
    RESOURCE_CLAIMS,
    FakeApiServer,
    grant_pod,
    resource_claim,
)
from slurm_fiber.testing.kubernetes.fake.secretvolume import atomic_write, write_secret
from tests.homes.homekit import token
from tests.homes.kubernetes.conftest import GPUS, NAMESPACE, POD

INTERVAL = 1.0
STALE = 10.0

Lost = list[tuple[str, bool]]


def grant(uid: str = "g1", devices: tuple[str, ...] = ("gpu",)) -> VerifiedToken:
    return VerifiedToken(uid, "iss", "j", ("aud",), 0.0, 0.0, None, FiberSpec(devices=devices),
                         b"")


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    path = tmp_path / "grants"
    path.mkdir(mode=0o755)
    return path


Scenario = Callable[[KubernetesHome, Lost], Awaitable[None]]


def scenario(in_cluster: InClusterConfig, clock: FakeClock, volume: Path, body: Scenario,
             *, run: bool = False, **kw: Any) -> None:
    """Run ``body(home, lost)`` beside ``home.run()`` (``run``) or its scope-loss delivery alone.

    The home is closed after; an error that ended ``run`` early fails the test.
    """

    async def main() -> None:
        home = KubernetesHome(KubeApi(in_cluster, clock=clock, timeout=5.0), clock,
                              grantdir=str(volume), poll_interval=INTERVAL, stale_after=STALE,
                              **kw)
        lost: Lost = []

        async def handler(reason: str, removes_grants: bool) -> None:
            lost.append((reason, removes_grants))

        home.on_scope_lost(handler)
        background = asyncio.create_task(home.run() if run else home.scope_loss.run())
        try:
            await body(home, lost)
        finally:
            ended_early = background.done()
            background.cancel()
            await asyncio.gather(background, return_exceptions=True)
            assert await home.aclose() == []
        if ended_early:
            background.result()

    asyncio.run(main())


async def rounds(home: KubernetesHome, n: int = 1) -> None:
    """``n`` API rounds, then let scope-loss delivery run."""
    for _ in range(n):
        await home.poll.once()
    await FakeClock.settle()


def claim_uid(fake: FakeApiServer, name: str) -> str:
    return str(fake.store.get(RESOURCE_CLAIMS, NAMESPACE, name)["metadata"]["uid"])


def test_it_is_a_home_that_loses_scope(in_cluster: InClusterConfig, clock: FakeClock,
                                       volume: Path) -> None:
    async def body(home: KubernetesHome, lost: Lost) -> None:
        assert isinstance(home, Home) and isinstance(home, LosesScope)
        assert home.name() == "kubernetes"
        assert home.audience() == f"k8s:{NAMESPACE}:{POD}"

    scenario(in_cluster, clock, volume, body)


def test_api_server_down_turns_health_stale_and_it_recovers(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock, volume: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body(home: KubernetesHome, lost: Lost) -> None:
        assert home.health().read().state is HealthState.NEVER
        assert await home.poll.once() is None
        assert home.health().read().state is HealthState.FRESH
        fake.stop()
        for _ in range(3):
            failed = await home.poll.once()
            assert isinstance(failed, ApiFailure) and failed.code is None
        clock.advance(STALE - 1)
        assert home.health().read().state is HealthState.FRESH
        clock.advance(1)
        assert home.health().read().state is HealthState.STALE
        fake.start()
        assert await home.poll.once() is None
        assert home.health().read().state is HealthState.FRESH
        assert lost == []

    with caplog.at_level(logging.INFO, logger="slurm_fiber.homes.kubernetes"):
        scenario(in_cluster, clock, volume, body)
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "API round failed" in m]) == 1, "each failure once"
    assert len([m for m in messages if "answers again" in m]) == 1


def test_a_500_or_a_slow_answer_is_a_failed_round_too(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock, volume: Path
) -> None:
    async def body(home: KubernetesHome, lost: Lost) -> None:
        fake.inject(500, resource="resourceclaims")
        failed = await home.poll.once()
        assert isinstance(failed, ApiFailure) and failed.code == 500
        assert home.health().read().state is HealthState.NEVER
        fake.set_delay(30)
        slow = asyncio.create_task(home.poll.once())
        while not slow.done() and clock.sleepers == 0:
            await asyncio.sleep(0.01)  # the round's request is out; its budget sleeps
        await clock.advance_and_settle(INTERVAL)
        assert type(await slow).__name__ == "RoundTimeout"
        fake.clear_faults()
        assert lost == []

    scenario(in_cluster, clock, volume, body)


def test_pod_deleted_removes_the_grants_once(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock, volume: Path,
    claim_name: str,
) -> None:
    async def body(home: KubernetesHome, lost: Lost) -> None:
        await rounds(home, 2)
        assert lost == []
        fake.store.delete(PODS, NAMESPACE, POD)  # graceful: deletionTimestamp set
        await rounds(home, 3)
        assert len(lost) == 1
        reason, removes = lost[0]
        assert removes is True and "is being deleted" in reason
        assert home.pod_over
        fake.store.remove(PODS, NAMESPACE, POD)  # then gone, and its claim with it
        fake.store.remove(RESOURCE_CLAIMS, NAMESPACE, claim_name)
        await rounds(home, 3)
        assert len(lost) == 1, "the Pod's end is delivered once; nothing after it"
        assert "kubernetes.pod" in {c.key for c in home.scope()}, "the last scope stays"

    scenario(in_cluster, clock, volume, body)


def test_claim_deallocated_bumps_the_epoch_only(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock, volume: Path,
    claim_name: str,
) -> None:
    async def body(home: KubernetesHome, lost: Lost) -> None:
        await rounds(home)
        channel, release = await home.devices(grant())
        assert [(d.index, d.uuid) for d in channel.devices] == [(0, "GPU-aaaa"), (1, "GPU-bbbb")]
        release()
        release()
        uid = claim_uid(fake, claim_name)
        fake.store.put(RESOURCE_CLAIMS, resource_claim(claim_name, NAMESPACE, uid=uid))
        await rounds(home, 3)
        assert lost == [(f"resourceclaim {NAMESPACE}/{claim_name} was deallocated", False)]
        assert not home.pod_over
        channel, _ = await home.devices(grant())
        assert channel.devices == ()

    scenario(in_cluster, clock, volume, body)


@pytest.mark.parametrize(
    ("change", "removes", "says"),
    [
        ("replace_pod", True, "is another Pod now"),
        ("recreate_claim", False, "was recreated"),
        ("delete_claim", False, "is being deleted"),
    ],
)
def test_every_loss_reaches_the_handler_with_its_weight(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock, volume: Path,
    claim_name: str, change: str, removes: bool, says: str,
) -> None:
    async def body(home: KubernetesHome, lost: Lost) -> None:
        await rounds(home)
        if change == "replace_pod":
            fake.store.put(PODS, grant_pod(POD, NAMESPACE, uid="another-uid",
                                           claims={"gpus": claim_name}))
        elif change == "recreate_claim":
            fake.store.put(RESOURCE_CLAIMS, resource_claim(claim_name, NAMESPACE, GPUS,
                                                           uid="another-claim-uid"))
        else:
            fake.store.delete(RESOURCE_CLAIMS, NAMESPACE, claim_name)  # finalizer: marked
        await rounds(home, 2)
        assert len(lost) == 1 and lost[0][1] is removes and says in lost[0][0]

    scenario(in_cluster, clock, volume, body)


def pod_conditions(fake: FakeApiServer) -> dict[str, str]:
    pod = fake.store.get(PODS, NAMESPACE, POD)
    return {c["type"]: c["status"] for c in pod["status"]["conditions"]}


def status_patches(fake: FakeApiServer) -> int:
    return sum(1 for s in fake.seen if s.method == "PATCH" and s.path.endswith("/status"))


def test_readiness_is_patched_once_per_flip_keeping_other_conditions(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock, volume: Path
) -> None:
    async def body(home: KubernetesHome, lost: Lost) -> None:
        await home.publish_ready("g1", True)
        assert status_patches(fake) == 1 and pod_conditions(fake)[DEFAULT_GATE] == "True"
        await home.publish_ready("g2", True)
        await home.publish_ready("g1", False)
        assert status_patches(fake) == 1, "still warm: no patch"
        await home.publish_ready("g2", False)
        assert status_patches(fake) == 2 and pod_conditions(fake)[DEFAULT_GATE] == "False"
        conditions = pod_conditions(fake)
        assert {"PodScheduled", "Initialized", "ContainersReady", "Ready"} <= set(conditions)
        pod = fake.store.get(PODS, NAMESPACE, POD)
        mine = next(c for c in pod["status"]["conditions"] if c["type"] == DEFAULT_GATE)
        assert (mine["reason"], mine["message"]) == ("NoTemplateWarm",
                                                     "no grant template is warm")

    scenario(in_cluster, clock, volume, body)


def test_readiness_never_goes_back_to_an_older_state(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock, volume: Path
) -> None:
    async def body(home: KubernetesHome, lost: Lost) -> None:
        fake.set_delay(0.3)
        first = asyncio.create_task(home.publish_ready("g1", True))
        await asyncio.sleep(0.05)  # the True patch is in flight
        await home.publish_ready("g1", False)  # decided while it flies: returns at once
        await home.publish_ready("g2", True)
        await home.publish_ready("g2", False)
        assert not first.done()
        await first
        assert status_patches(fake) == 2, "True, then only the newest state (False)"
        assert pod_conditions(fake)[DEFAULT_GATE] == "False"

    scenario(in_cluster, clock, volume, body)


def test_a_failed_readiness_patch_is_sent_again_by_run(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock, volume: Path
) -> None:
    async def body(home: KubernetesHome, lost: Lost) -> None:
        fake.inject(500, method="PATCH", resource="pods")
        with pytest.raises(ApiFailure):
            await home.publish_ready("g1", True)
        assert DEFAULT_GATE not in pod_conditions(fake)
        await eventually(lambda: home.health().read().state is HealthState.FRESH)
        await clock.advance_and_settle(INTERVAL)
        await eventually(lambda: pod_conditions(fake).get(DEFAULT_GATE) == "True")
        assert status_patches(fake) == 2

    scenario(in_cluster, clock, volume, body, run=True)


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait (real time, for real HTTP) until ``check()`` holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_run_delivers_a_pod_deletion_once_on_its_own_task(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock, volume: Path
) -> None:
    async def body(home: KubernetesHome, lost: Lost) -> None:
        await eventually(lambda: home.health().read().state is HealthState.FRESH)
        fake.store.delete(PODS, NAMESPACE, POD)
        gets = len(fake.seen)
        for _ in range(3):
            await clock.advance_and_settle(INTERVAL)
            await eventually(lambda before=gets: len(fake.seen) > before)  # the tick's round ran
            gets = len(fake.seen)
            await eventually(lambda: bool(lost))
        assert len(lost) == 1 and lost[0][1] is True

    scenario(in_cluster, clock, volume, body, run=True)


def test_a_secret_rotation_delivers_one_added_per_new_token_and_no_removal(
    in_cluster: InClusterConfig, clock: FakeClock, volume: Path
) -> None:
    async def body(home: KubernetesHome, lost: Lost) -> None:
        write_secret(volume, {"grant.jwt": token("alpha", "j1")})
        events = await home.grants()
        seen: list[tuple[str, str]] = []

        async def consume() -> None:
            async for event in events:
                seen.append((event.kind.value, event.uid or event.token.decode()))

        consumer = asyncio.create_task(consume())
        try:
            await FakeClock.settle()
            assert seen == [("grant_added", token("alpha", "j1").decode())]
            for jti in ("j2", "j3"):
                for _step in atomic_write(volume, {"grant.jwt": token("alpha", jti)}):
                    await clock.advance_and_settle(INTERVAL)  # a poll between every step
            await clock.advance_and_settle(INTERVAL)
        finally:
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
        assert [kind for kind, _ in seen] == ["grant_added"] * 3, "no removal, one per token"
        assert [t for _, t in seen] == [token("alpha", j).decode() for j in ("j1", "j2", "j3")]

    scenario(in_cluster, clock, volume, body)


def test_devices_static_or_unknown_before_the_first_answer(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock, volume: Path
) -> None:
    async def unknown(home: KubernetesHome, lost: Lost) -> None:
        with pytest.raises(DevicesUnknown) as caught:
            await home.devices(grant())
        assert caught.value.code == "devices_unknown"

    async def static(home: KubernetesHome, lost: Lost) -> None:
        channel, _ = await home.devices(grant())
        assert channel.devices == (Device("gpu", 0, "/dev/nvidia0"),)
        channel, _ = await home.devices(grant(devices=()))
        assert channel.devices == ()

    fake.stop()
    scenario(in_cluster, clock, volume, unknown)
    scenario(in_cluster, clock, volume, static, devices=[Device("gpu", 0, "/dev/nvidia0")])



def test_a_refused_token_ends_the_pod_on_the_second_401_in_a_row(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock, volume: Path
) -> None:
    async def body(home: KubernetesHome, lost: Lost) -> None:
        await rounds(home)
        principal = fake.tokens.pop(fake.token)  # the API server no longer accepts the token
        failed = await home.poll.once()
        assert isinstance(failed, ApiFailure) and failed.code == 401
        await FakeClock.settle()
        assert lost == [] and not home.pod_over, "one 401 is not yet a verdict"
        fake.tokens[fake.token] = principal
        await rounds(home)  # an answer between two 401s: they are not in a row
        del fake.tokens[fake.token]
        await rounds(home)
        assert lost == []
        await rounds(home, 3)
        assert len(lost) == 1, "delivered once"
        reason, removes = lost[0]
        assert removes is True and "refuses pod grants/grant-pod-1's service account token (401)" \
            in reason
        assert home.pod_over

    scenario(in_cluster, clock, volume, body)


def test_the_token_is_read_again_each_round(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock, volume: Path
) -> None:
    async def body(home: KubernetesHome, lost: Lost) -> None:
        await rounds(home)
        in_cluster.token_file.write_text("rotated-token")  # the kubelet rotated it
        fake.tokens["rotated-token"] = fake.tokens.pop(fake.token)  # the old one: refused
        await rounds(home, 3)
        assert home.health().read().state is HealthState.FRESH and lost == []
        assert [s.code for s in fake.seen].count(401) == 0, "the new token from the first round"
        in_cluster.token_file.write_text("")
        failed = await home.poll.once()
        assert isinstance(failed, ApiFailure) and failed.code is None and "is empty" in str(failed)

    scenario(in_cluster, clock, volume, body)
