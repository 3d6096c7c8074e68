"""Fixtures of the release tests: ``site`` (a real fiberd's files), imported from the
runtime tests as tests/cli/conftest.py does."""

from __future__ import annotations

from tests.core.runtime.conftest import site

__all__ = ["site"]
