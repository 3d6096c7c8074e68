"""Fixtures for the Kubernetes home's tests: a running fake API server and a Pod's view of it.

``fake`` is a FakeApiServer (TLS, its own CA) holding the grant Pod
``grants/grant-pod-1`` with one allocated ResourceClaim; ``in_cluster`` is
the configuration ``load_in_cluster`` reads from a service account
directory and environment laid out as the kubelet would, pointing at it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.homes.kubernetes.incluster import InClusterConfig, load_in_cluster
from slurm_fiber.testing.kubernetes.fake import (
    PODS,
    RESOURCE_CLAIMS,
    Allocated,
    FakeApiServer,
    grant_pod,
    resource_claim,
)

NAMESPACE = "grants"
POD = "grant-pod-1"
POD_UID = "0f3c9a4e-pod-uid-1"
CLAIM = "grant-pod-1-gpus-x7k2p"
GPUS = (
    Allocated("gpus", "gpu.nvidia.com", "node-1", "gpu-3", uuid="GPU-aaaa"),
    Allocated("gpus", "gpu.nvidia.com", "node-1", "gpu-5", uuid="GPU-bbbb"),
)


@pytest.fixture
def fake(clock: FakeClock) -> Iterator[FakeApiServer]:
    with FakeApiServer(clock=clock) as server:
        server.store.put(PODS, grant_pod(POD, NAMESPACE, uid=POD_UID, claims={"gpus": CLAIM}))
        server.store.put(RESOURCE_CLAIMS, resource_claim(CLAIM, NAMESPACE, GPUS))
        yield server


@pytest.fixture
def claim_name() -> str:
    """The name of the grant Pod's allocated ResourceClaim (two GPUs, uuids known)."""
    return CLAIM


@pytest.fixture
def pod_env(fake: FakeApiServer) -> dict[str, str]:
    """The container environment the kubelet and the downward API give the grant Pod."""
    return {
        **fake.in_cluster_env(),
        "SLURM_FIBER_POD_NAME": POD,
        "SLURM_FIBER_POD_NAMESPACE": NAMESPACE,
        "SLURM_FIBER_POD_UID": POD_UID,
        "SLURM_FIBER_NODE_NAME": "node-1",
        "SLURM_FIBER_SERVICE_ACCOUNT": "slurm-fiber",
    }


@pytest.fixture
def service_account(fake: FakeApiServer, tmp_path: Path) -> Path:
    return fake.write_service_account(tmp_path / "serviceaccount", NAMESPACE)


@pytest.fixture
def in_cluster(pod_env: dict[str, str], service_account: Path) -> InClusterConfig:
    return load_in_cluster(pod_env, service_account)
