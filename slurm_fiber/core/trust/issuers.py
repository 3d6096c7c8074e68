"""Trusted issuers: each a JWKS file of public keys, re-read when it changes.

A ``TrustStore`` maps issuer names to JWKS files. Keys are parsed once into
``cryptography`` key objects, each pinned to one algorithm taken from the key
itself (OKP/Ed25519 → EdDSA, EC/P-256 → ES256), never from a token; ``verify``
checks a JWS signature with such a key through ``cryptography``. ``public_jwk``
(for whoever mints: the CLI, the prolog, tests) gives a key's public JWK. Any
other key (RSA, oct, other curves, private material, no ``kid``, a duplicate
``kid``, an ``alg`` or ``use`` that contradicts the key, a point not on the
curve) is not loaded, and the store says why. Every lookup costs one ``stat``:
when the file's (mtime_ns, size, inode) changes it is re-read, so a rotated
JWKS takes effect without a restart. A file modified within the last
``RACY_WINDOW_NS`` is re-read on every lookup until it is older (as git does
for "racy" index entries), because a second in-place rewrite inside one
timestamp tick would leave the stamp unchanged. A file that cannot be read or
parsed keeps the issuer's last good keys; the error is reported once (to
``on_problem`` and in ``problems()``) until it changes. Not thread-safe: used
from one event loop or one command.
"""

from __future__ import annotations

import base64
import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

_B64URL = re.compile(rb"[A-Za-z0-9_-]*")

MAX_JWKS_BYTES = 1 << 20
RACY_WINDOW_NS = 2_000_000_000

PublicKey = ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey


@dataclass(frozen=True)
class TrustedKey:
    """One loaded public key: its issuer, kid, pinned algorithm and key object."""

    issuer: str
    kid: str
    alg: str  # "EdDSA" or "ES256"
    key: PublicKey


def public_jwk(key: PublicKey | ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey
               ) -> dict[str, str]:
    """The public JWK of a ``cryptography`` key with ``kid`` (RFC 7638 thumbprint), ``alg``
    and ``use``. ValueError for a key neither Ed25519 nor P-256."""
    private = ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey
    pub = key.public_key() if isinstance(key, private) else key
    if isinstance(pub, ed25519.Ed25519PublicKey):
        raw = pub.public_bytes_raw()
        members, alg = {"crv": "Ed25519", "kty": "OKP", "x": _b64(raw)}, "EdDSA"
    elif isinstance(pub, ec.EllipticCurvePublicKey) and isinstance(pub.curve, ec.SECP256R1):
        point = pub.public_numbers()
        members = {"crv": "P-256", "kty": "EC", "x": _b64(point.x.to_bytes(32, "big")),
                   "y": _b64(point.y.to_bytes(32, "big"))}
        alg = "ES256"
    else:
        raise ValueError("only Ed25519 and P-256 keys are supported")
    canonical = json.dumps(members, separators=(",", ":"), sort_keys=True)
    digest = hashes.Hash(hashes.SHA256())
    digest.update(canonical.encode())
    kid = _b64(digest.finalize())
    return {**members, "kid": kid, "alg": alg, "use": "sig"}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def parse_jwks(issuer: str, data: bytes) -> tuple[dict[str, TrustedKey], list[str]]:
    """Parse a JWKS document. Returns the loadable keys by kid and one line per key skipped.

    Raises ValueError (one line) when the document itself is not a JWKS.
    """
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"not JSON ({err.__class__.__name__})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise ValueError('not a JWKS (expected an object with a "keys" list)')
    keys: dict[str, TrustedKey] = {}
    skipped: list[str] = []
    for i, jwk in enumerate(doc["keys"]):
        kid = jwk.get("kid") if isinstance(jwk, dict) else None
        label = f"key {kid!r}" if isinstance(kid, str) else f"key #{i}"
        try:
            if not isinstance(kid, str) or not kid:
                raise ValueError("has no kid")
            if kid in keys:
                raise ValueError("repeats a kid already loaded from this file")
            keys[kid] = TrustedKey(issuer, kid, *_load_jwk(jwk))
        except ValueError as err:
            skipped.append(f"{label} not loaded: {err}")
    return keys, skipped


def verify(alg: str, key: PublicKey, message: bytes, signature: bytes) -> bool:
    """Whether ``signature`` (as a JWS carries it: Ed25519's 64 bytes, or ES256's raw
    32-byte r and s, RFC 7518 §3.4) signs ``message`` under ``key`` with ``alg`` (EdDSA or
    ES256); False for any other algorithm, or a key not of it."""
    try:
        if alg == "EdDSA" and isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, message)
            return True
        if alg == "ES256" and isinstance(key, ec.EllipticCurvePublicKey) \
                and len(signature) == 64:
            der = encode_dss_signature(int.from_bytes(signature[:32], "big"),
                                       int.from_bytes(signature[32:], "big"))
            key.verify(der, message, ec.ECDSA(hashes.SHA256()))
            return True
    except InvalidSignature:
        pass
    return False


def _ed25519_from_jwk(jwk: Mapping[str, Any]) -> PublicKey:
    raw = _coordinate(jwk, "x")
    if len(raw) != 32:
        raise ValueError("an Ed25519 key is not 32 bytes")
    return ed25519.Ed25519PublicKey.from_public_bytes(raw)


