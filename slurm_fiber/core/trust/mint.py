"""Issuing side: issuer keys and grant tokens (for admins, the prolog and tests).

``generate_key`` makes an Ed25519 or P-256 private key; ``save_private_key``
writes it as PKCS#8 PEM created with mode 0600 (never widened, never
overwriting an existing file); ``load_private_key`` reads one back. ``mint``
signs a grant token whose ``kid`` is the key's RFC 7638 thumbprint (the same
``kid`` ``public_jwk`` publishes) and whose algorithm follows from the key.
The claims are checked with the verifier's own rules before signing, so a
minted token is never one fiberd would refuse for its shape. Signing is a
compact JWS (RFC 7515) over ``cryptography``'s signature primitives; tests check
every minted token against PyJWT's own decoder.
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from slurm_fiber.core.fibers.spec import fiber_spec_to_json, parse_fiber_spec
from slurm_fiber.core.trust.grant import FiberSpec, valid_uid
from slurm_fiber.core.trust.issuers import public_jwk

PrivateKey = ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey

ALGS = ("EdDSA", "ES256")


def generate_key(alg: str = "EdDSA") -> PrivateKey:
    """A new private key for ``alg`` (EdDSA → Ed25519, ES256 → P-256). ValueError otherwise."""
    if alg == "EdDSA":
        return ed25519.Ed25519PrivateKey.generate()
    if alg == "ES256":
        return ec.generate_private_key(ec.SECP256R1())
    raise ValueError(f"alg {alg!r} is not supported (EdDSA or ES256)")


def save_private_key(key: PrivateKey, path: Path) -> None:
    """Write ``key`` as PEM to a new file of mode 0600. FileExistsError if ``path`` exists."""
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    os.fchmod(fd, 0o600)  # whatever the umask
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
        f.flush()
        os.fsync(f.fileno())


def load_private_key(path: Path) -> PrivateKey:
    """Read a PEM private key. ValueError (one line) unless it is an Ed25519 or P-256 key."""
    data = path.read_bytes()
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise ValueError(f"{path} is not an unencrypted PEM private key") from None
    if isinstance(key, ed25519.Ed25519PrivateKey) or (
        isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1)
    ):
        return key
    raise ValueError(f"{path} holds a key that is neither Ed25519 nor P-256")


def mint(
    key: PrivateKey,
    *,
    issuer: str,
    uid: str,
    audience: str | list[str],
    iat: float,
    exp: float,
    spec: FiberSpec | None = None,
    nbf: float | None = None,
    jti: str | None = None,
) -> str:
    """A compact signed grant token. ValueError (one line) for a bad UID, times or spec."""
    if not valid_uid(uid):
        raise ValueError(f"{uid!r} is not a grant UID ([A-Za-z0-9][A-Za-z0-9._:@-]{{0,127}})")
    if exp <= iat:
        raise ValueError("exp must be after iat (a positive ttl)")
    fiber = fiber_spec_to_json(spec or FiberSpec())
    parse_fiber_spec(fiber)  # the verifier's rules; raises BadFiberClaim (a ValueError)
    claims: dict[str, Any] = {
        "iss": issuer,
        "sub": uid,
        "aud": audience,
        "iat": int(iat),
        "exp": int(exp),
        "jti": jti or str(uuid.uuid4()),
        "fiber": fiber,
    }
    if nbf is not None:
        claims["nbf"] = int(nbf)
    jwk = public_jwk(key)
    return compact_jws(claims, key, jwk["kid"])


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def compact_jws(claims: dict[str, Any], key: PrivateKey, kid: str) -> str:
    """``claims`` signed by ``key`` as a compact JWS (EdDSA for Ed25519, ES256 for P-256)."""
    alg = "EdDSA" if isinstance(key, ed25519.Ed25519PrivateKey) else "ES256"
    header = {"alg": alg, "kid": kid, "typ": "JWT"}
    signing_input = ".".join(_b64(json.dumps(part, separators=(",", ":")).encode())
                             for part in (header, claims)).encode()
    if isinstance(key, ed25519.Ed25519PrivateKey):
        signature = key.sign(signing_input)
    else:  # JWS wants R || S, 32 bytes each (RFC 7518 3.4), not DER
        r, s = decode_dss_signature(key.sign(signing_input, ec.ECDSA(hashes.SHA256())))
        signature = r.to_bytes(32, "big") + s.to_bytes(32, "big")
    return f"{signing_input.decode()}.{_b64(signature)}"
