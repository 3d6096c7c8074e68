"""Project-wide test set-up.

In CI (``CI=true``) a skipped test fails the run unless it is marked
``machine_may_lack``: nothing an issue asks for may be skipped there, only
what this kind of machine truly lacks (e.g. enforceable cgroup limits).
"""

from __future__ import annotations

import os

import pytest

from slurm_fiber.core.clock import FakeClock

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and item.get_closest_marker("machine_may_lack") is None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which allows no skips here: {reason}"


@pytest.fixture
def clock() -> FakeClock:
    """A fake clock at a fixed, recognisable time."""
    return FakeClock()
