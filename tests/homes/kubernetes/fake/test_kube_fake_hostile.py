"""The fake API server answers hostile requests with Status objects and keeps serving."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.testing.kubernetes.fake import PODS, ApiStatus, FakeApiServer, grant_pod

POD_PATH = "/api/v1/namespaces/grants/pods/p/status"  # the Role lets the token patch it


@pytest.fixture
def plain(clock: FakeClock) -> Iterator[FakeApiServer]:
    with FakeApiServer(clock=clock, tls=False, token="t") as server:
        server.store.put(PODS, grant_pod("p", "grants"))
        yield server


def ask(server: FakeApiServer, method: str, body: bytes = b"", path: str = POD_PATH,
        **headers: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=5)
    try:
        conn.putrequest(method, path)
        for name, value in {"Authorization": "Bearer t", **headers}.items():
            conn.putheader(name.replace("_", "-"), value)
        conn.endheaders(body or None)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("body", "headers", "code"),
    [
        (b"", {"Authorization": "Bearer wrong"}, 401),
        (b"{", {"Content_Type": "application/merge-patch+json"}, 400),
        (b"[1]", {"Content_Type": "application/merge-patch+json"}, 400),
        (b'"x"', {"Content_Type": "application/strategic-merge-patch+json"}, 400),
        (b'{"metadata": null}', {"Content_Type": "application/merge-patch+json"}, 400),
        (b"{}", {"Content_Type": "text/plain"}, 415),
        (b"", {"Content_Length": "-5"}, 400),
    ],
)
def test_refusals_are_status_objects(
    plain: FakeApiServer, body: bytes, headers: dict[str, str], code: int
) -> None:
    before = plain.store.get(PODS, "grants", "p")
    got, status = ask(plain, "PATCH", body, **headers)
    assert (got, status["kind"], status["code"]) == (code, "Status", code)
    assert status["reason"] and status["message"]
    assert plain.store.get(PODS, "grants", "p") == before, "a refused write changes nothing"
    assert ask(plain, "GET", path=POD_PATH.removesuffix("/status"))[0] == 200, "still serving"


def test_store_refuses_unidentifiable_objects(plain: FakeApiServer) -> None:
    with pytest.raises(ApiStatus) as caught:
        plain.store.put(PODS, {"metadata": {"name": "x"}})
    assert caught.value.code == 422
