"""The Kubernetes home's slice of the API, served from memory for tests that need no API server.

``FakeApiServer`` listens on 127.0.0.1 (TLS by default) and keeps Pods and
ResourceClaims in a ``Store`` with the real server's patch, concurrency and
deletion rules; ``grant_pod`` and ``resource_claim`` build the objects a
control plane would have created. Start it, point an in-cluster
configuration at it (``write_service_account`` and ``in_cluster_env``), and
the home's real client code runs against it unchanged. ``write_secret``
updates a Secret volume on disk the way the kubelet does (the ``..data`` swap).
"""

from slurm_fiber.testing.kubernetes.fake.objects import (
    DEFAULT_GATE,
    Allocated,
    grant_pod,
    resource_claim,
)
from slurm_fiber.testing.kubernetes.fake.secretvolume import atomic_write, write_secret
from slurm_fiber.testing.kubernetes.fake.server import FakeApiServer, Seen
from slurm_fiber.testing.kubernetes.fake.store import PODS, RESOURCE_CLAIMS, ApiStatus, Store

__all__ = [
    "DEFAULT_GATE",
    "PODS",
    "RESOURCE_CLAIMS",
    "Allocated",
    "ApiStatus",
    "FakeApiServer",
    "Seen",
    "Store",
    "atomic_write",
    "grant_pod",
    "resource_claim",
    "write_secret",
]
