"""The cgroup manager: limit logic on a fake tree, carving and killing on the real one."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_fiber.core.cgroups.common import LimitOutcome, limit_plan, safe_name, wait_empty
from slurm_fiber.core.cgroups.common import pids as cgroup_pids
from slurm_fiber.core.cgroups.common import populated as cgroup_populated
from slurm_fiber.core.cgroups.devices import device_rules
from slurm_fiber.core.cgroups.enforcement import grant_enforcement
from slurm_fiber.core.cgroups.groups import kill as cgroup_kill
from slurm_fiber.core.cgroups.groups import mkdir, mkdir_group, remove_tree
from slurm_fiber.core.cgroups.manager import CgroupManager
from slurm_fiber.core.cgroups.v1 import V1Layout, mirrors
from slurm_fiber.core.cgroups.v2 import enable_controllers, write_limits
from slurm_fiber.core.trust.grant import Limits
from tests.core.processkit import cgroup_dirs, v1_usable

NEEDS_CGROUP2 = pytest.mark.machine_may_lack("a writable cgroup2 hierarchy")


def fake_cgroup(path: Path, offered: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cgroup.controllers").write_text(offered + "\n")
    (path / "cgroup.subtree_control").write_text("")
    return path


# ---------------------------------------------------------------- fake tree


def test_limits_written_where_controller_enabled_and_reported_where_not(tmp_path: Path):
    grant = fake_cgroup(tmp_path / "grant-a", "memory cpu")
    out = write_limits(grant, Limits(memory=512 << 20, pids=64, cpu=1.5))
    by_file = {o.file: o for o in out}
    assert (grant / "memory.max").read_text() == f"{512 << 20}\n"
    assert (grant / "cpu.max").read_text() == "150000 100000\n"
    assert by_file["memory.max"].enforced and by_file["cpu.max"].enforced
    assert not (grant / "pids.max").exists()
    assert not by_file["pids.max"].enforced
    assert by_file["pids.max"].reason.startswith("not enforced: the pids controller")


def test_refused_write_is_reported_not_raised(tmp_path: Path):
    grant = fake_cgroup(tmp_path / "g", "memory")
    (grant / "memory.max").mkdir()  # writing it fails like a kernel refusal would
    (out,) = write_limits(grant, Limits(memory=1 << 20))
    assert not out.enforced
    assert out.reason.startswith("not enforced: writing memory.max failed")


def test_unset_limits_write_nothing(tmp_path: Path):
    grant = fake_cgroup(tmp_path / "g", "memory pids cpu")
    assert write_limits(grant, Limits()) == ()
    assert sorted(p.name for p in grant.iterdir()) == ["cgroup.controllers",
                                                       "cgroup.subtree_control"]


def test_tiny_cpu_share_is_clamped_to_a_valid_quota():
    assert limit_plan(Limits(cpu=0.001)) == [("cpu", "cpu.max", "1000 100000")]


def test_enable_controllers_only_enables_offered_ones(tmp_path: Path):
    root = fake_cgroup(tmp_path / "root", "pids memory hugetlb")
    assert enable_controllers(root) == {"pids", "memory"}


def test_safe_name_keeps_plain_uids_and_separates_the_rest():
    assert safe_name("job-42.a_b") == "job-42.a_b"
    a, b = safe_name("user@site:1"), safe_name("user_site_1")
    assert a != b and "/" not in a and a.startswith("user_site_1-")


@pytest.mark.parametrize("root", [None, Path("/nonexistent/cg"), Path("/tmp")])
def test_unusable_root_means_uncarved_with_a_reason(root):
    mgr = CgroupManager(root)
    assert not mgr.status.carved
    assert "running uncarved" in mgr.status.reason
    assert mgr.carve_grant("u", Limits(memory=1)) is None
    assert asyncio.run(mgr.sweep()) == []


# ---------------------------------------------------------------- real hierarchy


def _sleeper(cgroup: Path) -> subprocess.Popen[bytes]:
    code = "import sys,time; open(sys.argv[1]+'/cgroup.procs','w').write('0'); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code, str(cgroup)])
    for _ in range(200):
        if cgroup_populated(cgroup):
            break
        proc.poll()
        asyncio.run(asyncio.sleep(0.01))
    return proc


@NEEDS_CGROUP2
def test_carve_join_kill_wait_remove(cgroup_root: Path):
    mgr = CgroupManager(cgroup_root)
    assert mgr.status.carved
    grant = mgr.carve_grant("u:1", Limits(memory=1 << 30, pids=10))
    assert grant is not None and grant.template.is_dir()
    # This machine offers no memory/pids controller: both limits reported, none enforced.
    assert [o.enforced for o in grant.limits] == [False, False]
    leaf = grant.slot("f1")
    leaf.mkdir(parents=True)
    proc = _sleeper(leaf)
    assert cgroup_populated(leaf) and cgroup_pids(grant.path) == [proc.pid]
    cgroup_kill(leaf)
    asyncio.run(wait_empty(leaf))
    assert proc.wait(timeout=10) == -9
    asyncio.run(mgr.remove_grant("u:1"))
    assert cgroup_dirs(cgroup_root) == []


@NEEDS_CGROUP2
def test_sweep_removes_a_dead_fiberds_cgroups_and_their_processes(cgroup_root: Path):
    old = CgroupManager(cgroup_root)
    for uid in ("a", "b"):
        grant = old.carve_grant(uid, Limits())
        assert grant is not None
        grant.slot("x").mkdir(parents=True)
    straggler = _sleeper(cgroup_root / "grant-a" / "fibers" / "group-0" / "slot-x")
    removed = asyncio.run(CgroupManager(cgroup_root).sweep())
    assert [p.name for p in removed] == ["grant-a", "grant-b"]
    assert straggler.wait(timeout=10) == -9
    assert cgroup_dirs(cgroup_root) == []


@NEEDS_CGROUP2
def test_wait_empty_returns_for_an_empty_or_vanished_cgroup(cgroup_root: Path):
    asyncio.run(wait_empty(cgroup_root / "never-made"))
    (cgroup_root / "empty").mkdir()
    asyncio.run(wait_empty(cgroup_root / "empty"))
    remove_tree(cgroup_root / "empty")
    assert not (cgroup_root / "empty").exists()


# ---------------------------------------------------------------- enforcement records


def fake_root(tmp_path: Path, offered: str) -> Path:
    root = fake_cgroup(tmp_path / "root", offered)
    (root / "cgroup.procs").write_text("")
    return root


def test_predict_says_what_carving_will_enforce_without_carving(tmp_path: Path):
    mgr = CgroupManager(fake_root(tmp_path, "memory hugetlb"))
    assert mgr.carved
    limits = Limits(memory=1 << 30, pids=8, cpu=2.0)
    predicted = mgr.predict(limits)
    assert predicted is not None
    assert [(o.limit, o.enforced) for o in predicted] == [
        ("memory", True), ("pids", False), ("cpu", False)]
    assert predicted[1].reason.endswith(
        f"the pids controller is not available to {mgr.root} (its cgroup v2 offers: "
        "hugetlb memory)")
    assert not mgr.grant_path("u").exists()  # nothing carved
    assert CgroupManager(None).predict(limits) is None


def test_a_grant_record_names_what_enforces_each_limit_and_why_not():
    limits = Limits(memory=1 << 20, pids=4, seconds=30.0)
    written = (LimitOutcome("memory.max", "1048576", True),
               LimitOutcome("pids.max", "4", False,
                                    "not enforced: the pids controller is not enabled for /g"))
    record = grant_enforcement(limits, written, backend="cgroup v2", uncarved_reason="-")
    assert record.outcome() == (("memory", "cgroup v2"), ("pids", None), ("cpu", None),
                                ("seconds", "fiberd"), ("fibers", None))
    assert [e.limit for e in record.unenforced()] == ["pids"]
    assert record.to_json()["limits"]["pids"] == {  # type: ignore[index]
        "asked": 4, "enforced_by": None,
        "not_enforced": "the pids controller is not enabled for /g"}
    assert record.devices.by == "env only"
    refusal = record.refusal("g")
    assert refusal is not None and "(pids)" in refusal and "not enabled for /g" in refusal
    assert record.summary() == ("enforced: memory (cgroup v2), seconds (fiberd); "
                                "NOT enforced: pids; devices: env only")
    uncarved = grant_enforcement(limits, None, backend="cgroup v2", uncarved_reason="no root")
    assert [(e.limit, e.reason) for e in uncarved.unenforced()] == [
        ("memory", "no root"), ("pids", "no root")]
    assert grant_enforcement(Limits(fibers=2), None, backend="x",
                             uncarved_reason="-").refusal("g") is None


# ---------------------------------------------------------------- cgroup v1 and hybrid

MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""


def test_v1_layout_reads_mounts_and_own_cgroups():
    layout = V1Layout.parse(MOUNTINFO, "4:memory:/job_7/step_0\n2:cpu,cpuacct:/\n0::/\n")
    assert layout.mounts == {"rw": Path("/sys/fs/cgroup/cpu,cpuacct"),
                             "cpu": Path("/sys/fs/cgroup/cpu,cpuacct"),
                             "cpuacct": Path("/sys/fs/cgroup/cpu,cpuacct"),
                             "memory": Path("/sys/fs/cgroup/memory")}
    assert layout.root("memory", "slurm-fiber.9") == Path(
        "/sys/fs/cgroup/memory/job_7/step_0/slurm-fiber.9")
    assert layout.root("cpu", "x") == Path("/sys/fs/cgroup/cpu,cpuacct/x")
    assert layout.root("pids", "x") is None


def test_a_device_without_a_node_path_cannot_be_confined(tmp_path: Path):
    from slurm_fiber.core.devices import Device

    rules, why = device_rules([Device("gpu", 0)])
    assert rules == () and why == "gpu 0 has no device node path to allow"
    plain = tmp_path / "plain"
    plain.write_text("")
    not_a_node = device_rules([Device("gpu", 1, str(plain))])[1]
    assert not_a_node == f"{plain} is not a device node"
    assert device_rules([Device("gpu", 2, "/dev/null")]) == (("c 1:3 rwm",), None)


V1 = V1Layout.of_self()
NEEDS_V1 = pytest.mark.skipif(not {"memory", "pids", "cpu", "devices"} <= set(V1.mounts),
                              reason="cgroup v1 memory, pids, cpu and devices hierarchies")


@NEEDS_V1
def test_hybrid_writes_and_reads_back_v1_limits_and_devices_and_removes_every_mirror(
        cgroup_root: Path):
    mgr = CgroupManager(cgroup_root, backend="hybrid")
    assert mgr.mode == "hybrid" and mgr.confines_devices
    # Named slurm-fiber.<pid> in every v1 hierarchy, whatever the v2 root's name.
    v1 = {c: V1.root(c, f"slurm-fiber.{os.getpid()}") for c in ("memory", "pids", "cpu",
                                                                 "devices")}
    assert mgr.v1_roots == v1
    try:
        grant = mgr.carve_grant("u:1", Limits(memory=64 << 20, pids=10, cpu=0.5))
        assert grant is not None
        assert [(o.limit, o.enforced, o.backend) for o in grant.limits] == [
            ("memory", True, "cgroup v1 memory"), ("pids", True, "cgroup v1 pids"),
            ("cpu", True, "cgroup v1 cpu")]
        name = grant.path.name
        assert int((v1["memory"] / name / "memory.limit_in_bytes").read_text()) == 64 << 20
        assert (v1["pids"] / name / "pids.max").read_text() == "10\n"
        assert (v1["cpu"] / name / "cpu.cfs_quota_us").read_text() == "50000\n"
        listed = (v1["devices"] / name / "devices.list").read_text().split("\n")
        assert "a *:* rwm" not in listed and "c 1:3 rwm" in listed
        assert grant.devices is not None and grant.devices.confined
        leaf = grant.slot("f1")
        mkdir_group(leaf.parent)
        mkdir(leaf)
        # No cpu mirror under fibers: a fiber stays in its template's cpu group.
        assert mirrors(leaf) == tuple(v1[c] / name / "fibers" / "group-0" / "slot-f1"
                                              for c in v1 if c != "cpu")
        assert mirrors(leaf.parent) == tuple(v1[c] / name / "fibers" / "group-0"
                                                     for c in v1 if c != "cpu")
        assert mirrors(grant.template) == tuple(v1[c] / name / "template" for c in v1)
        assert all(m.is_dir() for m in mirrors(leaf))
        assert not (v1["cpu"] / name / "fibers").exists()
        asyncio.run(mgr.remove_grant("u:1"))
        assert not any((v1[c] / name).exists() for c in v1)
    finally:
        assert mgr.close() == []
    assert not any(path.exists() for path in v1.values())


@pytest.mark.skipif(not v1_usable("devices"), reason="a writable cgroup v1 devices hierarchy")
def test_kill_ends_the_processes_of_a_v1_group_that_has_no_cgroup_kill() -> None:
    """A v1 hierarchy but the freezer (here devices, as the epilog meets Slurm's) has no
    cgroup.kill, and creating one is refused: each listed process is signalled instead."""
    group = V1.root("devices", f"sf-kill-{os.getpid()}") / "job"
    group.mkdir(parents=True)
    proc = subprocess.Popen(["sleep", "300"])
    try:
        (group / "cgroup.procs").write_text(f"{proc.pid}\n")
        cgroup_kill(group)
        assert proc.wait(10) == -signal.SIGKILL
        assert not (group / "cgroup.kill").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        group.rmdir()
        group.parent.rmdir()
    cgroup_kill(group)  # gone: not an error


@pytest.mark.skipif(not v1_usable("devices"), reason="a writable cgroup v1 devices hierarchy")
def test_a_v1_tree_is_populated_by_a_process_in_any_group_below() -> None:
    """v1 has no cgroup.events: ``populated`` and ``pids`` read each group's cgroup.procs,
    down the tree (a fiber's child may have made sub-groups)."""
    top = V1.root("devices", f"sf-populated-{os.getpid()}")
    deep, empty = top / "leaf" / "sub", top / "other"
    deep.mkdir(parents=True)
    empty.mkdir()
    proc = subprocess.Popen(["sleep", "300"])
    try:
        assert not cgroup_populated(top) and cgroup_pids(top) == []
        (deep / "cgroup.procs").write_text(f"{proc.pid}\n")
        assert cgroup_populated(top) and cgroup_populated(top / "leaf")
        assert not cgroup_populated(empty)
        assert cgroup_pids(top) == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
        for group in (deep, deep.parent, empty, top):
            group.rmdir()
    assert not cgroup_populated(top) and cgroup_pids(top) == []  # gone


def test_hybrid_without_v1_groups_it_may_create_stays_v2_and_says_why(tmp_path: Path):
    """A job user's fiberd: the v1 hierarchies are root's, so no v1 group can be made."""
    root = fake_root(tmp_path, "memory")
    nowhere = tmp_path / "missing-mount"
    layout = V1Layout({"pids": nowhere, "devices": nowhere}, {})
    mgr = CgroupManager(root, backend="hybrid", v1=layout)
    assert mgr.carved and mgr.mode == "v2" and mgr.v1_roots == {}
    assert f"no cgroup v1 groups (cannot create {nowhere}/slurm-fiber." in mgr.status.reason
    assert not mgr.confines_devices
    assert [(o.limit, o.enforced, o.backend) for o in mgr.predict(Limits(memory=1, pids=1))
            or ()] == [("memory", True, ""), ("pids", False, "")]
    auto = CgroupManager(root, backend="auto", v1=layout)
    assert auto.mode == "v2" and mgr.describe().startswith("v2: stop by cgroup v2 cgroup.kill")