def _p256_from_jwk(jwk: Mapping[str, Any]) -> PublicKey:
    x, y = _coordinate(jwk, "x"), _coordinate(jwk, "y")
    if len(x) != 32 or len(y) != 32:
        raise ValueError("a P-256 coordinate is not 32 bytes")
    point = ec.EllipticCurvePublicNumbers(int.from_bytes(x, "big"), int.from_bytes(y, "big"),
                                          ec.SECP256R1())
    return point.public_key()  # ValueError for a point not on the curve


def b64url_decode(data: bytes) -> bytes:
    """Unpadded base64url (RFC 7515 §2), strictly: any byte outside its alphabet, or a
    length no encoding has, raises ValueError (no character is skipped)."""
    if not _B64URL.fullmatch(data) or len(data) % 4 == 1:
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(data + b"=" * (-len(data) % 4))


def _coordinate(jwk: Mapping[str, Any], name: str) -> bytes:
    value = jwk.get(name)
    if not isinstance(value, str):
        raise ValueError(f"{name!r} is missing or not a string")
    try:
        return b64url_decode(value.encode("ascii"))
    except (UnicodeEncodeError, ValueError):
        raise ValueError(f"{name!r} is not base64url") from None


def _load_jwk(jwk: dict[str, Any]) -> tuple[str, PublicKey]:
    kty, crv = jwk.get("kty"), jwk.get("crv")
    if "d" in jwk:
        raise ValueError("carries private key material; publish public keys only")
    loader: Callable[[Mapping[str, Any]], PublicKey]
    if kty == "OKP" and crv == "Ed25519":
        alg, loader = "EdDSA", _ed25519_from_jwk
    elif kty == "EC" and crv == "P-256":
        alg, loader = "ES256", _p256_from_jwk
    else:
        raise ValueError(f"kty={kty!r} crv={crv!r} is not accepted (only Ed25519 or P-256)")
    if jwk.get("alg", alg) != alg:
        raise ValueError(f"says alg {jwk.get('alg')!r} but a {crv} key is {alg}")
    if jwk.get("use", "sig") != "sig":
        raise ValueError(f"says use {jwk.get('use')!r}, not 'sig'")
    try:
        key = loader(jwk)
    except (ValueError, TypeError) as err:
        raise ValueError(f"bad key material ({err})") from None
    return alg, key


@dataclass
class _IssuerFile:
    path: Path
    stamp: tuple[int, int, int] | None = None
    keys: Mapping[str, TrustedKey] | None = None
    problem: str | None = None


class TrustStore:
    """Issuer name → JWKS file, with keys re-read on change.

    Construction loads every file (problems are reported, not raised). Lookups
    never raise; they return None for anything not trusted.
    """

    def __init__(
        self,
        issuers: Mapping[str, str | os.PathLike[str]],
        *,
        on_problem: Callable[[str], None] | None = None,
    ) -> None:
        self._files = {name: _IssuerFile(Path(path)) for name, path in issuers.items()}
        self._on_problem = on_problem
        for name in self._files:
            self._refresh(name)

    @property
    def issuers(self) -> tuple[str, ...]:
        return tuple(self._files)

    def find(self, issuer: str, kid: str) -> TrustedKey | None:
        """The key ``kid`` of ``issuer`` (after a stat check of its file), or None."""
        if issuer not in self._files:
            return None
        keys = self._refresh(issuer)
        return keys.get(kid)

    def issuer_of_kid(self, kid: str) -> str | None:
        """Which trusted issuer holds a key ``kid``, if any (refreshing every file)."""
        for name in self._files:
            if kid in self._refresh(name):
                return name
        return None

    def keys(self, issuer: str) -> tuple[TrustedKey, ...]:
        """Every key loaded for ``issuer`` now (empty for an unknown issuer)."""
        return tuple(self._refresh(issuer).values()) if issuer in self._files else ()

    def problems(self) -> dict[str, str]:
        """Issuer → the current problem with its file (unreadable, unparsable, keys skipped)."""
        return {n: f.problem for n, f in self._files.items() if f.problem is not None}

    def _refresh(self, issuer: str) -> Mapping[str, TrustedKey]:
        f = self._files[issuer]
        try:
            st = os.stat(f.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == f.stamp:
                return f.keys or {}
            racy = time.time_ns() - st.st_mtime_ns < RACY_WINDOW_NS
            f.stamp = None if racy else stamp
            if st.st_size > MAX_JWKS_BYTES:
                raise ValueError(f"larger than {MAX_JWKS_BYTES} bytes")
            keys, skipped = parse_jwks(issuer, f.path.read_bytes())
        except (OSError, ValueError) as err:
            if isinstance(err, OSError):
                f.stamp = None  # retry the read on the next lookup
            detail = err.strerror if isinstance(err, OSError) else str(err)
            kept = "keeping the last good keys" if f.keys else "no keys loaded"
            self._report(f, f"issuer {issuer!r}: JWKS {f.path}: {detail}; {kept}")
            return f.keys or {}
        f.keys = keys
        self._report(f, f"issuer {issuer!r}: JWKS {f.path}: " + "; ".join(skipped)
                     if skipped else None)
        return keys

    def _report(self, f: _IssuerFile, problem: str | None) -> None:
        if problem != f.problem and problem is not None and self._on_problem is not None:
            self._on_problem(problem)
        f.problem = problem
