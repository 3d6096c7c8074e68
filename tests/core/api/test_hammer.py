"""50 concurrent clients mixing valid clones with every kind of malformed input.

Must show (issue 3): every valid clone answered, the server alive, no
descriptor leaked (counted in /proc/self/fd, the server runs in this process).
"""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time

import pytest

from slurm_fiber.client.connection import FiberdClient
from slurm_fiber.protocol.framing import encode_frame
from tests.core.api.rawkit import read_replies

CLIENTS = 50
ROUNDS = 4


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def valid_clone(path) -> None:
    with FiberdClient(path) as c:
        c.clone(exec={"argv": ["true"]}, wait=True)
        assert c.wait_exit()["status"] == 0


def valid_call(path) -> None:
    with FiberdClient(path) as c:
        c.clone(call={"target": "operator:add", "args": [2, 3]}, wait=True)
        assert c.wait_exit()["result"] == 5


def let_go(served, within: float = 10.0) -> None:
    """Wait (at most ``within`` s) until the server holds no connection and no fiber runs."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and (
            served.on_loop(lambda: served.server.connections)
            or served.on_loop(served.service.fibers_running)):
        time.sleep(0.05)


def spares_made(path, within: float = 30.0) -> None:
    """Return once every template keeps its spares (two, fiberd's default) idle: what a
    Clone uses is replaced in the background."""
    end = time.monotonic() + within
    with FiberdClient(path) as c:
        while time.monotonic() < end:
            templates = [g["template"] for g in c.request("list_grants")["grants"]]
            if all(t["spares"] == 2 for t in templates):
                return
            time.sleep(0.02)
    raise AssertionError(f"spares not all made within {within:g} s: {templates}")


def raw(path, payload: bytes, fds: list[int] = (), wait_reply: bool = True) -> list[dict]:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(path))
        if fds:
            sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                      struct.pack(f"{len(fds)}i", *fds))])
        else:
            sock.sendall(payload)
        if not wait_reply:
            return []  # abrupt disconnect
        sock.shutdown(socket.SHUT_WR)
        return read_replies(sock)


def expect(replies: list[dict], code: str) -> None:
    assert replies and replies[0]["ok"] is False and replies[0]["error"]["code"] == code, replies


def malformed(path, kind: int) -> None:
    r, w = os.pipe()
    try:
        match kind:
            case 0:  # random bytes: whatever the header says, error replies or a close
                assert all(not reply["ok"] for reply in raw(path, os.urandom(64)))
            case 1:
                expect(raw(path, struct.pack(">I", 50 << 20) + b"{}"), "frame_too_large")
            case 2:  # truncated: header promises more than comes, then EOF
                assert raw(path, struct.pack(">I", 100) + b'{"op":') == []
            case 3:
                expect(raw(path, encode_frame({"op": "clone", "exec": {"argv": [1, 2]}})),
                       "bad_request")
            case 4:
                expect(raw(path, encode_frame({"op": "clone", "exec": {"argv": ["true"]},
                                               "stdio": ["stdout"]}), [w, w]), "bad_fds")
            case 5:
                expect(raw(path, encode_frame({"op": "status"}), [r]), "bad_fds")
            case 6:  # abrupt disconnect right after a valid clone request
                raw(path, encode_frame({"op": "clone", "exec": {"argv": ["sleep", "5"]},
                                        "wait": True}), wait_reply=False)
            case 7:
                expect(raw(path, encode_frame({"op": "inspect_fiber", "fiber": 3})),
                       "bad_request")
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("runtime", ["served", "fiberd_served"])
def test_fifty_clients_hammering(runtime: str, request: pytest.FixtureRequest) -> None:
    served = request.getfixturevalue(runtime)
    path = served.path
    valid_clone(path)  # warm every lazy path once before counting
    valid_call(path)
    malformed(path, 4)
    if runtime == "fiberd_served":
        spares_made(path)  # each spare holds fds in fiberd: count them all
    let_go(served)
    before = open_fds()
    answered: list[int] = []
    failures: list[BaseException] = []
    start = threading.Barrier(CLIENTS)

    def client(n: int) -> None:
        rng = random.Random(n)
        start.wait()
        try:
            for _ in range(ROUNDS):
                (valid_call if rng.random() < 0.3 else valid_clone)(path)
                answered.append(n)
                malformed(path, rng.randrange(8))
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures[:3]
    assert len(answered) == CLIENTS * ROUNDS

    with FiberdClient(path) as c:
        assert c.request("ready") == {"ready": True}
    # the abandoned fibers were hung up; the server lets go of every connection
    let_go(served)
    assert served.on_loop(served.service.fibers_running) == 0
    assert open_fds() == before
