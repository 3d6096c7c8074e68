"""KubeApi, the home's calls, against the fake API server over TLS with in-cluster config."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.homes.kubernetes.api import ApiFailure, KubeApi
from slurm_fiber.homes.kubernetes.incluster import InClusterConfig
from slurm_fiber.homes.kubernetes.views import rfc3339
from slurm_fiber.testing.kubernetes.fake import (
    DEFAULT_GATE,
    PODS,
    RESOURCE_CLAIMS,
    FakeApiServer,
    grant_pod,
)


def run(config: InClusterConfig, clock: FakeClock, use: Callable[[KubeApi], Awaitable[Any]],
        timeout: float = 5.0) -> Any:
    async def main() -> Any:
        api = KubeApi(config, clock=clock, timeout=timeout)
        try:
            return await use(api)
        finally:
            await api.aclose()

    return asyncio.run(main())


def failure(config: InClusterConfig, clock: FakeClock,
            use: Callable[[KubeApi], Awaitable[Any]], **kw: float) -> ApiFailure:
    with pytest.raises(ApiFailure) as caught:
        run(config, clock, use, **kw)
    assert "\n" not in str(caught.value)
    return caught.value


def test_reads_its_pod_and_claim(
    in_cluster: InClusterConfig, clock: FakeClock, claim_name: str
) -> None:
    pod = run(in_cluster, clock, lambda api: api.read_pod())
    assert (pod.name, pod.uid, pod.node, pod.claims) == (
        "grant-pod-1", in_cluster.pod.uid, "node-1", (claim_name,))
    claim = run(in_cluster, clock, lambda api: api.read_claim(claim_name))
    assert claim.allocated and [d.device for d in claim.devices] == ["gpu-3", "gpu-5"]
    assert [d.uuid for d in claim.devices] == ["GPU-aaaa", "GPU-bbbb"]


def test_absent_objects_read_as_none(in_cluster: InClusterConfig, fake: FakeApiServer,
                                     clock: FakeClock) -> None:
    assert run(in_cluster, clock, lambda api: api.read_claim("no-such-claim")) is None
    fake.store.remove(PODS, "grants", "grant-pod-1")
    assert run(in_cluster, clock, lambda api: api.read_pod()) is None


def test_condition_patch_keeps_other_conditions_and_flips(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock
) -> None:
    def flip(status: bool) -> Callable[[KubeApi], Awaitable[Any]]:
        return lambda api: api.set_condition(DEFAULT_GATE, status, reason="Warm",
                                             message="a template is warm")

    pod = run(in_cluster, clock, flip(True))
    assert pod.conditions == {"PodScheduled": "True", "Initialized": "True",
                              "ContainersReady": "True", "Ready": "False", DEFAULT_GATE: "True"}
    clock.advance(7)
    pod = run(in_cluster, clock, flip(False))
    assert pod.conditions[DEFAULT_GATE] == "False" and len(pod.conditions) == 5
    stored = fake.store.get(PODS, "grants", "grant-pod-1")["status"]["conditions"]
    gate = next(c for c in stored if c["type"] == DEFAULT_GATE)
    assert gate["lastTransitionTime"] == rfc3339(clock.wall())
    assert [s.method for s in fake.seen].count("PATCH") == 2
    assert all(s.path.endswith("/status") for s in fake.seen if s.method == "PATCH")


def test_condition_never_lands_on_a_replacement_pod(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock
) -> None:
    fake.store.put(PODS, grant_pod("grant-pod-1", "grants", uid="a-new-pod"))
    err = failure(in_cluster, clock,
                  lambda api: api.set_condition(DEFAULT_GATE, True, reason="r", message="m"))
    assert err.code == 422 and "field is immutable" in str(err)
    stored = fake.store.get(PODS, "grants", "grant-pod-1")["status"]["conditions"]
    assert DEFAULT_GATE not in {c["type"] for c in stored}


@pytest.mark.parametrize("code", [409, 410, 500])
def test_faults_raise_stable_one_line_failures(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock, code: int
) -> None:
    messages = set()
    for _ in range(2):
        fake.inject(code)
        messages.add(str(failure(in_cluster, clock, lambda api: api.read_pod())))
    assert len(messages) == 1
    assert f"read pod grants/grant-pod-1: {code} " in messages.pop()


def test_injected_404_reads_as_gone(in_cluster: InClusterConfig, fake: FakeApiServer,
                                    clock: FakeClock) -> None:
    fake.inject(404, resource="resourceclaims")
    assert run(in_cluster, clock, lambda api: api.read_claim("anything")) is None


def test_dead_and_slow_servers_are_failures_without_a_code(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock
) -> None:
    fake.set_delay(30)
    slow = failure(in_cluster, clock, lambda api: api.read_pod(), timeout=0.2)
    assert slow.code is None and "ReadTimeout" in str(slow)
    fake.stop()
    dead = failure(in_cluster, clock, lambda api: api.read_pod())
    assert dead.code is None and "ConnectError" in str(dead)


def test_a_malformed_answer_is_a_failure(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock, claim_name: str
) -> None:
    doc = fake.store.get(RESOURCE_CLAIMS, "grants", claim_name)
    doc["metadata"]["uid"] = ""
    fake.store.put(RESOURCE_CLAIMS, doc)
    err = failure(in_cluster, clock, lambda api: api.read_claim(claim_name))
    assert err.code is None and "without metadata.name" in str(err)


def test_cancellation_abandons_a_call(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock
) -> None:
    fake.set_delay(30)

    async def bounded(api: KubeApi) -> None:
        async with asyncio.timeout(0.2):
            await api.read_pod()

    with pytest.raises(TimeoutError):
        run(in_cluster, clock, bounded)
