"""Minting without PyJWT's encoder: every token and JWK must be exactly what PyJWT reads.

``mint`` and ``public_jwk`` build the JWS and the JWK from ``cryptography``
primitives (to keep the prolog's imports light); these tests hold them to an
independent implementation, PyJWT's decoder and JWK export, for both algorithms.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from jwt.algorithms import ECAlgorithm, OKPAlgorithm

from slurm_fiber.core.trust.issuers import public_jwk
from slurm_fiber.core.trust.mint import generate_key, load_private_key, mint, save_private_key


@pytest.mark.parametrize("alg", ["EdDSA", "ES256"])
def test_minted_tokens_verify_with_pyjwt(alg: str) -> None:
    key = generate_key(alg)
    jwk = public_jwk(key)
    for _ in range(20):  # ES256 signatures vary in length before padding: try several
        token = mint(key, issuer="site", uid="g1", audience="aud-1", iat=1_700_000_000,
                     exp=4_000_000_000)
        header = jwt.get_unverified_header(token)
        assert header == {"alg": alg, "kid": jwk["kid"], "typ": "JWT"}
        claims = jwt.decode(token, key.public_key(), algorithms=[alg], audience="aud-1")
        assert claims["sub"] == "g1" and claims["iss"] == "site"


@pytest.mark.parametrize(("alg", "exporter"), [("EdDSA", OKPAlgorithm), ("ES256", ECAlgorithm)])
def test_public_jwk_members_match_pyjwt(alg: str, exporter: type) -> None:
    key = generate_key(alg)
    theirs = json.loads(exporter.to_jwk(key.public_key()))
    ours = public_jwk(key)
    assert {k: ours[k] for k in theirs if k in ("crv", "kty", "x", "y")} == \
        {k: v for k, v in theirs.items() if k in ("crv", "kty", "x", "y")}
    assert ours["alg"] == alg and ours["use"] == "sig"


def test_minting_does_not_import_pyjwt() -> None:
    code = ("import sys; from slurm_fiber.core.trust.mint import generate_key, mint; "
            "mint(generate_key(), issuer='s', uid='u', audience='a', iat=1, exp=2); "
            "print('jwt' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("alg", ["EdDSA", "ES256"])
def test_a_saved_key_loads_back_as_the_same_key(tmp_path: Path, alg: str) -> None:
    key = generate_key(alg)
    save_private_key(key, tmp_path / "k.pem")
    assert public_jwk(load_private_key(tmp_path / "k.pem")) == public_jwk(key)


def test_an_ed25519_key_loads_as_cryptography_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "k.pem"
    save_private_key(generate_key("EdDSA"), path)  # standard PKCS#8, as openssl writes it
    theirs = serialization.load_pem_private_key(path.read_bytes(), password=None)
    assert load_private_key(path).public_key().public_bytes_raw() == \
        theirs.public_key().public_bytes_raw()


@pytest.mark.parametrize("text", [
    "not a key",
    "-----BEGIN PRIVATE KEY-----\n!!!!\n-----END PRIVATE KEY-----\n",
    "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEI\n-----END PRIVATE KEY-----\n",
])
def test_anything_else_is_refused_in_one_line(tmp_path: Path, text: str) -> None:
    path = tmp_path / "k.pem"
    path.write_text(text)
    with pytest.raises(ValueError, match="is not an unencrypted PEM private key"):
        load_private_key(path)


def test_the_default_jti_is_a_version_4_uuid() -> None:
    import uuid

    key = generate_key()
    seen = {jwt.decode(mint(key, issuer="s", uid="u", audience="a", iat=1, exp=2),
                       options={"verify_signature": False})["jti"] for _ in range(50)}
    assert len(seen) == 50
    for text in seen:
        parsed = uuid.UUID(text)
        assert str(parsed) == text and parsed.version == 4 and parsed.variant == uuid.RFC_4122
