"""Fixtures of the hostile tests (marker ``hostile``): two real unprivileged job users
and ``public``, a sticky dir like /tmp that both can add names to.

Every test here reproduces an attack a job user on a shared node could make
(docs/design.md, threat model) and checks that it is refused or survived.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.security.userkit import ALICE, MALLORY, JobUser, job_user


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/security/" in str(item.path):
            item.add_marker(pytest.mark.hostile)


@pytest.fixture(scope="session")
def mallory() -> JobUser:
    """The hostile job user."""
    if os.geteuid() != 0:
        pytest.skip("creating job users needs root")
    return job_user(MALLORY)


@pytest.fixture(scope="session")
def alice() -> JobUser:
    """Another job user on the same node: the victim."""
    if os.geteuid() != 0:
        pytest.skip("creating job users needs root")
    return job_user(ALICE)


@pytest.fixture
def public() -> Iterator[Path]:
    """A root-owned sticky dir every user can add names to, like /tmp (under a fresh
    root-owned 0755 dir, so paths are unique and cleaned up)."""
    top = Path(tempfile.mkdtemp(prefix="sf-statedir-", dir="/tmp"))
    top.chmod(0o755)
    pub = top / "pub"
    pub.mkdir()
    pub.chmod(0o1777)
    yield pub
    shutil.rmtree(top)
