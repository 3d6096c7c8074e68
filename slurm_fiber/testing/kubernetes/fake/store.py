"""The fake API server's memory: objects by kind, namespace and name, as the real server keeps them.

Every write bumps one cluster-wide ``resourceVersion`` (like etcd's
revision) and stamps it on the written object; a write that carries a
``resourceVersion`` other than the object's current one is refused with 409
Conflict (optimistic concurrency); one that changes the UID (a patch made
for another Pod of the same name) with 422 Invalid (``metadata.uid`` is
immutable), as the real server does. Patching a ``status`` subresource
changes only ``status``; patching the main resource never changes a Pod's
``status``. A Pod condition new to the Pod goes first, and every Pod
condition carries ``lastProbeTime`` and ``lastTransitionTime`` (null when
unset), as the real server writes them. Deleting a Pod, or any object with
finalizers, only sets ``deletionTimestamp`` (graceful deletion: the delete
time plus the grace period, 30 s for a Pod, 0 otherwise, with
``deletionGracePeriodSeconds``); the object disappears when ``remove``
finalizes it. Every failure is an
``ApiStatus`` carrying the code and reason the real server would send.
The store is thread-safe: the server's request threads and a test's own
thread use it at once. Reads return copies, so nothing outside changes it.
"""

from __future__ import annotations

import copy
import itertools
import json
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slurm_fiber.core.clock import Clock
from slurm_fiber.homes.kubernetes.views import rfc3339
from slurm_fiber.testing.kubernetes.fake.patch import (
    PatchError,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
PATCHERS: dict[str, Callable[[Any, Any], Any]] = {
    MERGE_PATCH: merge_patch,
    STRATEGIC_MERGE_PATCH: strategic_merge_patch,
    JSON_PATCH: json_patch,
}


@dataclass(frozen=True)
class Kind:
    """One resource type the fake serves: where it lives in the API and what it is called."""

    plural: str
    prefix: str  # "/api/v1" or "/apis/<group>/<version>"
    api_version: str
    kind: str
    graceful: bool  # deletion always goes through deletionTimestamp (Pods)

    @property
    def grace_seconds(self) -> int:
        """The default deletion grace period: a Pod's terminationGracePeriodSeconds, else 0."""
        return POD_GRACE_SECONDS if self.graceful else 0


POD_GRACE_SECONDS = 30


PODS = Kind("pods", "/api/v1", "v1", "Pod", graceful=True)
RESOURCE_CLAIMS = Kind(
    "resourceclaims", "/apis/resource.k8s.io/v1", "resource.k8s.io/v1", "ResourceClaim",
    graceful=False,
)
KINDS: tuple[Kind, ...] = (PODS, RESOURCE_CLAIMS)

REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    500: "InternalError",
}


class ApiStatus(Exception):
    """A refusal shaped like the real server's ``Status`` object."""

    def __init__(self, code: int, message: str, *, name: str = "", kind: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.name = name
        self.kind = kind

    def body(self) -> dict[str, Any]:
        """The ``Status`` document the server sends for this refusal."""
        out: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": REASONS.get(self.code, "Unknown"),
            "code": self.code,
        }
        if self.name or self.kind:
            out["details"] = {"name": self.name, "kind": self.kind}
        return out


