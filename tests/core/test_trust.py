"""The trust store: JWKS loading, pinning, rotation without restart, last good keys."""

from __future__ import annotations

import json
import os
from pathlib import Path

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.trust.issuers import TrustStore, parse_jwks, public_jwk, verify
from slurm_fiber.core.trust.mint import generate_key
from slurm_fiber.core.trust.tokens import TokenReason, TokenRefused, TokenVerifier
from tests.core.tokenkit import AUDIENCE, Issuer


def reason_of(verifier: TokenVerifier, token: str) -> TokenReason | None:
    try:
        verifier.verify(token)
    except TokenRefused as err:
        return err.reason
    return None


def test_keys_are_pinned_by_their_type():
    ed, p256 = public_jwk(generate_key("EdDSA")), public_jwk(generate_key("ES256"))
    keys, skipped = parse_jwks("i", json.dumps({"keys": [ed, p256]}).encode())
    assert {k.alg for k in keys.values()} == {"EdDSA", "ES256"} and skipped == []
    assert keys[ed["kid"]].alg == "EdDSA" and keys[p256["kid"]].alg == "ES256"


def test_unacceptable_keys_are_skipped_with_a_reason():
    ed = public_jwk(generate_key("EdDSA"))
    rsa = {"kty": "RSA", "kid": "r", "n": "AQAB", "e": "AQAB"}
    p384 = {"kty": "EC", "crv": "P-384", "kid": "p", "x": "AA", "y": "AA"}
    private = {**ed, "kid": "priv", "d": "AAAA"}
    wrong_alg = {**ed, "kid": "walg", "alg": "ES256"}
    enc = {**ed, "kid": "enc", "use": "enc"}
    no_kid = {k: v for k, v in ed.items() if k != "kid"}
    bad_x = {**ed, "kid": "badx", "x": "!!"}
    doc = {"keys": [ed, ed, rsa, p384, private, wrong_alg, enc, no_kid, bad_x, "junk"]}
    keys, skipped = parse_jwks("i", json.dumps(doc).encode())
    assert list(keys) == [ed["kid"]]
    assert len(skipped) == 9
    text = "\n".join(skipped)
    for expected in ("repeats a kid", "kty='RSA'", "P-384", "private key material",
                     "says alg 'ES256'", "use 'enc'", "has no kid", "bad key material"):
        assert expected in text


def test_rotation_without_restart_in_place_and_by_rename(tmp_path: Path, clock: FakeClock):
    site = Issuer("site", "EdDSA", tmp_path)
    verifier = TokenVerifier(TrustStore({"site": site.jwks}), AUDIENCE, clock)
    old_token = site.mint(clock)
    assert reason_of(verifier, old_token) is None
    old_jwk = site.jwk
    # in-place rewrite with a second key (both valid during rollover)
    (tmp_path / "next").mkdir()
    new = Issuer("site", "EdDSA", tmp_path / "next")  # another key of the same issuer
    site.publish([old_jwk, new.jwk])
    assert reason_of(verifier, new.mint(clock)) is None
    assert reason_of(verifier, old_token) is None
    # atomic rename drops the old key
    tmp = tmp_path / "next.json"
    tmp.write_text(json.dumps({"keys": [new.jwk]}))
    os.replace(tmp, site.jwks)
    assert reason_of(verifier, old_token) is TokenReason.UNKNOWN_KID
    assert reason_of(verifier, new.mint(clock)) is None


def test_a_broken_jwks_keeps_the_last_good_keys_and_reports_once(tmp_path, clock):
    site = Issuer("site", "EdDSA", tmp_path)
    problems: list[str] = []
    trust = TrustStore({"site": site.jwks}, on_problem=problems.append)
    verifier = TokenVerifier(trust, AUDIENCE, clock)
    token = site.mint(clock)
    site.jwks.write_text('{"keys": [ oops')
    for _ in range(3):
        assert reason_of(verifier, token) is None
    assert len(problems) == 1 and "keeping the last good keys" in problems[0]
    assert str(site.jwks) in problems[0] and "site" in trust.problems()
    site.publish([site.jwk])
    assert reason_of(verifier, token) is None and trust.problems() == {}


def test_a_missing_jwks_is_reported_and_trusts_nothing(tmp_path, clock):
    site = Issuer("site", "EdDSA", tmp_path)
    problems: list[str] = []
    trust = TrustStore({"site": tmp_path / "absent.json"}, on_problem=problems.append)
    verifier = TokenVerifier(trust, AUDIENCE, clock)
    assert reason_of(verifier, site.mint(clock)) is TokenReason.UNKNOWN_KID
    assert reason_of(verifier, site.mint(clock)) is TokenReason.UNKNOWN_KID
    assert len(problems) == 1 and "no keys loaded" in problems[0]
    assert trust.keys("site") == () and trust.keys("nobody") == ()


