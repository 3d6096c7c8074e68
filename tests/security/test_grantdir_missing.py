"""A grantdir missing at fiberd's start: stale health and ``source_stale`` until it appears.

Before the fix a real fiberd started without its grantdir served zero grants
forever with health fresh: every Clone got the final ``unknown_grant`` (a
client stops retrying), and a grantdir created afterwards was never read.
Now the source is stale while the directory is missing, Clones get the
retryable ``source_stale`` naming the grantdir, and once it appears its
grants load and Clones run.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from slurm_fiber.client.connection import FiberdClient, Missed
from tests.cli.commandkit import fiberd, wait_ready, wait_socket
from tests.core.runtime.fiberdkit import Site


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path, uuid.uuid4().hex)


def clone_miss(sock: Path, **fields: object) -> Missed:
    with FiberdClient(sock) as client, pytest.raises(Missed) as missed:
        client.clone(exec={"argv": ["true"]}, **fields)
    return missed.value


def test_a_grantdir_missing_at_start_is_stale_until_it_appears_then_its_grants_load(
    site: Site,
) -> None:
    shutil.rmtree(site.grantdir)
    with fiberd(site, stderr=subprocess.DEVNULL) as proc:
        sock = wait_socket(site, proc)
        with FiberdClient(sock) as client:
            health = client.request("health")
        assert health["state"] == "stale"
        assert str(site.grantdir) in str(health["source_down"])
        for fields in ({}, {"grant": "g1"}):
            miss = clone_miss(sock, **fields)
            assert miss.code == "source_stale" and miss.retryable, miss
            assert str(site.grantdir) in miss.reason

        site.grantdir.mkdir(mode=0o700)
        site.drop()
        wait_ready(sock)
        with FiberdClient(sock) as client:
            assert client.request("health")["state"] == "fresh"
            fiber = client.clone(grant="g1", exec={"argv": ["true"]})
            assert fiber["grant"] == "g1"
