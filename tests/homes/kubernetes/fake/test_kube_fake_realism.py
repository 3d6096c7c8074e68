"""The fake answers as the real kube-apiserver v1.20 did in issue 16's run, point by point.

RBAC from deploy/kubernetes/rbac.yaml (403 Status objects), the token cache of
a Pod-bound token (200 for 10 s after its Pod is replaced, then 401, on the
fake's clock), the condition order and fields of a status patch, and
TCP_NODELAY on its connections.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import time

import pytest

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.testing.kubernetes.fake import PODS, FakeApiServer, grant_pod
from slurm_fiber.testing.kubernetes.fake.rbac import load_manifest
from slurm_fiber.testing.kubernetes.fake.server import TOKEN_CACHE_TTL
from tests.homes.kubernetes.conftest import NAMESPACE, POD, POD_UID

BASE = f"/api/v1/namespaces/{NAMESPACE}"
SA = "system:serviceaccount:grants:slurm-fiber"


def ask(fake: FakeApiServer, method: str, path: str, token: str, body: object = None,
        content_type: str = "application/strategic-merge-patch+json") -> tuple[int, dict]:
    context = ssl.create_default_context(cadata=fake.ca_pem.decode())
    conn = http.client.HTTPSConnection(fake.host, fake.port, timeout=5, context=context)
    try:
        payload = None if body is None else json.dumps(body).encode()
        conn.request(method, path, payload, {"Authorization": f"Bearer {token}",
                                              "Content-Type": content_type})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("method", "path", "message"),
    [
        ("GET", f"{BASE}/pods", f'pods is forbidden: User "{SA}" cannot list resource "pods" '
                                'in API group "" in the namespace "grants"'),
        ("GET", f"{BASE}/secrets/grant-secret", 'secrets "grant-secret" is forbidden: User '
                                                f'"{SA}" cannot get resource "secrets"'),
        ("PATCH", f"{BASE}/pods/{POD}", f'pods "{POD}" is forbidden: User "{SA}" cannot patch '
                                         'resource "pods" in API group ""'),
        ("DELETE", f"{BASE}/pods/{POD}", 'cannot delete resource "pods"'),
        ("GET", f"{BASE}/pods/{POD}/status", 'cannot get resource "pods/status"'),
        ("GET", "/apis/resource.k8s.io/v1/namespaces/other/resourceclaims/c",
         'in the namespace "other"'),
    ],
)
def test_the_service_account_gets_403_for_what_rbac_yaml_does_not_allow(
    fake: FakeApiServer, method: str, path: str, message: str
) -> None:
    before = fake.store.get(PODS, NAMESPACE, POD)
    code, status = ask(fake, method, path, fake.token, {"metadata": {"labels": {"a": "b"}}})
    assert (code, status["kind"], status["reason"], status["code"]) == \
        (403, "Status", "Forbidden", 403)
    assert message in status["message"]
    assert fake.store.get(PODS, NAMESPACE, POD) == before, "nothing written"


def test_what_rbac_yaml_allows_is_served_and_the_admin_may_do_anything(
    fake: FakeApiServer, claim_name: str
) -> None:
    assert ask(fake, "GET", f"{BASE}/pods/{POD}", fake.token)[0] == 200
    claim = f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/{claim_name}"
    assert ask(fake, "GET", claim, fake.token)[0] == 200
    patch = {"status": {"conditions": [{"type": "X", "status": "True"}]}}
    assert ask(fake, "PATCH", f"{BASE}/pods/{POD}/status", fake.token, patch)[0] == 200
    assert ask(fake, "GET", f"{BASE}/secrets/s", fake.admin_token)[0] == 404
    assert ask(fake, "PATCH", f"{BASE}/pods/{POD}", fake.admin_token, {})[0] == 200


def test_rbac_is_read_from_the_role_objects(clock: FakeClock) -> None:
    objects = load_manifest()
    role = next(o for o in objects if o["kind"] == "Role")
    role["rules"] = [r for r in role["rules"] if r["resources"] != ["pods"]]  # no get pods
    with FakeApiServer(clock=clock, rbac=objects) as fake:
        fake.store.put(PODS, grant_pod(POD, NAMESPACE, uid=POD_UID))
        assert ask(fake, "GET", f"{BASE}/pods/{POD}", fake.token)[0] == 403
        assert ask(fake, "PATCH", f"{BASE}/pods/{POD}/status", fake.token, {})[0] == 200


def test_a_bound_token_reads_a_replaced_pod_for_10s_then_gets_401(
    fake: FakeApiServer, clock: FakeClock
) -> None:
    token = fake.bound_token(NAMESPACE, POD)
    assert ask(fake, "GET", f"{BASE}/pods/{POD}", token)[0] == 200  # checked: cached 10 s
    clock.advance(1)
    fake.store.remove(PODS, NAMESPACE, POD)  # force-deleted and recreated under its name
    fake.store.put(PODS, grant_pod(POD, NAMESPACE, uid="the-new-pod"))
    code, pod = ask(fake, "GET", f"{BASE}/pods/{POD}", token)
    assert (code, pod["metadata"]["uid"]) == (200, "the-new-pod"), "the cache still vouches"
    clock.advance(TOKEN_CACHE_TTL - 1.001)
    assert ask(fake, "GET", f"{BASE}/pods/{POD}", token)[0] == 200
    clock.advance(0.002)
    code, status = ask(fake, "GET", f"{BASE}/pods/{POD}", token)
    assert (code, status["reason"]) == (401, "Unauthorized")
    clock.advance(60)
    assert ask(fake, "GET", f"{BASE}/pods/{POD}", token)[0] == 401, "and stays refused"
    fresh = fake.bound_token(NAMESPACE, POD)
    assert ask(fake, "GET", f"{BASE}/pods/{POD}", fresh)[0] == 200, "the new Pod's token works"


def test_a_deleting_pods_token_lasts_60s_past_its_deletion_timestamp(
    fake: FakeApiServer, clock: FakeClock
) -> None:
    token = fake.bound_token(NAMESPACE, POD)
    fake.store.delete(PODS, NAMESPACE, POD)  # deletionTimestamp: now + 30 s grace
    clock.advance(30 + 60 - 1)
    assert ask(fake, "GET", f"{BASE}/pods/{POD}", token)[0] == 200
    clock.advance(TOKEN_CACHE_TTL + 2)
    assert ask(fake, "GET", f"{BASE}/pods/{POD}", token)[0] == 401


def test_a_new_condition_goes_first_with_the_real_time_fields(fake: FakeApiServer) -> None:
    before = [c["type"] for c in fake.store.get(PODS, NAMESPACE, POD)["status"]["conditions"]]
    patch = {"status": {"conditions": [{"type": "slurm-fiber.io/template-warm",
                                        "status": "True", "lastTransitionTime": "2026-12-03T"
                                                                                "00:00:00Z"}]}}
    code, pod = ask(fake, "PATCH", f"{BASE}/pods/{POD}/status", fake.token, patch)
    assert code == 200
    conditions = pod["status"]["conditions"]
    assert [c["type"] for c in conditions] == ["slurm-fiber.io/template-warm", *before]
    assert conditions[0]["lastProbeTime"] is None
    assert conditions[0]["lastTransitionTime"] == "2026-12-03T00:00:00Z"
    assert all("lastProbeTime" in c and "lastTransitionTime" in c for c in conditions)


def test_answers_are_sent_with_tcp_nodelay(fake: FakeApiServer) -> None:
    context = ssl.create_default_context(cadata=fake.ca_pem.decode())
    with socket.create_connection((fake.host, fake.port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname=fake.host) as client:
        peer = client.getsockname()
        listener = fake._http
        assert listener is not None
        accepted: list[socket.socket] = []
        for _ in range(500):  # the server adds it once its side of the handshake is done
            accepted = [s for s in listener.connections() if s.getpeername() == peer]
            if accepted:
                break
            time.sleep(0.01)
        assert accepted, "the fake never took the connection"
        assert accepted[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
