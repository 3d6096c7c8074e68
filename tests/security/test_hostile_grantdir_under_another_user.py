"""Finding (issue 38, low): a root fiberd accepted a grantdir another user could change.

The grantdir itself was checked (root's, not writable by others), its path was not: in a
directory ``mallory`` owns, she renames the root-owned grantdir away (every grant is
withdrawn) or puts a link to another directory in its place between two polls. A
grantdir below a directory, or through a symlink, anyone but fiberd's uid and root can
change is now refused as any untrusted grantdir is: a problem naming the path, audited,
and no grant delivered from it (homes/grantdir.py). A real root ``fiberd`` process.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.client.connection import FiberdClient
from tests.cli.commandkit import fiberd, wait_socket
from tests.core.runtime.fiberdkit import Site
from tests.security.publicdirkit import public_dir
from tests.security.userkit import JobUser


@pytest.fixture
def scratch() -> Iterator[Path]:
    with public_dir() as path:
        yield path


def test_hostile_grantdir_under_another_users_directory_is_refused(
        tmp_path: Path, scratch: Path, mallory: JobUser) -> None:
    site = Site(tmp_path, uuid.uuid4().hex)
    hers = scratch / "mallory"
    hers.mkdir()
    os.chown(hers, mallory.uid, mallory.gid)  # her directory ...
    grants = hers / "grants"
    grants.mkdir(mode=0o700)  # ... holding root's grantdir, which she can rename away
    tmp = grants / ".g1.tmp"
    tmp.write_text(site.token("g1"))
    tmp.rename(grants / "g1.jwt")  # a valid grant, root's, as the site placed it
    with fiberd(site, {"grantdir": str(grants)}, stderr=subprocess.DEVNULL) as proc:
        sock = wait_socket(site, proc)
        end = time.monotonic() + 30
        while not (problems := [r for r in audit(site) if r["event"] == "problem"]):
            assert time.monotonic() < end, "the grantdir was never refused"
            time.sleep(0.05)
        time.sleep(1)  # twenty polls: an accepted grantdir would have delivered g1
        with FiberdClient(sock) as client:
            assert client.request("list_grants")["grants"] == []
    (problem, *_) = problems
    assert problem["code"] == "grantdir_path", problem
    assert str(hers) in problem["reason"] and "could be replaced" in problem["reason"]
    assert not [r for r in audit(site) if r["event"] == "admit"]


def audit(site: Site) -> list[dict[str, object]]:
    lines = (site.state / "audit.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]
