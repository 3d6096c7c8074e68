"""Hostile socket clients for the security tests, run as real processes of real users.

``hold(path, n, user)`` starts ``/usr/bin/python3`` (a system interpreter
every account can run; the test venv lives under root's home) as ``user``:
it opens ``n`` connections to the Unix socket at ``path``, sends nothing,
prints how many it opened, and holds them all until its stdin closes. It
reports what each connection received so far when asked (a line on stdin),
so a test can see which ones fiberd answered ``busy`` and closed.
``windows(path, n, user)`` likewise holds ``n`` connections, each streaming a
windowed batch whose items not started carry 189 descriptors.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.security.userkit import JobUser

SYSTEM_PYTHON = "/usr/bin/python3"

HOLDER = r"""
import json, select, socket, struct, sys
path, n = sys.argv[1], int(sys.argv[2])
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    socks.append(s)
print(json.dumps({"opened": len(socks)}), flush=True)
for _line in sys.stdin:  # each line: report the error codes received so far, per connection
    codes = []
    for s in socks:
        s.setblocking(False)
        try:
            data = s.recv(65536)
        except BlockingIOError:
            codes.append(None)
            continue
        if len(data) < 4:
            codes.append("closed" if data == b"" else "?")
            continue
        (size,) = struct.unpack(">I", data[:4])
        codes.append(json.loads(data[4:4 + size]).get("error", {}).get("code"))
    print(json.dumps({"codes": codes}), flush=True)
"""

ASK = r"""
import json, socket, struct, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(20)
s.connect(sys.argv[1])
body = json.dumps({"op": sys.argv[2], "id": 1}).encode()
s.sendall(struct.pack(">I", len(body)) + body)
head = s.recv(4, socket.MSG_WAITALL)
(size,) = struct.unpack(">I", head)
print(s.recv(size, socket.MSG_WAITALL).decode(), flush=True)
"""


WINDOWS = r"""
import array, json, os, socket, struct, sys
path, n = sys.argv[1], int(sys.argv[2])
null = os.open("/dev/null", os.O_RDONLY)
socks, answers = [], []
for c in range(n):  # a sleeper holds the window; 63 items wait, each with 3 descriptors
    items = [{"key": "s", "exec": {"argv": ["sleep", "30"]}}] + [
        {"key": f"k{i}", "exec": {"argv": ["true"]}, "stdio": ["stdin", "stdout", "stderr"]}
        for i in range(63)]
    body = json.dumps({"op": "clone_batch", "v": 5, "id": c, "wait": True, "window": 1,
                       "items": items}).encode()
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(20)
    s.connect(path)
    s.sendmsg([struct.pack(">I", len(body)) + body],
              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [null] * 189))])
    (size,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
    reply = json.loads(s.recv(size, socket.MSG_WAITALL))
    answers.append(reply.get("event") or reply.get("error", {}).get("code"))
    socks.append(s)
print(json.dumps({"answers": answers}), flush=True)
sys.stdin.read()  # hold the batches until stdin closes
"""


class Holder:
    """A running holder process; ``codes()`` asks what each connection has received."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        line = proc.stdout.readline() if proc.stdout else ""
        assert line, f"the hostile client failed: {proc.stderr.read() if proc.stderr else ''}"
        self.opened = int(json.loads(line)["opened"])

    def codes(self) -> list[str | None]:
        """Per connection: None (nothing received, still open), an error code, or "closed"."""
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write("report\n")
        self.proc.stdin.flush()
        return list(json.loads(self.proc.stdout.readline())["codes"])


@contextmanager
def hold(path: Path, n: int, user: JobUser) -> Iterator[Holder]:
    """``n`` idle connections to ``path`` held by a process of ``user`` until the block ends."""
    proc = subprocess.Popen([SYSTEM_PYTHON, "-c", HOLDER, str(path), str(n)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **user.spawn_args())
    try:
        yield Holder(proc)
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(30)


@contextmanager
def windows(path: Path, n: int, user: JobUser) -> Iterator[list[str]]:
    """``n`` connections of ``user``, each sending a windowed batch that holds 189
    descriptors for items not started, held until the block ends: what each was answered
    (``started``, or an error code)."""
    proc = subprocess.Popen([SYSTEM_PYTHON, "-c", WINDOWS, str(path), str(n)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **user.spawn_args())
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line, f"the hostile client failed: {proc.stderr.read() if proc.stderr else ''}"
        yield list(json.loads(line)["answers"])
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(30)


def ask(path: Path, op: str, user: JobUser) -> dict[str, object]:
    """One request ``op`` on a new connection, from a process of ``user``: the reply."""
    out = subprocess.run([SYSTEM_PYTHON, "-c", ASK, str(path), op], capture_output=True,
                         text=True, timeout=60, **user.spawn_args())
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))
