"""Fixtures for the socket API tests (the helpers live in servicekit.py and rawkit.py).

``served`` (tests/conftest.py, shared with fiberctl's tests) is the server over a small
test runtime; ``fiberd_served`` is the real fiberd (core runtime, warm template) on a loop
in a thread, so the same socket tests can run against both.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.core.runtime.fiberdkit import Site, ThreadFiberd, fiberd_in_thread


@pytest.fixture
def site(tmp_path: Path) -> Site:
    """A throwaway site in tmp_path (its issuer mints more tokens, its mark names them)."""
    return Site(tmp_path, uuid.uuid4().hex)


@pytest.fixture
def fiberd_served(site: Site) -> Iterator[ThreadFiberd]:
    """The real fiberd of ``site`` with one warm grant (g1), its socket at
    tmp_path/state/fiberd.sock."""
    with fiberd_in_thread(site) as served:
        yield served
