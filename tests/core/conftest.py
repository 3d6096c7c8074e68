"""Core test fixtures: two real issuers (EdDSA, ES256), their trust store, a verifier; and,
for the process layer (tests/core/templates, tests/core/runtime), a per-test cgroup root and
a per-test process mark.

``cgroup_root`` creates ``/sys/fs/cgroup/unified/sf-test-<random>`` (the real
cgroup2 hierarchy; we are root) and removes it after the test, killing
anything left in it. Tests that use it are marked ``machine_may_lack``: a
machine without a writable cgroup2 mount truly lacks it.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.trust.issuers import TrustStore
from slurm_fiber.core.trust.tokens import TokenVerifier
from tests.core.tokenkit import AUDIENCE, Issuer


@pytest.fixture
def site(tmp_path: Path) -> Issuer:
    return Issuer("site", "EdDSA", tmp_path)


@pytest.fixture
def other(tmp_path: Path) -> Issuer:
    return Issuer("other", "ES256", tmp_path)


@pytest.fixture
def trust(site: Issuer, other: Issuer) -> TrustStore:
    return TrustStore({site.name: site.jwks, other.name: other.jwks})


@pytest.fixture
def verifier(trust: TrustStore, clock: FakeClock) -> TokenVerifier:
    return TokenVerifier(trust, AUDIENCE, clock, leeway=30.0)


@pytest.fixture
def mark() -> str:
    """A unique SF_TEST_MARK value for this test's templates and fibers."""
    return uuid.uuid4().hex