def test_public_jwk_kid_is_the_rfc7638_thumbprint():
    # RFC 7638 §3.1's example uses RSA; for OKP the members are crv, kty, x (RFC 8037 A.3).
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    x = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
    jwk = public_jwk(Ed25519PublicKey.from_public_bytes(x))
    assert jwk["kid"] == "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k"


def test_verify_checks_each_algorithm_with_its_own_key_and_signature_shape():
    # Signed as PyJWT signs (the reference), checked by trust.verify (no PyJWT).
    from jwt.algorithms import ECAlgorithm, OKPAlgorithm

    message = b"head.payload"
    ed, p256 = generate_key("EdDSA"), generate_key("ES256")
    ed_sig = OKPAlgorithm().sign(message, ed)
    es_sig = ECAlgorithm(ECAlgorithm.SHA256).sign(message, p256)
    keys, skipped = parse_jwks("i", json.dumps({"keys": [public_jwk(ed), public_jwk(p256)]})
                               .encode())
    assert not skipped
    ed_key, p256_key = (keys[public_jwk(k)["kid"]].key for k in (ed, p256))
    assert verify("EdDSA", ed_key, message, ed_sig)
    assert verify("ES256", p256_key, message, es_sig)
    assert not verify("EdDSA", ed_key, b"head.other", ed_sig)
    assert not verify("ES256", p256_key, b"head.other", es_sig)
    assert not verify("ES256", p256_key, message, es_sig[:-1])  # not 2 x 32 bytes
    assert not verify("ES256", ed_key, message, ed_sig)  # a key of another algorithm
    assert not verify("EdDSA", p256_key, message, es_sig)
    assert not verify("RS256", ed_key, message, ed_sig)
    flipped = bytes([es_sig[0] ^ 1]) + es_sig[1:]
    assert not verify("ES256", p256_key, message, flipped)
    assert not verify("ES256", p256_key, message, bytes(64))  # r = s = 0
    assert not verify("EdDSA", ed_key, message, bytes([ed_sig[0] ^ 1]) + ed_sig[1:])


def test_a_p256_key_off_the_curve_or_short_is_not_loaded():
    jwk = public_jwk(generate_key("ES256"))
    off = dict(jwk, y=jwk["x"])  # (x, x) is not a point of P-256
    short = dict(jwk, x=jwk["x"][:-2])
    keys, skipped = parse_jwks("i", json.dumps({"keys": [off, short]}).encode())
    assert keys == {} and len(skipped) == 2
    assert all("bad key material" in line for line in skipped)


def test_a_coordinate_with_a_byte_outside_base64url_is_not_loaded():
    """A lax decoder would skip the stray bytes and load the key the rest spells."""
    jwk = public_jwk(generate_key("EdDSA"))
    stray = dict(jwk, kid="stray", x=jwk["x"][:20] + "!\n" + jwk["x"][20:])
    keys, skipped = parse_jwks("i", json.dumps({"keys": [jwk, stray]}).encode())
    assert len(keys) == 1 and len(skipped) == 1
    assert "'x' is not base64url" in skipped[0]


def test_es256_signatures_verify_from_the_raw_r_and_s_a_jws_carries():
    """RFC 7518 §3.4: r and s as 32 big-endian bytes each, not DER; a DER signature, or one
    with r and s swapped, is refused."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

    private = generate_key("ES256")
    keys, _ = parse_jwks("i", json.dumps({"keys": [public_jwk(private)]}).encode())
    [key] = (k.key for k in keys.values())
    der = private.sign(b"m", ec.ECDSA(hashes.SHA256()))
    r, s = decode_dss_signature(der)
    raw = r.to_bytes(32, "big") + s.to_bytes(32, "big")
    assert verify("ES256", key, b"m", raw)
    assert not verify("ES256", key, b"m", der)
    assert not verify("ES256", key, b"m", raw[32:] + raw[:32])
    assert not verify("EdDSA", key, b"m", raw)  # the key is pinned to ES256


def test_a_signature_of_the_wrong_length_is_refused():
    ed = generate_key("EdDSA")
    keys, _ = parse_jwks("i", json.dumps({"keys": [public_jwk(ed)]}).encode())
    [key] = (k.key for k in keys.values())
    assert not verify("EdDSA", key, b"m", b"\x01" * 10)
    assert not verify("EdDSA", key, b"m", b"")
