"""What is not enforced is said, and ``--strict-limits`` refuses it (real fiberd processes).

A grant asking for memory, pids or cpu limits on a host whose cgroup v2 lacks
those controllers (or with no cgroup at all) used to run with none, and
neither status, list_grants nor the audit log said so; devices are confined
by environment variables only, and nothing said that either. A job user
relying on a limit (or a site relying on it against that user) was misled.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from slurm_fiber.client.connection import FiberdClient, Missed
from slurm_fiber.core.cgroups.v1 import V1Layout
from tests.cli.commandkit import BIN, fiberd, wait_ready, wait_socket
from tests.core.processkit import UNIFIED, cgroup2_usable
from tests.core.runtime.fiberdkit import Site

CGROUP_LIMITS = ("memory", "pids", "cpu")
ASKS = {"memory": 256 << 20, "pids": 64, "cpu": 0.5, "seconds": 600.0, "fibers": 4}
ENV_ONLY = "env only"


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path, uuid.uuid4().hex)


def audit(site: Site, event: str) -> list[dict[str, object]]:
    lines = (site.state / "audit.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def request(sock: Path, op: str) -> dict[str, object]:
    with FiberdClient(sock) as client:
        return client.request(op)


def offered_v2() -> set[str]:
    """The controllers this host's cgroup v2 can give a delegated subtree."""
    return set((UNIFIED / "cgroup.controllers").read_text().split())


def kernel_facts(carved: bool, backend: str) -> tuple[dict[str, str | None], str]:
    """What this host enforces each cgroup limit with, and devices, for a carving fiberd on
    ``backend``: a v1 hierarchy where it has one (unless v2 is asked for), else cgroup v2
    where its tree offers the controller, else nothing."""
    if not carved:
        return {n: None for n in CGROUP_LIMITS}, ENV_ONLY
    v1 = set(V1Layout.of_self().mounts) if backend != "v2" else set()
    offered = offered_v2()
    kernel = {n: f"cgroup v1 {n}" if n in v1 else "cgroup v2" if n in offered else None
              for n in CGROUP_LIMITS}
    return kernel, "cgroup v1 devices" if "devices" in v1 else ENV_ONLY


def check_record(record: dict[str, object], kernel: dict[str, str | None],
                 devices: str = ENV_ONLY) -> None:
    """A grant's enforcement record: ``kernel`` names what enforces each cgroup limit."""
    limits = record["limits"]
    assert isinstance(limits, dict)
    for name, value in ASKS.items():
        entry = limits[name]
        assert entry["asked"] == value
        by = kernel[name] if name in CGROUP_LIMITS else "fiberd"
        assert entry["enforced_by"] == by, (name, entry)
        if by is None:
            assert name in str(entry["not_enforced"]) or "no cgroup" in entry["not_enforced"]
    assert record["unenforced"] == [n for n in CGROUP_LIMITS if kernel[n] is None]
    assert record["devices"]["confined_by"] == devices  # type: ignore[index]


@pytest.mark.parametrize(("cgroup_root", "backend"),
                         [("none", "auto"), ("delegate", "auto"), ("delegate", "v2")])
def test_status_list_grants_and_the_admit_record_say_which_limits_are_enforced(
    site: Site, cgroup_root: str, backend: str
) -> None:
    if cgroup_root == "delegate" and not cgroup2_usable():
        pytest.skip(f"no writable cgroup2 hierarchy at {UNIFIED}")
    site.drop(**ASKS)  # type: ignore[arg-type]
    options = {"cgroup-root": cgroup_root, "cgroup-backend": backend}
    with fiberd(site, options, stderr=subprocess.DEVNULL) as proc:
        sock = wait_socket(site, proc)
        wait_ready(sock)
        status = request(sock, "status")
        carved = status["mode"] == "carved"
        assert carved is (cgroup_root == "delegate")
        kernel, devices = kernel_facts(carved, backend)
        enforcement = status["enforcement"]
        assert isinstance(enforcement, dict) and enforcement["strict_limits"] is False
        check_record(enforcement["grants"]["g1"], kernel, devices)
        host = enforcement["host"]
        assert host["devices"]["confined_by"] == devices
        assert host["unenforced"] == [n for n in CGROUP_LIMITS if kernel[n] is None]
        (grant,) = request(sock, "list_grants")["grants"]  # type: ignore[misc]
        check_record(grant["enforcement"], kernel, devices)
        shown = subprocess.run([str(BIN / "fiberctl"), "status", "--socket", str(sock)],
                               capture_output=True, text=True, timeout=60, check=True).stdout
        (line,) = [x for x in shown.splitlines() if x.startswith("status.enforcement.grants.g1")]
        for name in CGROUP_LIMITS:
            assert (f"{name} NOT enforced (" in line) is (kernel[name] is None), line
        assert "seconds by fiberd" in line and line.endswith(f"devices: {devices}")
        (backend_line,) = [x for x in shown.splitlines() if x.startswith("status.cgroups.enforced")]
        assert ("devices: v1" in backend_line) is (devices != ENV_ONLY), backend_line
    (admit,) = audit(site, "admit")
    check_record(admit["enforcement"], kernel, devices)  # type: ignore[arg-type]


def test_strict_limits_refuses_a_grant_whose_limits_are_not_enforced(site: Site) -> None:
    # The host facts: uncarved, nothing keeps memory or pids (carved on v1 or hybrid, this
    # host would: test_kernel_limits).
    site.drop(memory=256 << 20)
    inline = site.token("g2", pids=16)
    with fiberd(site, {"strict-limits": None, "cgroup-root": "none"},
                stderr=subprocess.DEVNULL) as proc:
        sock = wait_socket(site, proc)
        assert request(sock, "status")["enforcement"]["strict_limits"] is True  # type: ignore[index]
        for fields in ({}, {"grant": "g1"}, {"token": inline}):
            with FiberdClient(sock) as client, pytest.raises(Missed) as missed:
                client.clone(exec={"argv": ["true"]}, **fields)
            miss = missed.value
            assert miss.code == "unenforceable" and not miss.retryable, (fields, miss)
        assert "memory" in missed_reason(sock, "g1") and "pids" in miss.reason
        # A grant whose limits fiberd keeps itself (fibers, seconds) runs under strict limits.
        site.drop("g3", fibers=2, seconds=60)
        wait_ready(sock)
        with FiberdClient(sock) as client:
            assert client.clone(grant="g3", exec={"argv": ["true"]})["grant"] == "g3"
    refusals = {r["uid"]: r for r in audit(site, "refuse") if r["code"] == "unenforceable"}
    assert set(refusals) == {"g1", "g2"}
    assert refusals["g1"]["enforcement"]["unenforced"] == ["memory"]  # type: ignore[index]
    assert "memory" in str(refusals["g1"]["reason"])
    assert {r["uid"] for r in audit(site, "admit")} == {"g3"}


def missed_reason(sock: Path, grant: str) -> str:
    with FiberdClient(sock) as client, pytest.raises(Missed) as missed:
        client.clone(grant=grant, exec={"argv": ["true"]})
    return missed.value.reason
