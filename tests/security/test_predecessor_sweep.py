"""A SIGKILLed fiberd's leftovers: the next fiberd sweeps its cgroup tree and its "ready".

A SIGKILLed fiberd leaves its ``slurm-fiber.<pid>`` cgroup tree behind, and
what runs in it outlives fiberd when its template cannot act on its death
signal: a job user stops their template (SIGSTOP) before fiberd is killed,
and the template, its spare and its fiber keep living in the dead fiberd's
tree. Its ``ready.json`` keeps saying ready. The next fiberd (real processes, the real
cgroup2 hierarchy, delegated from its root) must kill and remove that tree,
touch no tree whose owner lives or whose name is not fiberd's, publish "not
ready", and say so in its start record.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from slurm_fiber.client.connection import FiberdClient, Unreachable
from slurm_fiber.core.cgroups.v1 import V1Layout
from tests.cli.commandkit import PROCESSES, fiberd, wait_ready, wait_socket
from tests.core.processkit import UNIFIED, cgroup2_usable, marked_procs, unified_cgroup, wait_marked
from tests.core.runtime.fiberdkit import Site

DELEGATE = {"cgroup-root": "delegate"}


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path, uuid.uuid4().hex)


def serving(site: Site, proc: subprocess.Popen[str], within: float = 30.0) -> None:
    """Wait until ``proc`` (not a predecessor's stale socket) answers on the site's socket."""
    end = time.monotonic() + within
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            with FiberdClient(site.state / "fiberd.sock", timeout=5) as client:
                if client.request("status")["pid"] == proc.pid:
                    return
        except (Unreachable, OSError):
            pass
        assert time.monotonic() < end, "the new fiberd did not answer in time"
        time.sleep(0.05)


def start_record(site: Site, pid: int) -> dict[str, object]:
    for line in (site.state / "audit.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["event"] == "start" and record["pid"] == pid:
            return record
    raise AssertionError(f"no start record of fiberd {pid}")


@pytest.mark.machine_may_lack("a writable cgroup2 hierarchy")
def test_the_next_fiberd_sweeps_a_sigkilled_ones_cgroup_tree_and_readiness(site: Site) -> None:
    if not cgroup2_usable():
        pytest.skip(f"no writable cgroup2 hierarchy at {UNIFIED}")
    if unified_cgroup(os.getpid()) != "/":
        pytest.skip("fiberd delegates slurm-fiber.<pid> only from the hierarchy's root")
    site.drop()
    with fiberd(site, DELEGATE, stderr=subprocess.DEVNULL) as first:
        wait_ready(wait_socket(site, first))
        tree = UNIFIED / f"slurm-fiber.{first.pid}"
        with FiberdClient(site.state / "fiberd.sock") as client:
            fiber = client.clone(grant="g1", exec={"argv": ["sleep", "300"]})
            (grant,) = client.request("list_grants")["grants"]
        template = int(grant["template"]["pid"])
        # The template, its spares and the fiber (commandkit.PROCESSES).
        assert len(wait_marked(site.mark, PROCESSES)) == PROCESSES
        os.kill(template, signal.SIGSTOP)
        first.kill()
        first.wait(10)
    time.sleep(0.5)  # a template that could act on its death signal would have by now
    left = marked_procs(site.mark)  # the spares went (order channels closed); not these:
    assert {template, int(fiber["pid"])} <= set(left)
    in_tree = {int(p) for procs in tree.rglob("cgroup.procs") for p in procs.read_text().split()}
    assert set(left) <= in_tree
    assert json.loads((site.state / "ready.json").read_text())["ready"] is True
    # Its cgroup v1 groups (the hybrid backend's limits and devices), where the host has them.
    v1_trees = [root for c in ("memory", "pids", "cpu", "devices")
                if (root := V1Layout.of_self().root(c, tree.name)) is not None]
    assert all(t.is_dir() for t in v1_trees), v1_trees

    # Trees the sweep must not touch: a live owner's, and one not named like fiberd's.
    keeper = subprocess.Popen(["sleep", "300"])
    live_tree = UNIFIED / f"slurm-fiber.{keeper.pid}"
    other = UNIFIED / f"sf-sweep-test.{first.pid}"
    try:
        live_tree.mkdir()
        other.mkdir()
        site.remove()  # no grant: nothing of the new fiberd is warm, so it is not ready
        with fiberd(site, DELEGATE, stderr=subprocess.DEVNULL) as second:
            serving(site, second)
            assert not tree.exists()
            assert marked_procs(site.mark) == []
            assert json.loads((site.state / "ready.json").read_text())["ready"] is False
            assert live_tree.is_dir() and other.is_dir()
            record = start_record(site, second.pid)
            swept, *mirrors = record["swept_trees"]  # type: ignore[misc]
            assert swept["path"] == str(tree) and swept["owner_pid"] == first.pid
            assert sorted(m["path"] for m in mirrors) == sorted(map(str, v1_trees))
            assert all(m["removed"] and not m["killed"] for m in mirrors), mirrors
            assert not any(t.exists() for t in v1_trees)
            assert set(left) <= set(swept["killed"]) and swept["removed"] is True
            assert str(record["readiness"]).startswith("not ready")
    finally:
        keeper.kill()
        keeper.wait()
        for path in (live_tree, other):
            if path.exists():
                path.rmdir()
