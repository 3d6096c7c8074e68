"""Fixtures of the hostile tests (marker ``hostile``): two real unprivileged job users.

Every test here reproduces an attack a job user on a shared node could make
(docs/design.md, threat model) and checks that it is refused or survived.
"""

from __future__ import annotations

import os

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
