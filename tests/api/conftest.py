"""Fixtures for the socket API tests (the helpers live in procservice.py).

``served`` is the server over a small test runtime; ``fiberd_served`` is the
real fiberd (core runtime, warm template) on a loop in a thread, so the same
socket tests can run against both.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from procservice import Served, serve

from slurm_fiber.core.clock import SystemClock
from tests.runtime.kit import Site, ThreadFiberd, fiberd_in_thread


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """A server on the real clock (timeouts generous) at tmp_path/fiberd.sock."""
    with serve(tmp_path / "fiberd.sock", SystemClock()) as s:
        yield s


@pytest.fixture
def fiberd_served(tmp_path: Path) -> Iterator[ThreadFiberd]:
    """The real fiberd with one warm grant, its socket at tmp_path/state/fiberd.sock."""
    with fiberd_in_thread(Site(tmp_path, uuid.uuid4().hex)) as served:
        yield served
