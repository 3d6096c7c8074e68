"""Fixtures for the process layer: a per-test cgroup root and a per-test process mark.

``cgroup_root`` creates ``/sys/fs/cgroup/unified/sf-test-<random>`` (the real
cgroup2 hierarchy; we are root) and removes it after the test, killing
anything left in it. Tests that use it are marked ``machine_may_lack``: a
machine without a writable cgroup2 mount truly lacks it.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.core import cgroups

UNIFIED = Path("/sys/fs/cgroup/unified")


def cgroup2_usable() -> bool:
    probe = UNIFIED / f"sf-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError:
        return False
    return (UNIFIED / "cgroup.controllers").is_file()


@pytest.fixture
def cgroup_root() -> Iterator[Path]:
    if not cgroup2_usable():
        pytest.skip(f"no writable cgroup2 hierarchy at {UNIFIED}")
    root = UNIFIED / f"sf-test-{uuid.uuid4().hex[:10]}"
    root.mkdir()
    yield root
    cgroups.kill(root)
    asyncio.run(cgroups.wait_empty(root))
    cgroups.remove_tree(root)


@pytest.fixture
def mark() -> str:
    """A unique SF_TEST_MARK value for this test's templates and fibers."""
    return uuid.uuid4().hex
