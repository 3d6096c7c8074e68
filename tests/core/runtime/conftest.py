"""Fixtures for runtime tests: a Site per test, marked for leak checks (``cgroup_root`` is
tests/core/conftest.py's)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.core.runtime.fiberdkit import Site


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path, uuid.uuid4().hex)
