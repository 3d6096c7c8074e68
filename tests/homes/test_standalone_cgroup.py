"""cgroup delegation: parsing /proc, and delegation on the real cgroup v2 hierarchy.

Delegation moves the calling process, so it runs in a child process the test
places in a cgroup of its own; the test runner is never moved. Everything
the test creates is removed afterwards.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.homes.cgroupdelegate import (
    PROC_MOUNTINFO,
    SELF_LEAF,
    delegate,
    own_cgroup,
    unified_mount,
)
from slurm_fiber.homes.standalone import StandaloneHome

MOUNTINFO_V2 = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    "41 31 0:38 / /sys/fs/cgroup/unified\\040dir rw,relatime - cgroup2 cgroup2 rw\n"
)
MOUNTINFO_V1 = "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"

CHILD = """
import json, sys
from slurm_fiber.core.clock import SystemClock
from slurm_fiber.homes.standalone import StandaloneHome

def where():
    return open("/proc/self/cgroup").read().split("0::", 1)[1].split()[0]

sys.stdin.readline()  # placed by the test
home = StandaloneHome("/nonexistent", SystemClock(), cgroup="delegate")
print(json.dumps({"root": home.cgroup_root(), "reason": home.cgroup_reason(),
                  "cgroup": where()}), flush=True)
sys.stdin.readline()
print(json.dumps({"failures": home.close(), "cgroup": where()}), flush=True)
"""


def test_the_unified_mount_and_own_cgroup_are_read_from_proc_texts() -> None:
    assert unified_mount(MOUNTINFO_V2) == ("/sys/fs/cgroup/unified dir", "/")
    assert unified_mount(MOUNTINFO_V1) is None
    assert own_cgroup("4:memory:/x\n0::/a/b\n") == "/a/b"
    assert own_cgroup("4:memory:/x\n") is None


def test_no_usable_cgroup_v2_gives_none_with_a_reason() -> None:
    assert delegate(MOUNTINFO_V1, "0::/\n").reason == "no cgroup v2 (unified) hierarchy is mounted"
    v1_only = delegate(MOUNTINFO_V2, "4:memory:/x\n")
    assert v1_only.root is None and "cgroup v1 only" in v1_only.reason
    jailed = MOUNTINFO_V2.replace(" / /sys/fs/cgroup/unified", " /jail /sys/fs/cgroup/unified")
    outside = delegate(jailed, "0::/elsewhere\n")
    assert outside.root is None and "outside the mounted hierarchy" in outside.reason


REAL = pytest.mark.machine_may_lack("needs a writable cgroup v2 hierarchy")


def _mount() -> str:
    with open(PROC_MOUNTINFO) as f:
        found = unified_mount(f.read())
    if found is None or not os.access(found[0], os.W_OK):
        pytest.skip("no writable cgroup v2 hierarchy on this machine")
    return found[0]


@pytest.fixture
def mount() -> str:
    return _mount()


@pytest.fixture
def test_cgroup(mount: str) -> Iterator[Path]:
    """A cgroup of the test's own, standing for the one systemd would delegate."""
    path = Path(mount) / f"slurm-fiber-test.{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield path
    for below, _, _ in sorted(os.walk(path), key=lambda entry: -len(entry[0])):
        os.rmdir(below)  # cgroup directories go with rmdir, their files with them


