"""Token test kit: real keys, real JWKS files, hand-built tokens.

``Issuer.sign`` builds a compact JWS from any header and payload (dicts, or
raw JSON bytes for duplicate members), signed for real, so every bad-token
case is a genuine token with exactly one thing wrong.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from jwt.algorithms import get_default_algorithms

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.trust.issuers import public_jwk
from slurm_fiber.core.trust.mint import generate_key

AUDIENCE = "job-1"


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def as_json(obj: dict[str, Any] | bytes) -> bytes:
    return obj if isinstance(obj, bytes) else json.dumps(obj).encode()


class Issuer:
    """A real signing key of one issuer, its JWKS file, and a token builder."""

    def __init__(self, name: str, alg: str, directory: Path) -> None:
        self.name = name
        self.alg = alg
        self.key = generate_key(alg)
        self.jwk = public_jwk(self.key)
        self.kid = self.jwk["kid"]
        self.jwks = directory / f"{name}.jwks.json"
        self.publish([self.jwk])

    def publish(self, jwks: list[dict[str, Any]]) -> None:
        self.jwks.write_text(json.dumps({"keys": jwks}))

    def claims(self, clock: FakeClock, **over: Any) -> dict[str, Any]:
        now = int(clock.wall())
        claims: dict[str, Any] = {
            "iss": self.name, "sub": "grant-1", "aud": AUDIENCE, "iat": now,
            "exp": now + 3600, "jti": f"jti-{now}", "fiber": {"limits": {"fibers": 2}},
        }
        claims.update(over)
        return {k: v for k, v in claims.items() if v is not DROP}

    def header(self, **over: Any) -> dict[str, Any]:
        h: dict[str, Any] = {"alg": self.alg, "kid": self.kid, "typ": "JWT"}
        h.update(over)
        return {k: v for k, v in h.items() if v is not DROP}

    def sign(self, claims: dict[str, Any] | bytes, header: dict[str, Any] | bytes | None = None,
             key: Any = None) -> str:
        signing_input = f"{b64(as_json(header or self.header()))}.{b64(as_json(claims))}"
        alg = get_default_algorithms()[self.alg]
        sig = alg.sign(signing_input.encode(), key or self.key)
        return f"{signing_input}.{b64(sig)}"

    def mint(self, clock: FakeClock, **over: Any) -> str:
        return self.sign(self.claims(clock, **over))


DROP = object()  # pass as a claim/header value to leave that member out
