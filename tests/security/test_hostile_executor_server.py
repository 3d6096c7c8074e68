"""Issue 38, Medium: the Executor unpickles only what a server of a trusted uid sends.

A hostile job user (sfmallory) listens on a socket of their own and answers every clone
with an exit event whose result is a pickle that runs a command when unpickled. The
victim (sfalice) points an Executor at that socket (a wrong ``FIBERD_SOCKET``, a socket
planted where a job looks for its fiberd). The Executor checks the server's uid with
SO_PEERCRED when it connects: neither alice's uid nor root's, so the future fails with
one line naming the uid and nothing is unpickled, nothing runs as alice.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.security.userkit import JobUser

SYSTEM_PYTHON = "/usr/bin/python3"

# The attacker's server: length-prefixed JSON frames, as fiberd's; every clone (or batch
# item) is answered as started, then ended with a pickled result that runs `id -u`.
SERVER = r"""
import base64, json, os, pickle, socket, struct, sys
path, marker = sys.argv[1], sys.argv[2]
class Payload:
    def __reduce__(self):
        return (os.system, (f"id -u > {marker}",))
pickled = base64.b64encode(pickle.dumps(Payload())).decode()
def send(conn, msg):
    body = json.dumps(msg).encode()
    conn.sendall(struct.pack(">I", len(body)) + body)
srv = socket.socket(socket.AF_UNIX)
srv.bind(path)
os.chmod(path, 0o777)
srv.listen(8)
print("listening", flush=True)
while True:
    conn, _ = srv.accept()
    buf = b""
    while True:
        data = conn.recv(65536)
        if not data:
            break
        buf += data
        while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
            n = struct.unpack(">I", buf[:4])[0]
            msg, buf = json.loads(buf[4:4 + n]), buf[4 + n:]
            keys = [i.get("key") for i in msg.get("items", [])] or [None]
            if msg.get("op") == "clone":
                send(conn, {"ok": True, "id": msg.get("id"), "result": {"fiber": {"id": "f1"}}})
            else:
                send(conn, {"ok": True, "id": msg.get("id"), "result": {"items": [
                    {"key": k, "fiber": {"id": f"f{k}"}} for k in keys]}})
            for k in keys:
                send(conn, {"ok": True, "event": "exit", "result": {
                    "fiber_id": f"f{k}" if k is not None else "f1", "status": 0,
                    "exit_code": 0, "result": {"pickled": pickled}}})
    conn.close()
"""

# The victim: submits one call to the socket it was given, prints what the future gave.
VICTIM = r"""
import sys
from slurm_fiber import Executor
with Executor(socket=sys.argv[1], max_workers=1) as ex:
    try:
        print("RESULT", ex.submit(abs, -1).result(timeout=60))
    except Exception as e:
        print("RAISED", type(e).__name__, e)
"""


@pytest.fixture
def hostile_server(mallory: JobUser) -> Iterator[tuple[Path, Path]]:
    """(mallory's socket, where the payload would write) with mallory's server running."""
    base = Path(tempfile.mkdtemp(prefix="sf-hostile-server-", dir="/tmp"))  # not pytest's
    base.chmod(0o755)  # 0700 tmp root: both users reach this one
    own = base / "mallory"
    own.mkdir()
    os.chown(own, mallory.uid, mallory.gid)
    drop = base / "drop"
    drop.mkdir(mode=0o777)
    drop.chmod(0o1777)
    sock, marker = own / "fiberd.sock", drop / "pwned"
    server = subprocess.Popen([SYSTEM_PYTHON, "-c", SERVER, str(sock), str(marker)],
                              stdout=subprocess.PIPE, text=True, **mallory.spawn_args())
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        yield sock, marker
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(base, ignore_errors=True)


def test_executor_refuses_a_server_of_another_uid_before_unpickling(
        hostile_server: tuple[Path, Path], alice: JobUser, mallory: JobUser) -> None:
    sock, marker = hostile_server
    env = alice.spawn_args()
    env["env"] = {**env["env"], "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run([SYSTEM_PYTHON, "-c", VICTIM, str(sock)], capture_output=True,
                          text=True, timeout=120, **env)
    time.sleep(0.2)  # (the payload's shell, had it run, has written by now)
    assert not marker.exists(), (
        f"mallory's pickle ran as uid {marker.read_text().strip()}: {done.stdout}")
    assert "RAISED FiberdError" in done.stdout, (done.stdout, done.stderr)
    assert f"uid {mallory.uid}" in done.stdout, done.stdout
