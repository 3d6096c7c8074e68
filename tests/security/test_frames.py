"""Hostile frames against a real fiberd (issue 13, "hostile input").

A 100,000-deep JSON array in a frame used to make the decoder raise
RecursionError inside the connection's task: the connection dropped with no
reply and no audit record. Now it is ``bad_frame`` with a reason, audited,
and the same connection (and every other) carries on.
"""

from __future__ import annotations

import json
import socket
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_fiber.client.connection import FiberdClient
from slurm_fiber.protocol.framing import MAX_DEPTH
from tests.core.api.rawkit import read_replies
from tests.core.runtime.fiberdkit import Site, ThreadFiberd, fiberd_in_thread


@pytest.fixture
def fiberd(tmp_path: Path) -> Iterator[ThreadFiberd]:
    with fiberd_in_thread(Site(tmp_path, uuid.uuid4().hex)) as served:
        yield served


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def audit_refusals(fiberd: ThreadFiberd, code: str) -> list[dict[str, Any]]:
    lines = (fiberd.path.parent / "audit.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "api_refuse" and r["code"] == code]


@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"op":"status","id":7,"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"op":"clone","call":{"target":"os:getpid","args":' + b"[" * (MAX_DEPTH * 8)
    + b"]" * (MAX_DEPTH * 8) + b"}}",
], ids=["bare", "in_a_request", "in_call_args"])
def test_deep_nesting_is_an_audited_bad_frame_and_the_connection_carries_on(
        fiberd: ThreadFiberd, body: bytes) -> None:
    ready = json.dumps({"op": "ready", "id": "after"}).encode()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(fiberd.path))
        sock.sendall(frame(body) + frame(ready))
        sock.shutdown(socket.SHUT_WR)
        replies = read_replies(sock)
    assert len(replies) == 2, replies
    error = replies[0]["error"]
    assert error["code"] == "bad_frame" and f"deeper than {MAX_DEPTH} levels" in error["reason"]
    assert replies[1]["id"] == "after" and replies[1]["result"] == {"ready": True}
    [refusal] = audit_refusals(fiberd, "bad_frame")
    assert "deeper than" in refusal["reason"]
    with FiberdClient(fiberd.path) as client:  # the daemon is unaffected
        assert client.request("ready") == {"ready": True}
