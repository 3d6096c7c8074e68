"""Control files read through kept descriptors (core/held_files.py), on the real cgroup2 tree:
a kept descriptor reads what is there now; a group removed, or made again by the same
name, is opened afresh; the table keeps a bounded number of groups and forgets a removed
one; ``remove_tree`` forgets what it removes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_fiber.core.cgroups.common import join
from slurm_fiber.core.cgroups.common import populated as cgroup_populated
from slurm_fiber.core.cgroups.groups import kill, remove_tree
from slurm_fiber.core.cgroups.held_files import HeldFiles

pytestmark = pytest.mark.machine_may_lack("a writable cgroup2 hierarchy")


def held_paths() -> list[str]:
    """The cgroup files this process holds open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own, closed by now
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
    return sorted(p for p in found if p.startswith("/sys/fs/cgroup/"))


def test_a_kept_descriptor_reads_the_file_as_it_is_now(cgroup_root: Path) -> None:
    held = HeldFiles()
    group = cgroup_root / "leaf"
    group.mkdir()
    assert "populated 0" in held.read(str(group), "cgroup.events")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        join(group, sleeper.pid)
        assert "populated 1" in held.read(str(group), "cgroup.events")
        assert held_paths() == [f"{group}/cgroup.events"]  # one descriptor, read twice
    finally:
        sleeper.kill()
        sleeper.wait()
    kill(group)
    held.close()
    assert held_paths() == []


def test_a_group_removed_or_made_again_is_opened_afresh(cgroup_root: Path) -> None:
    held = HeldFiles()
    group = cgroup_root / "leaf"
    group.mkdir()
    held.read(str(group), "cgroup.events")
    group.rmdir()
    with pytest.raises(FileNotFoundError):
        held.read(str(group), "cgroup.events")
    group.mkdir()  # made again by the same name: the old descriptor would say ENODEV
    assert "populated 0" in held.read(str(group), "cgroup.events")
    held.close()


def test_the_table_keeps_a_bounded_number_of_groups_and_forgets_a_removed_one(
        cgroup_root: Path) -> None:
    held = HeldFiles(groups=2)
    a, b, c = (cgroup_root / n for n in "abc")
    for group in (a, b, c):
        group.mkdir()
        held.read(str(group), "cgroup.events")
        held.read(str(group), "cgroup.type")
    assert held_paths() == sorted(f"{g}/{n}" for g in (b, c)
                                  for n in ("cgroup.events", "cgroup.type"))
    held.forget(str(c))
    assert held_paths() == [f"{b}/cgroup.events", f"{b}/cgroup.type"]
    held.close()
    assert held_paths() == []


def test_remove_tree_forgets_the_groups_it_removes(cgroup_root: Path) -> None:
    leaf = cgroup_root / "leaf"
    (leaf / "inner").mkdir(parents=True)
    assert not cgroup_populated(leaf) and not cgroup_populated(leaf / "inner")
    assert f"{leaf}/cgroup.events" in held_paths()
    remove_tree(leaf)
    assert not leaf.exists()
    assert [p for p in held_paths() if p.startswith(str(leaf))] == []
