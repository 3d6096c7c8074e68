"""Finding (issue 38, medium): any local user grew the audit log with refused connections.

With ``allowed_uids`` set the socket is 0666, so any local user may connect; each
refused connection was one ``api_refuse`` record (about 1.25 MB/s from one loop).
Refusals are now rate-limited per caller and code (core/refusal_log.py): the first of a
window is written whole, the rest are counted and written as one record with
``repeated``, so every refusal is still accounted for.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.core.runtime.conftest import site
from tests.core.runtime.fiberdkit import Site, fiberd_in_thread
from tests.security.userkit import JobUser

__all__ = ["site"]

ATTEMPTS = 2000

# mallory's loop: connect, read the refusal, close; print how many were refused.
FLOOD = """
import socket, struct, sys
refused = 0
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(sys.argv[1])
    data = s.recv(65536)
    refused += b"forbidden" in data
    s.close()
print(refused)
"""


@pytest.fixture
def state() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="sf-flood-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_hostile_refused_connection_flood_is_counted_not_written_one_by_one(
        site: Site, state: Path, alice: JobUser, mallory: JobUser) -> None:
    with fiberd_in_thread(site, state_dir=str(state), grantdir=str(site.grantdir),
                          allowed_uids=alice.name):
        sock = state / "fiberd.sock"
        before = (state / "audit.jsonl").stat().st_size
        out = subprocess.run(["/usr/bin/python3", "-c", FLOOD, str(sock), str(ATTEMPTS)],
                             capture_output=True, text=True, timeout=300, check=True,
                             **mallory.spawn_args())
        assert int(out.stdout) == ATTEMPTS
        grown = (state / "audit.jsonl").stat().st_size - before
        assert grown < 10_000, f"{ATTEMPTS} refusals grew the audit log by {grown} bytes"
    records = [json.loads(line) for line in (state / "audit.jsonl").read_text().splitlines()]
    denials = [r for r in records if r["event"] == "api_refuse" and r["code"] == "forbidden"]
    assert all(r["caller_uid"] == mallory.uid for r in denials)
    assert len(denials) <= 3, denials
    # Every refusal is accounted for: one whole record, the rest counted (at the stop).
    assert sum(r.get("repeated", 1) for r in denials) == ATTEMPTS
    assert records[-1]["event"] == "stop"