class Child:
    """A Python child process running CHILD, which waits for the test between steps."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )

    def place(self, cgroup: Path | str) -> None:
        (Path(cgroup) / "cgroup.procs").write_text(str(self.proc.pid))

    def step(self) -> dict[str, object]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the child died"
        return json.loads(line)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def child() -> Iterator[Child]:
    c = Child()
    yield c
    c.close()


def _procs(cgroup: Path) -> list[str]:
    return (cgroup / "cgroup.procs").read_text().split()


@REAL
def test_delegation_moves_the_process_into_a_leaf_and_hands_out_its_cgroup(
    mount: str, test_cgroup: Path, child: Child
) -> None:
    child.place(test_cgroup)
    got = child.step()
    rel = "/" + str(test_cgroup.relative_to(mount))
    assert got["root"] == str(test_cgroup)
    assert got["cgroup"] == f"{rel}/{SELF_LEAF}"
    assert _procs(test_cgroup) == []  # no internal processes left in the carved root
    assert _procs(test_cgroup / SELF_LEAF) == [str(child.proc.pid)]
    undone = child.step()
    assert undone == {"failures": [], "cgroup": rel}
    assert not (test_cgroup / SELF_LEAF).exists()


@REAL
def test_a_restart_inside_its_leaf_carves_the_same_parent_and_moves_nothing(
    mount: str, test_cgroup: Path, child: Child
) -> None:
    leaf = test_cgroup / SELF_LEAF
    leaf.mkdir()
    child.place(leaf)
    got = child.step()
    assert got["root"] == str(test_cgroup)
    assert got["cgroup"] == "/" + str(leaf.relative_to(mount))
    assert child.step()["failures"] == []
    assert leaf.exists()  # not delegation's to remove


@REAL
def test_in_the_hierarchy_root_it_creates_a_subtree_of_its_own(mount: str, child: Child) -> None:
    child.place(mount)
    own = Path(mount) / f"slurm-fiber.{child.proc.pid}"
    try:
        got = child.step()
        assert got["root"] == str(own)
        assert got["cgroup"] == f"/slurm-fiber.{child.proc.pid}/{SELF_LEAF}"
        assert child.step() == {"failures": [], "cgroup": "/"}
        assert not own.exists()
    finally:
        child.close()
        for path in (own / SELF_LEAF, own):
            if path.exists():
                path.rmdir()


@REAL
def test_a_configured_cgroup_v2_directory_is_used_as_given(test_cgroup: Path) -> None:
    home = StandaloneHome("/nonexistent", FakeClock(), cgroup=str(test_cgroup))
    assert home.cgroup_root() == str(test_cgroup)
    assert home.cgroup_reason() == f"cgroup_root {test_cgroup} from configuration"
    assert home.close() == []
    assert test_cgroup.exists()


IN_NAMESPACE = """
import json, sys
from slurm_fiber.homes.cgroupdelegate import resolve_cgroup_root

def where():
    return open("/proc/self/cgroup").read().split("0::", 1)[1].split()[0]

placement = resolve_cgroup_root("delegate", root_is_ours=True)
print(json.dumps({"root": placement.root, "reason": placement.reason, "cgroup": where()}),
      flush=True)
sys.stdin.readline()
print(json.dumps({"failures": placement.delegation.undo(), "cgroup": where()}), flush=True)
"""


@pytest.mark.machine_may_lack("root, unshare(1) and a writable cgroup v2 hierarchy")
def test_a_container_carves_its_cgroup_namespace_root_itself(
    mount: str, test_cgroup: Path
) -> None:
    """As in a container: a cgroup namespace rooted at the test's cgroup, cgroup2 mounted in it."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare(1)")
    script = (f"read go; exec unshare --cgroup --mount --propagation private sh -c "
              f"'umount \"$0\" && mount -t cgroup2 cgroup2 \"$0\" && exec \"$1\" -c \"$2\"' "
              f"{shlex.quote(mount)} {shlex.quote(sys.executable)} {shlex.quote(IN_NAMESPACE)}")
    proc = subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        (test_cgroup / "cgroup.procs").write_text(str(proc.pid))
        proc.stdin.write("go\n")
        proc.stdin.flush()
        got = json.loads(proc.stdout.readline())
        assert got["cgroup"] == f"/{SELF_LEAF}", "the container sees itself as / and its leaf"
        assert got["root"] == mount, "in the container's view, the root of its cgroup2 mount"
        assert got["reason"].startswith("delegated from the container's cgroup namespace root")
        assert _procs(test_cgroup) == [] and _procs(test_cgroup / SELF_LEAF) == [str(proc.pid)]
        assert [p.name for p in test_cgroup.iterdir() if p.is_dir()] == [SELF_LEAF]
        proc.stdin.write("undo\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == {"failures": [], "cgroup": "/"}
        assert _procs(test_cgroup) == [str(proc.pid)]
        assert not (test_cgroup / SELF_LEAF).exists()
    finally:
        proc.kill()
        proc.wait()
