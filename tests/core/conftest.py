"""Core test fixtures: two real issuers (EdDSA, ES256), their trust store, a verifier."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.tokens import TokenVerifier
from slurm_fiber.core.trust import TrustStore

from .tokenkit import AUDIENCE, Issuer


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
