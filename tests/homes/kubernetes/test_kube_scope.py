"""Scope claims from a Pod, and scope loss found in rounds read from the fake API server."""

from __future__ import annotations

import asyncio

import pytest

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.trust.grant import ScopeClaim
from slurm_fiber.homes.kubernetes.api import ApiFailure, KubeApi
from slurm_fiber.homes.kubernetes.incluster import InClusterConfig, PodIdentity
from slurm_fiber.homes.kubernetes.reading import Reading, read_scope
from slurm_fiber.homes.kubernetes.scope import LossKind, ScopeLoss, ScopeTracker, scope_claims
from slurm_fiber.homes.kubernetes.views import pod_view
from slurm_fiber.testing.kubernetes.fake import (
    PODS,
    RESOURCE_CLAIMS,
    Allocated,
    FakeApiServer,
    grant_pod,
    resource_claim,
)


class Rounds:
    """Runs rounds against the fake on one loop with one client, as the home would."""

    def __init__(self, config: InClusterConfig, clock: FakeClock) -> None:
        self.loop = asyncio.new_event_loop()
        self.api = KubeApi(config, clock=clock)
        self.tracker = ScopeTracker(config.pod)

    def read(self) -> Reading:
        return self.loop.run_until_complete(read_scope(self.api, self.tracker))

    def next(self) -> list[ScopeLoss]:
        return self.read().losses

    def close(self) -> None:
        self.loop.run_until_complete(self.api.aclose())
        self.loop.close()


@pytest.fixture
def rounds(in_cluster: InClusterConfig, clock: FakeClock):
    r = Rounds(in_cluster, clock)
    yield r
    r.close()


def test_scope_claims_of_the_grant_pod(fake: FakeApiServer, claim_name: str) -> None:
    pod = pod_view(fake.store.get(PODS, "grants", "grant-pod-1"))
    assert scope_claims(pod) == [
        ScopeClaim("kubernetes.namespace", "grants"),
        ScopeClaim("kubernetes.service_account", "slurm-fiber"),
        ScopeClaim("kubernetes.pod", "grant-pod-1"),
        ScopeClaim("kubernetes.pod_uid", pod.uid),
        ScopeClaim("kubernetes.node", "node-1"),
        ScopeClaim("kubernetes.resource_claim", claim_name),
    ]


def test_direct_claim_references_and_missing_fields() -> None:
    doc = grant_pod("p", "ns", uid="u", node="")
    doc["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimName": "shared-gpus"},
                                     {"name": "pending"}]
    del doc["spec"]["serviceAccountName"]
    pod = pod_view(doc)
    assert pod.claims == ("shared-gpus",), "a claim not yet generated is not named"
    assert [c.key for c in scope_claims(pod)] == [
        "kubernetes.namespace", "kubernetes.pod", "kubernetes.pod_uid",
        "kubernetes.resource_claim"]


def test_a_healthy_pod_loses_nothing(rounds: Rounds) -> None:
    assert rounds.next() == []
    assert rounds.next() == []


def test_deletion_timestamp_is_a_pod_loss_reported_the_same_each_round(
    rounds: Rounds, fake: FakeApiServer
) -> None:
    rounds.next()
    fake.store.delete(PODS, "grants", "grant-pod-1")
    first, again = rounds.next(), rounds.next()
    assert first == again and [loss.kind for loss in first] == [LossKind.POD_DELETING]
    assert first[0].removes_grants
    assert first[0].reason.startswith("pod grants/grant-pod-1 is being deleted")
    fake.store.remove(PODS, "grants", "grant-pod-1")
    assert [loss.kind for loss in rounds.next()] == [LossKind.POD_GONE]


def test_uid_change_is_a_pod_loss(rounds: Rounds, fake: FakeApiServer, claim_name: str) -> None:
    rounds.next()
    fake.store.put(PODS, grant_pod("grant-pod-1", "grants", uid="new-uid",
                                   claims={"gpus": "someone-elses-claim"}))
    losses = rounds.next()
    assert [loss.kind for loss in losses] == [LossKind.POD_REPLACED]
    assert "new-uid" in losses[0].reason
    assert rounds.tracker.claims_to_read(None) == (claim_name,), "the other Pod's claims ignored"


def test_claim_deallocated_is_an_epoch_loss(
    rounds: Rounds, fake: FakeApiServer, claim_name: str
) -> None:
    rounds.next()
    claim = fake.store.get(RESOURCE_CLAIMS, "grants", claim_name)
    del claim["status"]["allocation"]
    fake.store.put(RESOURCE_CLAIMS, claim)
    losses = rounds.next()
    assert [loss.kind for loss in losses] == [LossKind.CLAIM_DEALLOCATED]
    assert not losses[0].removes_grants
    assert losses[0].reason == f"resourceclaim grants/{claim_name} was deallocated"


def test_claim_deleted_then_recreated(
    rounds: Rounds, fake: FakeApiServer, claim_name: str
) -> None:
    rounds.next()
    fake.store.delete(RESOURCE_CLAIMS, "grants", claim_name)
    assert [loss.kind for loss in rounds.next()] == [LossKind.CLAIM_DELETING]
    fake.store.remove(RESOURCE_CLAIMS, "grants", claim_name)
    assert [loss.kind for loss in rounds.next()] == [LossKind.CLAIM_GONE]
    fake.store.put(RESOURCE_CLAIMS, resource_claim(
        claim_name, "grants", [Allocated("gpus", "gpu.nvidia.com", "node-1", "gpu-0")]))
    assert [loss.kind for loss in rounds.next()] == [LossKind.CLAIM_REPLACED]


def test_pod_gone_before_first_sight_still_judges_nothing_else() -> None:
    tracker = ScopeTracker(PodIdentity("p", "ns", "u"))
    assert tracker.claims_to_read(None) == ()
    assert [loss.kind for loss in tracker.observe(None, {})] == [LossKind.POD_GONE]


def test_a_reading_carries_scope_and_devices(rounds: Rounds, fake: FakeApiServer,
                                             claim_name: str) -> None:
    reading = rounds.read()
    assert ScopeClaim("kubernetes.resource_claim", claim_name) in reading.scope
    assert [(d.kind, d.index, d.uuid) for d in reading.devices.devices] == [
        ("gpu", 0, "GPU-aaaa"), ("gpu", 1, "GPU-bbbb")]
    fake.store.remove(RESOURCE_CLAIMS, "grants", claim_name)
    fake.store.remove(PODS, "grants", "grant-pod-1")
    gone = rounds.read()
    assert gone.scope == [] and gone.devices.devices == ()


def test_a_failed_round_judges_nothing(rounds: Rounds, fake: FakeApiServer,
                                       claim_name: str) -> None:
    rounds.next()
    fake.store.delete(PODS, "grants", "grant-pod-1")
    fake.inject(500, resource="resourceclaims")
    with pytest.raises(ApiFailure):
        rounds.read()
    assert [loss.kind for loss in rounds.next()] == [LossKind.POD_DELETING]
