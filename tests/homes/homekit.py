"""Shared test helpers: JWT-shaped tokens and a home fed by a list or a grantdir."""

from __future__ import annotations

from collections.abc import AsyncIterator

import jwt

from slurm_fiber.core.book.health import SourceHealth
from slurm_fiber.core.devices import DeviceChannel
from slurm_fiber.core.trust.grant import ScopeClaim, VerifiedToken, valid_uid
from slurm_fiber.core.trust.tokens import TokenRefused, decode_unverified
from slurm_fiber.homes import GrantEvent, ReleaseDevices

KEY = "grantdir-tests-do-not-verify-this-key"


def token(uid: str, jti: str = "j1", **claims: object) -> bytes:
    """A JWT-shaped token naming ``uid`` (signed with a throwaway key nobody verifies)."""
    return jwt.encode({"sub": uid, "jti": jti, **claims}, KEY, algorithm="HS256").encode()


def unverified_uid(raw: bytes) -> str | None:
    """The ``sub`` a test's token names, read without verifying (the tests' stand-in for
    the core's verification); None when it names no valid UID."""
    try:
        claims = decode_unverified(raw).claims
    except TokenRefused:
        return None
    uid = claims.get("sub")
    return uid if valid_uid(uid) else None


def confirmed(event: GrantEvent) -> str | None:
    """Play the core for a grantdir under test: the UID a GRANT_ADDED's token names, handed
    back to its origin as verified (as drive does after the core verified it)."""
    uid = unverified_uid(event.token)
    if uid is not None and event.origin is not None and event.origin.held is not None:
        event.origin.held(uid)
    return uid


class FedHome:
    """A home whose deliveries are whatever iterator (or None, or error) the test gives it."""

    def __init__(self, health: SourceHealth, events: AsyncIterator[GrantEvent] | None,
                 fail: Exception | None = None) -> None:
        self._health = health
        self._events = events
        self._fail = fail

    def name(self) -> str:
        return "fed"

    async def grants(self) -> AsyncIterator[GrantEvent] | None:
        if self._fail is not None:
            raise self._fail
        return self._events

    def health(self) -> SourceHealth:
        return self._health

    def cgroup_root(self) -> str | None:
        return None

    async def publish_ready(self, grant_uid: str, ready: bool) -> None:
        return None

    def scope(self) -> list[ScopeClaim]:
        return []

    async def devices(self, grant: VerifiedToken) -> tuple[DeviceChannel, ReleaseDevices]:
        return DeviceChannel(), lambda: None

    async def run(self) -> None:
        return None
