"""Fixtures for runtime tests: a Site per test, marked for leak checks."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.process.conftest import cgroup_root
from tests.runtime.kit import Site

__all__ = ["cgroup_root", "site"]


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path, uuid.uuid4().hex)
