"""Fixtures for the command tests: ``site``, the runtime tests' Site per test
(tests/core/runtime/conftest.py), for the fiberd and fiberd-run commands (test_commands.py).

It is imported, not moved to tests/conftest.py: tests/core and tests/executor each have a
``site`` fixture of their own.
"""

from __future__ import annotations

from tests.core.runtime.conftest import site

__all__ = ["site"]
