"""Token verification: a compact JWS in, a VerifiedToken or a coded refusal out.

``TokenVerifier.verify`` checks, in this order and stopping at the first
failure: the size cap (before anything is parsed), the three base64url
segments, the header (before any crypto), the issuer and key, the signature
(with the algorithm pinned to the key, never the one the header names), then
the claims of DESIGN §3 and their times against the injected clock.
``trust.verify`` checks the signature; nothing here reads the wall clock.
Leeway widens ``nbf`` and ``iat`` only, never ``exp``, so it cannot lengthen a
lease. Nothing but ``TokenRefused`` escapes ``verify``: the header and the
claims are parsed before the signature is checked, so every value in them is
hostile input, and no number (``10**400``, ``1e400``, ``true``, negative) gets
further than a ``bad_claim`` refusal.

Every refusal carries one ``TokenReason`` (the closed set below) and a one-line
``detail`` a person can act on:

| reason | when |
|---|---|
| ``oversize`` | the token is larger than 64 KiB |
| ``malformed`` | not ASCII text, not 3 base64url segments, bad JSON, JSON not an object |
| ``bad_header`` | duplicate header member; ``crit`` malformed or naming any extension |
|                | (none is understood); ``kid`` missing |
| ``alg_not_allowed`` | ``alg`` is not EdDSA or ES256, or not the algorithm the key is pinned to |
| ``unknown_issuer`` | ``iss`` names no trusted issuer |
| ``unknown_kid`` | no trusted key has this ``kid`` |
| ``key_issuer_mismatch`` | the ``kid`` belongs to another trusted issuer |
| ``bad_signature`` | the signature does not verify |
| ``missing_claim`` | ``iss``, ``sub``, ``aud``, ``exp``, ``iat``, ``jti`` or ``fiber`` is absent |
| ``bad_claim`` | a claim has the wrong type or appears twice; a time is not a number |
|               | of Unix seconds in [0, ``MAX_UNIX_TIME``]; ``exp`` ≤ ``iat``; |
|               | ``fiber`` is not a valid grant (e.g. a limit out of its range) |
| ``bad_uid`` | ``sub`` is not a grant UID (``[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}``) |
| ``wrong_audience`` | ``aud`` does not contain this verifier's audience |
| ``expired`` | ``exp`` ≤ now (no leeway) |
| ``not_yet_valid`` | ``nbf`` > now + leeway |
| ``issued_in_future`` | ``iat`` > now + leeway |
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, replace
from typing import Any

from slurm_fiber.core.clock import Clock
from slurm_fiber.core.fibers.spec import BadFiberClaim, number_in_range, parse_fiber_spec
from slurm_fiber.core.trust.grant import VerifiedToken, valid_uid
from slurm_fiber.core.trust.issuers import TrustedKey, TrustStore, b64url_decode, verify

MAX_TOKEN_BYTES = 64 * 1024
MAX_UNIX_TIME = 253_402_300_799  # 9999-12-31T23:59:59Z: the last second every date library shows
ALLOWED_ALGS = ("EdDSA", "ES256")
SUPPORTED_CRIT: frozenset[str] = frozenset()  # no JWS extension is understood


class TokenReason(enum.StrEnum):
    """Why a token was refused; the closed set documented in the module docstring."""

    OVERSIZE = "oversize"
    MALFORMED = "malformed"
    BAD_HEADER = "bad_header"
    ALG_NOT_ALLOWED = "alg_not_allowed"
    UNKNOWN_ISSUER = "unknown_issuer"
    UNKNOWN_KID = "unknown_kid"
    KEY_ISSUER_MISMATCH = "key_issuer_mismatch"
    BAD_SIGNATURE = "bad_signature"
    MISSING_CLAIM = "missing_claim"
    BAD_CLAIM = "bad_claim"
    BAD_UID = "bad_uid"
    WRONG_AUDIENCE = "wrong_audience"
    EXPIRED = "expired"
    NOT_YET_VALID = "not_yet_valid"
    ISSUED_IN_FUTURE = "issued_in_future"


class TokenRefused(Exception):
    """A token was not accepted: ``reason`` (TokenReason) and a one-line ``detail``."""

    def __init__(self, reason: TokenReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class DecodedToken:
    """A token split and decoded but NOT verified: header, claims, signed bytes, signature."""

    header: dict[str, Any]
    claims: dict[str, Any]
    signing_input: bytes
    signature: bytes
    raw: bytes  # the compact token, surrounding whitespace removed


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in pairs:
        if name in out:
            raise _Duplicate(name)
        out[name] = value
    return out


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_refuse_constant)


def _json_object(segment: bytes, what: str, dup_reason: TokenReason) -> dict[str, Any]:
    try:
        obj = _DECODER.decode(segment.decode("utf-8"))
    except _Duplicate as dup:
        raise TokenRefused(dup_reason, f"the {what} has member {dup} twice") from None
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise TokenRefused(TokenReason.MALFORMED, f"the {what} is not valid JSON") from None
    if not isinstance(obj, dict):
        raise TokenRefused(TokenReason.MALFORMED, f"the {what} is JSON but not an object")
    return obj


def _b64(segment: bytes, what: str) -> bytes:
    try:
        return b64url_decode(segment)
    except ValueError:  # binascii.Error is one
        raise TokenRefused(TokenReason.MALFORMED, f"the {what} is not base64url") from None


def _as_bytes(raw: bytes | str) -> bytes:
    """The token as ASCII bytes within the size cap, surrounding whitespace removed."""
    if isinstance(raw, str | bytes) and len(raw) > MAX_TOKEN_BYTES:
        raise TokenRefused(TokenReason.OVERSIZE, f"more than the {MAX_TOKEN_BYTES} bytes allowed")
    if isinstance(raw, str):
        try:
            raw = raw.encode("ascii")
        except UnicodeEncodeError:
            raise TokenRefused(TokenReason.MALFORMED, "the token is not ASCII text") from None
    if not isinstance(raw, bytes):
        raise TokenRefused(TokenReason.MALFORMED, "the token is not text")
    return raw.strip()


def _split(raw: bytes) -> list[bytes]:
    parts = raw.split(b".")
    if len(parts) != 3:
        raise TokenRefused(
            TokenReason.MALFORMED, f"a compact JWS has 3 dot-separated segments, not {len(parts)}"
        )
    return parts


def decode_unverified(raw: bytes | str) -> DecodedToken:
    """Split and decode a compact JWS without trusting it (size cap and shape checks only).

    Used by ``token inspect``. Raises TokenRefused (oversize, malformed,
    bad_header / bad_claim for duplicate members).
    """
    raw = _as_bytes(raw)
    head, payload, sig = _split(raw)
    header = _json_object(_b64(head, "header"), "header", TokenReason.BAD_HEADER)
    claims = _json_object(_b64(payload, "payload"), "payload", TokenReason.BAD_CLAIM)
    return DecodedToken(header, claims, head + b"." + payload, _b64(sig, "signature"), raw)


def _check_header(header: dict[str, Any]) -> tuple[str, str]:
    """(alg, kid) of a header that passes every pre-crypto check."""
    if "crit" in header:
        crit = header["crit"]
        if not isinstance(crit, list) or not crit or not all(isinstance(c, str) for c in crit):
            raise TokenRefused(TokenReason.BAD_HEADER, "crit must be a non-empty list of names")
        if len(set(crit)) != len(crit):
            raise TokenRefused(TokenReason.BAD_HEADER, "crit names an extension twice")
        unknown = [c for c in crit if c not in SUPPORTED_CRIT]
        if unknown:
            raise TokenRefused(
                TokenReason.BAD_HEADER, f"critical extension {unknown[0]!r} is not understood"
            )
    alg = header.get("alg")
    if alg not in ALLOWED_ALGS:
        raise TokenRefused(
            TokenReason.ALG_NOT_ALLOWED, f"alg {alg!r} is not accepted (EdDSA or ES256 only)"
        )
    kid = header.get("kid")
    if not isinstance(kid, str) or not kid:
        raise TokenRefused(TokenReason.BAD_HEADER, "the header names no kid (a string)")
    return alg, kid


def _claim(claims: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    if name not in claims:
        raise TokenRefused(TokenReason.MISSING_CLAIM, f"the token has no {name!r} claim")
    value = claims[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TokenRefused(TokenReason.BAD_CLAIM, f"claim {name!r} must be {what}")
    return value


def _time_claim(claims: dict[str, Any], name: str) -> float:
    value = _claim(claims, name, (int, float), "a number of Unix seconds")
    if not number_in_range(value, 0, MAX_UNIX_TIME, integer=False):
        raise TokenRefused(TokenReason.BAD_CLAIM,
                           f"claim {name!r} must be Unix seconds from 0 to {MAX_UNIX_TIME}")
    return float(value)


@dataclass(frozen=True)
class _Parsed:
    """What the header and payload segments say, before any crypto.

    ``grant`` is the parsed claims (a VerifiedToken still without ``raw`` and
    ``leeway_used``), or the refusal they earn; that refusal is raised only
    after the signature verifies, so a forged token learns nothing.
    """

    alg: str
    kid: str
    issuer: str
    grant: VerifiedToken | TokenRefused


def _parse(head: bytes, payload: bytes) -> _Parsed:
    alg, kid = _check_header(_json_object(_b64(head, "header"), "header", TokenReason.BAD_HEADER))
    claims = _json_object(_b64(payload, "payload"), "payload", TokenReason.BAD_CLAIM)
    issuer = _claim(claims, "iss", str, "a string")
    try:
        grant: VerifiedToken | TokenRefused = _parse_grant(claims, issuer)
    except TokenRefused as err:
        grant = err
    return _Parsed(alg, kid, issuer, grant)


def _parse_grant(claims: dict[str, Any], issuer: str) -> VerifiedToken:
    uid = _claim(claims, "sub", str, "a string")
    if not valid_uid(uid):
        raise TokenRefused(TokenReason.BAD_UID, f"sub {uid[:40]!r} is not a grant UID")
    aud = _claim(claims, "aud", (str, list), "a string or a list of strings")
    audience = (aud,) if isinstance(aud, str) else tuple(aud)
    if not all(isinstance(a, str) for a in audience):
        raise TokenRefused(TokenReason.BAD_CLAIM, "claim 'aud' must list only strings")
    jti = _claim(claims, "jti", str, "a string")
    if not jti:
        raise TokenRefused(TokenReason.BAD_CLAIM, "claim 'jti' must not be empty")
    exp, iat = _time_claim(claims, "exp"), _time_claim(claims, "iat")
    nbf = _time_claim(claims, "nbf") if "nbf" in claims else None
    if exp <= iat:
        raise TokenRefused(TokenReason.BAD_CLAIM, "exp is not after iat")
    try:
        spec = parse_fiber_spec(_claim(claims, "fiber", dict, "an object"))
    except BadFiberClaim as err:
        raise TokenRefused(TokenReason.BAD_CLAIM, str(err)) from None
    return VerifiedToken(uid=uid, issuer=issuer, jti=jti, audience=audience, exp=exp, iat=iat,
                         nbf=nbf, spec=spec, raw=b"")


class TokenVerifier:
    """Verifies tokens for one audience against a TrustStore and a Clock.

    ``verify`` does not block beyond one stat of the issuer's JWKS file (and a
    re-read when it changed). Safe to call from the event loop. Parsing the
    header and payload is a pure function of their bytes, so its result is
    memoised (``memo_size`` entries, oldest dropped first); the key lookup, the
    signature, the audience and every time check run on every call.
    """

    def __init__(
        self, trust: TrustStore, audience: str, clock: Clock, leeway: float = 30.0,
        *, memo_size: int = 1024,
    ) -> None:
        if leeway < 0:
            raise ValueError("leeway must not be negative")
        self.trust = trust
        self.audience = audience
        self.clock = clock
        self.leeway = leeway
        self._memo: dict[bytes, _Parsed | TokenRefused] = {}
        self._memo_size = memo_size

    def verify(self, raw: bytes | str) -> VerifiedToken:
        """The verified token, or TokenRefused with its reason. Never raises anything else."""
        raw = _as_bytes(raw)
        head, payload, sig = _split(raw)
        parsed = self._parsed(head, payload)
        key = self._key(parsed.issuer, parsed.kid)
        if key.alg != parsed.alg:
            raise TokenRefused(TokenReason.ALG_NOT_ALLOWED,
                               f"key {key.kid!r} is pinned to {key.alg}, token says {parsed.alg}")
        signature = _b64(sig, "signature")
        if not verify(key.alg, key.key, head + b"." + payload, signature):
            raise TokenRefused(
                TokenReason.BAD_SIGNATURE, f"signature does not verify with key {key.kid!r}"
            )
        grant = parsed.grant
        if isinstance(grant, TokenRefused):
            raise TokenRefused(grant.reason, grant.detail)
        if self.audience not in grant.audience:
            raise TokenRefused(
                TokenReason.WRONG_AUDIENCE,
                f"token is for {list(grant.audience)}, not {self.audience!r}",
            )
        leeway_used = self._check_times(grant.exp, grant.iat, grant.nbf)
        return replace(grant, raw=raw, leeway_used=leeway_used)

    def _parsed(self, head: bytes, payload: bytes) -> _Parsed:
        memo_key = head + b"." + payload
        parsed = self._memo.get(memo_key)
        if parsed is None:
            try:
                parsed = _parse(head, payload)
            except TokenRefused as err:
                parsed = err
            if self._memo_size > 0:
                if len(self._memo) >= self._memo_size:
                    del self._memo[next(iter(self._memo))]
                self._memo[memo_key] = parsed
        if isinstance(parsed, TokenRefused):
            raise TokenRefused(parsed.reason, parsed.detail)
        return parsed

    def _key(self, issuer: str, kid: str) -> TrustedKey:
        key = self.trust.find(issuer, kid)
        if key is not None:
            return key
        if issuer not in self.trust.issuers:
            raise TokenRefused(TokenReason.UNKNOWN_ISSUER, f"issuer {issuer!r} is not trusted")
        owner = self.trust.issuer_of_kid(kid)
        if owner is not None:
            raise TokenRefused(
                TokenReason.KEY_ISSUER_MISMATCH,
                f"key {kid!r} belongs to issuer {owner!r}, not {issuer!r}",
            )
        raise TokenRefused(TokenReason.UNKNOWN_KID, f"issuer {issuer!r} has no key {kid!r}")

    def _check_times(self, exp: float, iat: float, nbf: float | None) -> float:
        now = self.clock.wall()
        if exp <= now:
            raise TokenRefused(
                TokenReason.EXPIRED, f"expired {now - exp:.0f} s ago (exp {exp:.0f})"
            )
        if nbf is not None and nbf > now + self.leeway:
            raise TokenRefused(
                TokenReason.NOT_YET_VALID, f"not valid for another {nbf - now:.0f} s (nbf)"
            )
        if iat > now + self.leeway:
            raise TokenRefused(
                TokenReason.ISSUED_IN_FUTURE,
                f"issued {iat - now:.0f} s in the future (leeway {self.leeway:g} s); check clocks",
            )
        return max(0.0, iat - now, (nbf or now) - now)

