"""Fixtures for the socket API tests (the helpers live in procservice.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from procservice import Served, serve

from slurm_fiber.core.clock import SystemClock


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """A server on the real clock (timeouts generous) at tmp_path/fiberd.sock."""
    with serve(tmp_path / "fiberd.sock", SystemClock()) as s:
        yield s
