"""The fake against a real kube-apiserver v1.20.2: the same request gets the same answer.

One real apiserver (``testing.kubernetes.realserver``, loopback, RBAC with
deploy/kubernetes/rbac.yaml applied unchanged) and one fake hold the same
grant Pod; each request is sent to both with the Pod's bound service account
token, and the code, reason and message must agree. Also the home's own
client (``KubeApi``) against the real server. Skipped, with the reason,
when no apiserver was built here.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from slurm_fiber.core.clock import SystemClock
from slurm_fiber.homes.kubernetes.api import ApiFailure, KubeApi
from slurm_fiber.homes.kubernetes.incluster import InClusterConfig, PodIdentity
from slurm_fiber.testing.kubernetes.fake import PODS, FakeApiServer, grant_pod
from tests.homes.kubernetes.lanekit import RealLane, real_lane

NAMESPACE = "grants"
POD = "grant-pod-1"
BASE = f"/api/v1/namespaces/{NAMESPACE}"
GATE = "slurm-fiber.io/template-warm"
SMP = "application/strategic-merge-patch+json"


class Target:
    """One API server as the grant Pod reaches it: URL, CA file, bound token."""

    def __init__(self, url: str, ca: Path, token: str) -> None:
        self.url, self.ca, self.token = url, ca, token

    def ask(self, method: str, path: str, body: Any = None,
            content_type: str = SMP) -> tuple[int, dict[str, Any]]:
        verify = ssl.create_default_context(cafile=self.ca)
        with httpx2.Client(base_url=self.url, verify=verify, timeout=10) as client:
            answer = client.request(method, path, content=None if body is None else
                                    json.dumps(body), headers={
                                        "Authorization": f"Bearer {self.token}",
                                        "Content-Type": content_type})
            return answer.status_code, answer.json()


@pytest.fixture(scope="module")
def real() -> Iterator[RealLane]:
    lane = real_lane(POD)
    try:
        yield lane
    finally:
        lane.close()


@pytest.fixture(scope="module")
def both(real: RealLane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Target]]:
    tmp = tmp_path_factory.mktemp("ca")
    with FakeApiServer() as fake:
        fake.store.put(PODS, grant_pod(POD, NAMESPACE, uid=real.pod_uid(),
                                       service_account="slurm-fiber"))
        (tmp / "fake.crt").write_bytes(fake.ca_pem)
        (tmp / "real.crt").write_bytes(real.ca_pem)
        yield {"fake": Target(fake.url, tmp / "fake.crt", fake.bound_token(NAMESPACE, POD)),
               "real": Target(real.server.url, tmp / "real.crt", real.bound_token())}


def same_answer(both: dict[str, Target], method: str, path: str, body: Any = None
                ) -> tuple[int, str, str]:
    answers = {}
    for name, target in both.items():
        code, status = target.ask(method, path, body)
        answers[name] = (code, status.get("reason", ""), status.get("message", ""))
    assert answers["fake"] == answers["real"]
    return answers["real"]


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", f"{BASE}/pods"), ("GET", f"{BASE}/secrets/grant-secret"),
     ("PATCH", f"{BASE}/pods/{POD}"), ("DELETE", f"{BASE}/pods/{POD}"),
     ("GET", f"{BASE}/pods/{POD}/status"), ("GET", "/api/v1/pods"),
     ("GET", "/apis/resource.k8s.io/v1/namespaces/other/resourceclaims/c")],
)
def test_what_rbac_yaml_refuses_gets_the_same_403(both: dict[str, Target], method: str,
                                                  path: str) -> None:
    body = {"metadata": {"labels": {"a": "b"}}} if method == "PATCH" else None
    code, reason, _ = same_answer(both, method, path, body)
    assert (code, reason) == (403, "Forbidden")


def test_a_status_patch_for_another_pods_uid_gets_the_same_422(both: dict[str, Target]) -> None:
    patch = {"metadata": {"uid": "an-older-pod"},
             "status": {"conditions": [{"type": GATE, "status": "True"}]}}
    code, reason, message = same_answer(both, "PATCH", f"{BASE}/pods/{POD}/status", patch)
    assert (code, reason) == (422, "Invalid") and "field is immutable" in message


def test_a_new_condition_lands_first_with_the_same_fields(both: dict[str, Target]) -> None:
    written = {}
    for name, target in both.items():
        condition = {"type": f"example.com/new-{name}", "status": "True", "reason": "R",
                     "message": "M", "lastTransitionTime": "2026-12-03T00:00:00Z"}
        code, pod = target.ask("PATCH", f"{BASE}/pods/{POD}/status",
                               {"status": {"conditions": [condition]}})
        assert code == 200
        written[name] = pod["status"]["conditions"][0]
    assert written["fake"]["type"] == "example.com/new-fake", "new goes first"
    assert written["real"]["type"] == "example.com/new-real", "new goes first"
    assert set(written["fake"]) == set(written["real"])
    assert written["fake"]["lastProbeTime"] is written["real"]["lastProbeTime"] is None


def test_the_homes_client_reads_and_patches_the_real_pod(real: RealLane, tmp_path: Path
                                                         ) -> None:
    (tmp_path / "token").write_text(real.bound_token())
    (tmp_path / "ca.crt").write_bytes(real.ca_pem)
    config = InClusterConfig(real.server.url, tmp_path / "ca.crt", tmp_path / "token",
                             PodIdentity(POD, NAMESPACE, real.pod_uid()))

    async def main() -> None:
        api = KubeApi(config, clock=SystemClock())
        try:
            pod = await api.read_pod()
            assert pod is not None and pod.uid == real.pod_uid()
            assert pod.claims == (), "v1.20 drops spec.resourceClaims"
            written = await api.set_condition(GATE, True, reason="TemplateWarm", message="m")
            assert written.conditions[GATE] == "True"
            assert await api.read_claim("no-such-claim") is None  # the CRD, through RBAC
            other = KubeApi(InClusterConfig(config.server, config.ca_file, config.token_file,
                                            PodIdentity(POD, NAMESPACE, "an-older-pod")),
                            clock=SystemClock())
            try:
                with pytest.raises(ApiFailure) as refused:
                    await other.set_condition(GATE, False, reason="r", message="m")
                assert refused.value.code == 422
            finally:
                await other.aclose()
        finally:
            await api.aclose()

    asyncio.run(main())