class Store:
    """In-memory objects with the real server's write rules. Thread-safe; never blocks long."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._versions = itertools.count(1000)

    # -- the control plane's side (tests, the conform harness) --------------

    def put(self, kind: Kind, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace an object as a controller would; returns the stored copy.

        Fills in apiVersion, kind, a UID (when missing), creationTimestamp and a
        new resourceVersion. Raises ApiStatus(422) without a name and namespace.
        """
        doc = copy.deepcopy(obj)
        meta = doc.setdefault("metadata", {})
        name, namespace = meta.get("name"), meta.get("namespace")
        if not isinstance(name, str) or not name or not isinstance(namespace, str):
            raise ApiStatus(422, f"{kind.kind} needs metadata.name and metadata.namespace")
        doc["apiVersion"], doc["kind"] = kind.api_version, kind.kind
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", rfc3339(self._clock.wall()))
        with self._lock:
            return self._store(kind, doc)

    def remove(self, kind: Kind, namespace: str, name: str) -> None:
        """Finalize a deletion: the object is gone (later reads answer 404). Idempotent."""
        with self._lock:
            self._objects.pop((kind.plural, namespace, name), None)

    # -- the API's side (request threads) ------------------------------------

    def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any]:
        """A copy of the object; ApiStatus(404) when there is none."""
        with self._lock:
            return copy.deepcopy(self._current(kind, namespace, name))

    def patch(
        self,
        kind: Kind,
        namespace: str,
        name: str,
        content_type: str,
        body: bytes,
        *,
        status_only: bool,
    ) -> dict[str, Any]:
        """Apply a patch of ``content_type``; returns the written object.

        Raises ApiStatus: 404 no object, 415 unknown patch type, 400 a malformed
        or failing patch, 409 a stale resourceVersion, 422 a changed UID.
        """
        patcher = PATCHERS.get(content_type.split(";")[0].strip())
        if patcher is None:
            raise ApiStatus(415, f"the patch type {content_type!r} is not supported here")
        try:
            document = json.loads(body or b"null")
        except ValueError as err:
            raise ApiStatus(400, f"the patch is not JSON: {err}") from err
        with self._lock:
            current = self._current(kind, namespace, name)
            try:
                patched = patcher(current, document)
            except PatchError as err:
                raise ApiStatus(400, f"the patch cannot be applied: {err}", name=name) from err
            if not isinstance(patched, dict):
                raise ApiStatus(400, "the patch does not leave an object", name=name)
            self._check_preconditions(kind, current, patched)
            return self._store(kind, self._keep_other_half(kind, current, patched, status_only))

    def delete(self, kind: Kind, namespace: str, name: str) -> dict[str, Any]:
        """Delete as the real server does (mark if graceful or finalizers, else remove); returns it.

        Raises ApiStatus(404) when there is no object.
        """
        with self._lock:
            current = copy.deepcopy(self._current(kind, namespace, name))
            meta = current["metadata"]
            if not (kind.graceful or meta.get("finalizers")):
                del self._objects[(kind.plural, namespace, name)]
                return current
            if "deletionTimestamp" in meta:
                return current
            grace = kind.grace_seconds
            if kind.graceful:
                grace = int(current.get("spec", {}).get("terminationGracePeriodSeconds", grace))
            meta["deletionTimestamp"] = rfc3339(self._clock.wall() + grace)
            meta["deletionGracePeriodSeconds"] = grace
            return self._store(kind, current)

    # -- inside the lock -----------------------------------------------------

    def _current(self, kind: Kind, namespace: str, name: str) -> dict[str, Any]:
        try:
            return self._objects[(kind.plural, namespace, name)]
        except KeyError:
            raise ApiStatus(
                404, f'{kind.plural} "{name}" not found', name=name, kind=kind.plural
            ) from None

    def _store(self, kind: Kind, doc: dict[str, Any]) -> dict[str, Any]:
        meta = doc["metadata"]
        meta["resourceVersion"] = str(next(self._versions))
        self._objects[(kind.plural, meta["namespace"], meta["name"])] = doc
        return copy.deepcopy(doc)

    @staticmethod
    def _check_preconditions(kind: Kind, current: dict[str, Any], patched: dict[str, Any]) -> None:
        old, new = current["metadata"], patched.get("metadata")
        name = old["name"]
        if not isinstance(new, dict) or new.get("name") != name:
            raise ApiStatus(400, "a patch cannot change metadata.name", name=name)
        if new.get("uid") != old["uid"]:
            raise ApiStatus(
                422,
                f'{kind.kind} "{name}" is invalid: metadata.uid: Invalid value: '
                f'"{new.get("uid")}": field is immutable',
                name=name,
                kind=kind.kind,
            )
        if new.get("resourceVersion") != old["resourceVersion"]:
            raise ApiStatus(
                409,
                f'Operation cannot be fulfilled on {kind.plural} "{name}": the object has '
                "been modified; please apply your changes to the latest version and try again",
                name=name,
                kind=kind.plural,
            )

    @staticmethod
    def _keep_other_half(
        kind: Kind, current: dict[str, Any], patched: dict[str, Any], status_only: bool
    ) -> dict[str, Any]:
        if status_only:
            out = copy.deepcopy(current)
            out["status"] = patched.get("status", {})
            if kind is PODS:
                _order_conditions(current.get("status", {}), out["status"])
            return out
        if kind is PODS:
            patched["status"] = copy.deepcopy(current.get("status", {}))
        return patched


def _order_conditions(before: Any, after: Any) -> None:
    """Put Pod conditions new to the Pod first and give each the real server's time fields."""
    if not isinstance(after, dict) or not isinstance(after.get("conditions"), list):
        return
    old = before.get("conditions") if isinstance(before, dict) else None
    known = {c.get("type") for c in old or [] if isinstance(c, dict)}
    conditions = [c for c in after["conditions"] if isinstance(c, dict)]
    fresh = [c for c in conditions if c.get("type") not in known]
    after["conditions"] = fresh + [c for c in conditions if c.get("type") in known]
    for condition in after["conditions"]:
        condition.setdefault("lastProbeTime", None)
        condition.setdefault("lastTransitionTime", None)
