"""The fake API server's authentication and RBAC: who a bearer token is, and what it may do.

``Principal`` is an authenticated user (name and groups, as the real server
derives them: a service account is ``system:serviceaccount:<ns>:<name>`` in
``system:serviceaccounts``, ``system:serviceaccounts:<ns>`` and
``system:authenticated``). ``Rbac`` decides requests from Role, RoleBinding,
ClusterRole and ClusterRoleBinding objects, the documents of a manifest such
as ``deploy/kubernetes/rbac.yaml`` (other kinds are ignored), with the real
authorizer's rules: allow-only, ``system:masters`` may do anything, a rule
matches on API group, resource (``pods/status`` for a subresource), verb and
optional resource names, ``*`` matching all. ``forbidden`` builds the 403
``Status`` message the real server sends. Pure: no I/O but ``load_manifest``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# deploy/kubernetes/rbac.yaml of this checkout: the Role the grant Pod's service account has.
RBAC_MANIFEST = Path(__file__).resolve().parents[4] / "deploy" / "kubernetes" / "rbac.yaml"
MASTERS = "system:masters"


@dataclass(frozen=True)
class Principal:
    """An authenticated user: its name and groups."""

    user: str
    groups: tuple[str, ...]

    @classmethod
    def service_account(cls, namespace: str, name: str) -> Principal:
        """The principal a service account token authenticates as."""
        return cls(f"system:serviceaccount:{namespace}:{name}",
                   ("system:serviceaccounts", f"system:serviceaccounts:{namespace}",
                    "system:authenticated"))


ADMIN = Principal("fake-admin", (MASTERS, "system:authenticated"))


@dataclass(frozen=True)
class Attributes:
    """One resource request as the authorizer sees it (namespace None: cluster-scoped)."""

    verb: str
    group: str
    resource: str
    subresource: str
    namespace: str | None
    name: str | None

    @property
    def full_resource(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


@dataclass(frozen=True)
class _Binding:
    namespace: str | None  # None: a ClusterRoleBinding
    role: tuple[str, str]  # (kind, name)
    subjects: tuple[tuple[str, str, str | None], ...]  # (kind, name, namespace)


def load_manifest(path: Path = RBAC_MANIFEST) -> list[dict[str, Any]]:
    """The documents of a YAML manifest (empty ones dropped). Raises OSError, yaml.YAMLError."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


class Rbac:
    """Decides requests from RBAC objects. Immutable after construction; thread-safe."""

    def __init__(self, objects: Iterable[Mapping[str, Any]]) -> None:
        self._rules: dict[tuple[str, str | None, str], list[Mapping[str, Any]]] = {}
        self._bindings: list[_Binding] = []
        for obj in objects:
            kind, meta = obj.get("kind"), obj.get("metadata", {})
            if kind in ("Role", "ClusterRole"):
                namespace = meta.get("namespace") if kind == "Role" else None
                self._rules[(kind, namespace, meta["name"])] = list(obj.get("rules") or [])
            elif kind in ("RoleBinding", "ClusterRoleBinding"):
                ref = obj["roleRef"]
                self._bindings.append(_Binding(
                    meta.get("namespace") if kind == "RoleBinding" else None,
                    (ref["kind"], ref["name"]),
                    tuple((s["kind"], s["name"], s.get("namespace"))
                          for s in obj.get("subjects") or []),
                ))

    def allows(self, who: Principal, request: Attributes) -> bool:
        """Whether any binding of ``who`` grants ``request``."""
        if MASTERS in who.groups:
            return True
        for binding in self._bindings:
            if binding.namespace is not None and binding.namespace != request.namespace:
                continue
            if not any(_subject_is(who, s, binding.namespace) for s in binding.subjects):
                continue
            kind, name = binding.role
            scope = binding.namespace if kind == "Role" else None
            rules = self._rules.get((kind, scope, name), [])
            if any(_rule_allows(rule, request) for rule in rules):
                return True
        return False


def forbidden(who: Principal, request: Attributes) -> str:
    """The real server's message for a request RBAC does not allow."""
    what = f"{request.resource}.{request.group}" if request.group else request.resource
    what = f'{what} "{request.name}"' if request.name else what
    where = (f' in the namespace "{request.namespace}"' if request.namespace
             else " at the cluster scope")
    return (f'{what} is forbidden: User "{who.user}" cannot {request.verb} resource '
            f'"{request.full_resource}" in API group "{request.group}"{where}')


def _subject_is(who: Principal, subject: tuple[str, str, str | None], default_ns: str | None
                ) -> bool:
    kind, name, namespace = subject
    if kind == "ServiceAccount":
        return who.user == f"system:serviceaccount:{namespace or default_ns}:{name}"
    if kind == "User":
        return who.user == name
    return kind == "Group" and name in who.groups


def _rule_allows(rule: Mapping[str, Any], request: Attributes) -> bool:
    def has(field: str, value: str) -> bool:
        values = rule.get(field) or []
        return "*" in values or value in values

    names = rule.get("resourceNames") or []
    return (has("apiGroups", request.group) and has("verbs", request.verb)
            and has("resources", request.full_resource)
            and (not names or request.name in names))
