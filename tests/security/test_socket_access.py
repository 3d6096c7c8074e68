"""``allowed_uids`` / ``allowed_gids`` make fiberd's socket usable by exactly those users.

Real processes of real users talk to a fiberd run by root: the allowed
``alice`` connects and is served, ``mallory`` is refused (``forbidden``,
audited with her uid) before anything she sends is read, and a user allowed
only through a supplementary group is served. Before issue 13 the socket
stayed 0600 in a 0700 dir, so even ``alice`` could not connect.
"""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.core.runtime.conftest import site
from tests.core.runtime.fiberdkit import Site, fiberd_in_thread
from tests.security.userkit import JobUser

__all__ = ["site"]

# The client a job user runs: the system interpreter (the test's venv may not be readable
# by other users), speaking the framing of docs/socket-protocol.md by hand.
CLIENT = """
import json, socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print(json.dumps({"connect": e.strerror})); sys.exit(0)
body = json.dumps({"op": "status", "id": 1}).encode()
try:
    s.sendall(struct.pack(">I", len(body)) + body)
except BrokenPipeError:
    pass  # refused at connect: the refusal is already waiting to be read
data = b""
while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
print(json.dumps({"reply": json.loads(data[4:]) if len(data) > 4 else None}))
"""


def ask_as(user: JobUser, sock: Path, **spawn: Any) -> dict[str, Any]:
    args = {**user.spawn_args(), **spawn}
    out = subprocess.run(["/usr/bin/python3", "-c", CLIENT, str(sock)], capture_output=True,
                         text=True, timeout=60, check=False, **args)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


@pytest.fixture
def state() -> Iterator[Path]:
    """A root-owned 0700 state dir directly under /tmp (so other users can reach it once
    fiberd opens it for search)."""
    path = Path(tempfile.mkdtemp(prefix="sf-sock-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_allowed_users_are_served_and_others_refused_with_an_audit(
        site: Site, state: Path, alice: JobUser, mallory: JobUser) -> None:
    with fiberd_in_thread(site, state_dir=str(state), grantdir=str(site.grantdir),
                          allowed_uids=alice.name):
        sock = state / "fiberd.sock"
        served = ask_as(alice, sock)
        assert served["reply"]["ok"] is True, served
        assert served["reply"]["result"]["home"] == "standalone"
        refused = ask_as(mallory, sock)
        assert refused["reply"]["ok"] is False, refused
        assert refused["reply"]["error"]["code"] == "forbidden"
        assert stat.S_IMODE(state.stat().st_mode) == 0o711  # reachable, not listable
    records = [json.loads(line) for line in (state / "audit.jsonl").read_text().splitlines()]
    denials = [r for r in records if r["event"] == "api_refuse" and r["code"] == "forbidden"]
    assert [r["caller_uid"] for r in denials] == [mallory.uid]


def test_a_group_admits_its_members_by_primary_or_supplementary_group(
        site: Site, state: Path, alice: JobUser, mallory: JobUser) -> None:
    with fiberd_in_thread(site, state_dir=str(state), grantdir=str(site.grantdir),
                          allowed_gids=str(alice.gid)):
        sock = state / "fiberd.sock"
        assert ask_as(alice, sock)["reply"]["ok"] is True
        assert ask_as(mallory, sock)["reply"]["error"]["code"] == "forbidden"
        # mallory, once a member of alice's group (a supplementary group), is a member
        member = ask_as(mallory, sock, extra_groups=[alice.gid])
        assert member["reply"]["ok"] is True, member


def test_without_allowed_users_the_socket_stays_private(site: Site, state: Path,
                                                        alice: JobUser) -> None:
    with fiberd_in_thread(site, state_dir=str(state), grantdir=str(site.grantdir)):
        sock = state / "fiberd.sock"
        assert stat.S_IMODE(sock.lstat().st_mode) == 0o600
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert ask_as(alice, sock) == {"connect": "Permission denied"}
