"""Builders for the objects a control plane would have created around a grant Pod.

Tests and the conform harness seed the fake with these: a running grant Pod
(node, service account, readiness gate, DRA claims already resolved to
ResourceClaim names in its status, as the scheduler and kubelet leave them)
and a ResourceClaim allocated by a DRA driver (``resource.k8s.io/v1``).
They return plain dicts in the API's JSON shape; pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_GATE = "slurm-fiber.io/template-warm"


@dataclass(frozen=True)
class Allocated:
    """One device a DRA driver allocated: request name, driver, pool, device, optional uuid."""

    request: str
    driver: str
    pool: str
    device: str
    uuid: str | None = None


def grant_pod(
    name: str,
    namespace: str,
    *,
    uid: str | None = None,
    node: str = "node-1",
    service_account: str = "slurm-fiber",
    claims: Mapping[str, str] | None = None,
    gate: str = DEFAULT_GATE,
) -> dict[str, Any]:
    """A scheduled, running grant Pod; ``claims`` maps its claim names to ResourceClaim names."""
    claims = dict(claims or {})
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if uid is not None:
        meta["uid"] = uid
    return {
        "metadata": meta,
        "spec": {
            "nodeName": node,
            "serviceAccountName": service_account,
            "containers": [{"name": "fiberd", "image": "slurm-fiber:latest"}],
            "readinessGates": [{"conditionType": gate}],
            "resourceClaims": [
                {"name": pod_claim, "resourceClaimTemplateName": "grant-devices"}
                for pod_claim in claims
            ],
        },
        "status": {
            "phase": "Running",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": "True"},
                {"type": "Ready", "status": "False", "reason": "ReadinessGatesNotReady"},
            ],
            "resourceClaimStatuses": [
                {"name": pod_claim, "resourceClaimName": claim}
                for pod_claim, claim in claims.items()
            ],
        },
    }


def resource_claim(
    name: str,
    namespace: str,
    devices: Sequence[Allocated] = (),
    *,
    uid: str | None = None,
    device_class: str = "gpu.example.com",
) -> dict[str, Any]:
    """A ResourceClaim; allocated (with those devices) when ``devices`` is not empty."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if uid is not None:
        meta["uid"] = uid
    status: dict[str, Any] = {}
    if devices:
        meta["finalizers"] = ["resource.kubernetes.io/delete-protection"]
        status["allocation"] = {
            "devices": {
                "results": [
                    {"request": d.request, "driver": d.driver, "pool": d.pool, "device": d.device}
                    for d in devices
                ]
            }
        }
        status["devices"] = [
            {"driver": d.driver, "pool": d.pool, "device": d.device, "data": {"uuid": d.uuid}}
            for d in devices
            if d.uuid
        ]
    return {
        "metadata": meta,
        "spec": {"devices": {"requests": [
            {"name": request, "exactly": {"deviceClassName": device_class}}
            for request in sorted({d.request for d in devices})
        ]}},
        "status": status,
    }
