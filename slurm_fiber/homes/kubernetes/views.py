"""The API's Pod and ResourceClaim JSON, reduced to the fields the home decides on.

``pod_view`` and ``claim_view`` are pure parsers of the API's JSON shape
(what the real server and the fake both send). They accept any document:
fields the home does not need may be missing or odd; a document without a
name, namespace or UID raises ``ViewError`` with a one-line reason, since
no decision can be made about an object that cannot be identified.
``rfc3339`` writes times the way the API does.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any


class ViewError(ValueError):
    """An API document the home cannot identify (no name, namespace or UID)."""


@dataclass(frozen=True)
class PodView:
    """One reading of a Pod: identity, placement, deletion, claims and status conditions.

    ``claims`` holds the ResourceClaim object names the Pod uses, in the Pod's
    order: named directly in its spec, or generated from a template and
    recorded in its status. ``conditions`` maps condition type to status
    ("True", "False", "Unknown").
    """

    name: str
    namespace: str
    uid: str
    resource_version: str
    node: str | None
    service_account: str | None
    deletion_timestamp: str | None
    claims: tuple[str, ...]
    conditions: dict[str, str]


@dataclass(frozen=True)
class AllocatedDevice:
    """One device in a claim's allocation: request, driver, pool, device name; uuid if reported."""

    request: str
    driver: str
    pool: str
    device: str
    uuid: str | None = None


@dataclass(frozen=True)
class ClaimView:
    """One reading of a ResourceClaim: identity, deletion and allocation (empty: not allocated)."""

    name: str
    namespace: str
    uid: str
    deletion_timestamp: str | None
    allocated: bool
    devices: tuple[AllocatedDevice, ...]


def rfc3339(unix_seconds: float) -> str:
    """A Unix time as the API writes timestamps (RFC 3339, UTC, whole seconds)."""
    moment = datetime.datetime.fromtimestamp(int(unix_seconds), tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[dict[str, Any]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _identity(doc: Any, what: str) -> tuple[dict[str, Any], str, str, str]:
    meta = _dict(_dict(doc).get("metadata"))
    name, namespace, uid = (_str(meta.get(key)) for key in ("name", "namespace", "uid"))
    if name is None or namespace is None or uid is None:
        raise ViewError(f"the API sent a {what} without metadata.name, namespace or uid")
    return meta, name, namespace, uid


def pod_view(doc: Any) -> PodView:
    """Parse a Pod document; ViewError when it cannot be identified."""
    meta, name, namespace, uid = _identity(doc, "Pod")
    spec, status = _dict(doc.get("spec")), _dict(doc.get("status"))
    claims: list[str] = []
    generated = {
        s.get("name"): _str(s.get("resourceClaimName"))
        for s in _list(status.get("resourceClaimStatuses"))
    }
    for ref in _list(spec.get("resourceClaims")):
        claim = _str(ref.get("resourceClaimName")) or generated.get(ref.get("name"))
        if claim is not None and claim not in claims:
            claims.append(claim)
    conditions = {
        c["type"]: str(c.get("status", "Unknown"))
        for c in _list(status.get("conditions"))
        if _str(c.get("type"))
    }
    return PodView(
        name=name,
        namespace=namespace,
        uid=uid,
        resource_version=str(meta.get("resourceVersion", "")),
        node=_str(spec.get("nodeName")),
        service_account=_str(spec.get("serviceAccountName")),
        deletion_timestamp=_str(meta.get("deletionTimestamp")),
        claims=tuple(claims),
        conditions=conditions,
    )


def claim_view(doc: Any) -> ClaimView:
    """Parse a ``resource.k8s.io/v1`` ResourceClaim document; ViewError when unidentifiable."""
    meta, name, namespace, uid = _identity(doc, "ResourceClaim")
    status = _dict(doc.get("status"))
    allocation = status.get("allocation")
    uuids = {
        (d.get("driver"), d.get("pool"), d.get("device")): _str(_dict(d.get("data")).get("uuid"))
        for d in _list(status.get("devices"))
    }
    devices = tuple(
        AllocatedDevice(
            request=str(r.get("request", "")),
            driver=str(r["driver"]),
            pool=str(r.get("pool", "")),
            device=str(r["device"]),
            uuid=uuids.get((r.get("driver"), r.get("pool"), r.get("device"))),
        )
        for r in _list(_dict(_dict(allocation).get("devices")).get("results"))
        if _str(r.get("driver")) and _str(r.get("device"))
    )
    return ClaimView(
        name=name,
        namespace=namespace,
        uid=uid,
        deletion_timestamp=_str(meta.get("deletionTimestamp")),
        allocated=isinstance(allocation, dict),
        devices=devices,
    )
