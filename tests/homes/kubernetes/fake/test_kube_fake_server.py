"""lightkube's own client against the fake API server: every verb, patch type and fault mode.

The client is configured the in-cluster way (CA-verified TLS, token file),
exactly as the home configures it; nothing in lightkube is patched. The
verbs are exercised with the fake's admin token (``in_cluster`` here);
``sa_cluster`` is the grant Pod's service account, which RBAC limits to
what ``deploy/kubernetes/rbac.yaml`` allows.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest
from lightkube import ApiError, AsyncClient
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap, Pod
from lightkube.resources.resource_v1 import ResourceClaim
from lightkube.types import PatchType

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.homes.kubernetes.incluster import InClusterConfig, load_in_cluster
from slurm_fiber.testing.kubernetes.fake import PODS, FakeApiServer

Use = Callable[[AsyncClient], Awaitable[Any]]


@pytest.fixture
def sa_cluster(pod_env: dict[str, str], service_account: Path) -> InClusterConfig:
    """The grant Pod's own configuration: its service account's token."""
    return load_in_cluster(pod_env, service_account)


@pytest.fixture
def in_cluster(sa_cluster: InClusterConfig, fake: FakeApiServer, tmp_path: Path
               ) -> InClusterConfig:
    """The same server and CA, with the admin token (``system:masters``)."""
    token = tmp_path / "admin-token"
    token.write_text(fake.admin_token)
    return dataclasses.replace(sa_cluster, token_file=token)


def run(config: InClusterConfig, use: Use, timeout: float = 5.0) -> Any:
    """Run ``use`` with a fresh client on a fresh loop, closing the client after."""

    async def main() -> Any:
        client = AsyncClient(
            config.kubeconfig(), namespace=config.pod.namespace, timeout=httpx2.Timeout(timeout)
        )
        try:
            return await use(client)
        finally:
            await client.close()

    return asyncio.run(main())


def api_error(config: InClusterConfig, use: Use, **kw: float) -> ApiError:
    with pytest.raises(ApiError) as caught:
        run(config, use, **kw)
    return caught.value


def conditions(pod: Any) -> dict[str, str]:
    return {c.type: c.status for c in pod.status.conditions}


def test_get_pod_and_claim(in_cluster: InClusterConfig, claim_name: str) -> None:
    pod = run(in_cluster, lambda c: c.get(Pod, in_cluster.pod.name))
    assert pod.metadata.uid == in_cluster.pod.uid
    assert pod.spec.nodeName == "node-1"
    claim = run(in_cluster, lambda c: c.get(ResourceClaim, claim_name))
    assert [r.device for r in claim.status.allocation.devices.results] == ["gpu-3", "gpu-5"]
    status = run(in_cluster, lambda c: c.get(Pod.Status, in_cluster.pod.name))
    assert status.metadata.name == in_cluster.pod.name


@pytest.mark.parametrize(
    ("patch_type", "kept"),
    [(PatchType.STRATEGIC, True), (PatchType.MERGE, False)],
)
def test_status_patch_semantics(
    in_cluster: InClusterConfig, fake: FakeApiServer, patch_type: PatchType, kept: bool
) -> None:
    name = in_cluster.pod.name
    before = fake.store.get(PODS, in_cluster.pod.namespace, name)
    body = {"status": {"conditions": [{"type": "slurm-fiber.io/template-warm", "status": "True"}]}}
    pod = run(in_cluster, lambda c: c.patch(Pod.Status, name, body, patch_type=patch_type))
    got = conditions(pod)
    assert got["slurm-fiber.io/template-warm"] == "True"
    assert ("Ready" in got and "PodScheduled" in got) is kept
    assert int(pod.metadata.resourceVersion) > int(before["metadata"]["resourceVersion"])
    assert fake.seen[-1].content_type == patch_type.value


def test_json_patch_and_status_isolation(in_cluster: InClusterConfig, fake: FakeApiServer) -> None:
    name = in_cluster.pod.name
    ops = [{"op": "add", "path": "/metadata/labels", "value": {"a": "b"}},
           {"op": "replace", "path": "/status/phase", "value": "Failed"}]
    pod = run(in_cluster, lambda c: c.patch(Pod, name, ops, patch_type=PatchType.JSON))
    assert pod.metadata.labels == {"a": "b"}
    assert pod.status.phase == "Running", "the main resource never writes a Pod's status"
    status_ops = [{"op": "replace", "path": "/status/phase", "value": "Failed"},
                  {"op": "add", "path": "/metadata/labels/x", "value": "y"}]
    pod = run(in_cluster, lambda c: c.patch(Pod.Status, name, status_ops,
                                            patch_type=PatchType.JSON))
    assert pod.status.phase == "Failed"
    assert pod.metadata.labels == {"a": "b"}, "the status subresource writes only status"


def test_optimistic_concurrency(in_cluster: InClusterConfig, fake: FakeApiServer) -> None:
    name = in_cluster.pod.name
    current = fake.store.get(PODS, in_cluster.pod.namespace, name)["metadata"]["resourceVersion"]
    stale = {"metadata": {"resourceVersion": str(int(current) - 1)}, "status": {"phase": "X"}}
    err = api_error(in_cluster, lambda c: c.patch(Pod.Status, name, stale))
    assert err.status.code == 409 and err.status.reason == "Conflict"
    fresh = {"metadata": {"resourceVersion": current}, "status": {"phase": "X"}}
    assert run(in_cluster, lambda c: c.patch(Pod.Status, name, fresh)).status.phase == "X"
    other_uid = {"metadata": {"uid": "someone-else"}, "status": {"phase": "Y"}}
    err = api_error(in_cluster, lambda c: c.patch(Pod.Status, name, other_uid))
    assert (err.status.code, err.status.reason) == (422, "Invalid")
    assert 'metadata.uid: Invalid value: "someone-else": field is immutable' in err.status.message


def test_delete_marks_pods_and_removes_unprotected_claims(
    in_cluster: InClusterConfig, fake: FakeApiServer, clock: FakeClock, claim_name: str
) -> None:
    name = in_cluster.pod.name
    run(in_cluster, lambda c: c.delete(Pod, name))
    pod = run(in_cluster, lambda c: c.get(Pod, name))
    assert pod.metadata.deletionTimestamp is not None
    # The real server's deletionTimestamp: the delete time plus the grace period (30 s).
    assert pod.metadata.deletionTimestamp.timestamp() == int(clock.wall()) + 30
    assert pod.metadata.deletionGracePeriodSeconds == 30
    fake.store.remove(PODS, in_cluster.pod.namespace, name)
    assert api_error(in_cluster, lambda c: c.get(Pod, name)).status.code == 404
    # An allocated claim carries the delete-protection finalizer: marked, not removed.
    run(in_cluster, lambda c: c.delete(ResourceClaim, claim_name))
    assert run(in_cluster, lambda c: c.get(ResourceClaim, claim_name)).metadata.deletionTimestamp


def test_unknown_paths_and_methods_answer_status_objects(in_cluster: InClusterConfig) -> None:
    err = api_error(in_cluster, lambda c: c.get(ConfigMap, "x"))
    assert (err.status.code, err.status.reason) == (404, "NotFound")
    err = api_error(in_cluster, lambda c: c.create(Pod(metadata=ObjectMeta(name="new"))))
    assert err.status.code == 405


def test_patch_refusals(in_cluster: InClusterConfig) -> None:
    name = in_cluster.pod.name
    bad = [{"op": "test", "path": "/status/phase", "value": "Nope"}]
    err = api_error(in_cluster, lambda c: c.patch(Pod, name, bad, patch_type=PatchType.JSON))
    assert err.status.code == 400
    err = api_error(in_cluster, lambda c: c.patch(Pod, name, {"a": 1}, patch_type=PatchType.APPLY,
                                                  field_manager="t"))
    assert err.status.code == 415


def test_bearer_token_is_checked_and_rotation_is_followed(
    sa_cluster: InClusterConfig, fake: FakeApiServer, service_account: Path
) -> None:
    fake.tokens["rotated-token"] = fake.tokens.pop(fake.token)
    err = api_error(sa_cluster, lambda c: c.get(Pod, sa_cluster.pod.name))
    assert (err.status.code, err.status.reason) == (401, "Unauthorized")
    # kubelet rotates the projected token; the client re-reads the file on 401.
    (service_account / "token").write_text("rotated-token")
    assert run(sa_cluster, lambda c: c.get(Pod, sa_cluster.pod.name)).metadata.name


@pytest.mark.parametrize("code", [404, 409, 410, 500])
def test_injected_faults_surface_as_api_errors(
    in_cluster: InClusterConfig, fake: FakeApiServer, code: int
) -> None:
    fake.inject(code, method="GET", resource="pods")
    err = api_error(in_cluster, lambda c: c.get(Pod, in_cluster.pod.name))
    assert err.status.code == code
    assert err.status.reason == {404: "NotFound", 409: "Conflict", 410: "Expired",
                                 500: "InternalError"}[code]
    assert run(in_cluster, lambda c: c.get(Pod, in_cluster.pod.name)), "one-shot fault"


def test_fault_filters_and_persistence(
    in_cluster: InClusterConfig, fake: FakeApiServer, claim_name: str
) -> None:
    fake.inject(500, times=None, resource="resourceclaims")
    assert run(in_cluster, lambda c: c.get(Pod, in_cluster.pod.name))
    for _ in range(2):
        assert api_error(in_cluster, lambda c: c.get(ResourceClaim, claim_name)).status.code == 500
    fake.clear_faults()
    assert run(in_cluster, lambda c: c.get(ResourceClaim, claim_name))


def test_slow_server_times_the_client_out(in_cluster: InClusterConfig, fake: FakeApiServer) -> None:
    fake.set_delay(30)
    with pytest.raises(httpx2.ReadTimeout):
        run(in_cluster, lambda c: c.get(Pod, in_cluster.pod.name), timeout=0.2)
    fake.set_delay(0)
    assert run(in_cluster, lambda c: c.get(Pod, in_cluster.pod.name))


def test_dead_server_refuses_then_comes_back_on_the_same_port(
    in_cluster: InClusterConfig, fake: FakeApiServer
) -> None:
    port = fake.port

    async def across_death(client: AsyncClient) -> str:
        await client.get(Pod, in_cluster.pod.name)  # a kept-alive connection exists now
        fake.stop()
        with pytest.raises(httpx2.TransportError):
            await client.get(Pod, in_cluster.pod.name)
        fake.start()
        return (await client.get(Pod, in_cluster.pod.name)).metadata.name

    assert run(in_cluster, across_death) == in_cluster.pod.name
    assert fake.port == port


def test_stop_cuts_a_held_answer_short(in_cluster: InClusterConfig, fake: FakeApiServer) -> None:
    fake.set_delay(60)

    async def stop_soon(client: AsyncClient) -> None:
        asyncio.get_running_loop().call_later(0.1, fake.stop)
        await client.get(Pod, in_cluster.pod.name)

    with pytest.raises(httpx2.TransportError):
        run(in_cluster, stop_soon, timeout=30)
