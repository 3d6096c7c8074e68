"""Token verification: every reason code, each bad token of issue 2, leeway and the clock."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest
from cryptography.hazmat.primitives import serialization

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.trust.mint import generate_key
from slurm_fiber.core.trust.tokens import MAX_TOKEN_BYTES, TokenReason, TokenRefused, TokenVerifier
from tests.core.tokenkit import AUDIENCE, DROP, b64

R = TokenReason


def refused(verifier: TokenVerifier, raw: object) -> TokenRefused:
    with pytest.raises(TokenRefused) as err:
        verifier.verify(raw)  # type: ignore[arg-type]
    assert err.value.detail and "\n" not in err.value.detail
    return err.value


def test_valid_tokens_of_both_algorithms(verifier, site, other, clock):
    for issuer in (site, other):
        vt = verifier.verify(issuer.mint(clock, sub="u-1"))
        assert (vt.uid, vt.issuer, vt.audience) == ("u-1", issuer.name, (AUDIENCE,))
        assert vt.spec.limits.fibers == 2 and vt.leeway_used == 0
        assert vt.exp == int(clock.wall()) + 3600


def test_fiber_claim_is_parsed_into_typed_spec(verifier, site, clock):
    fiber = {"template": {"preload": ["json", "email.parser"], "warm": "pkg.mod:warm",
                          "env": {"OMP_NUM_THREADS": "1"}},
             "limits": {"fibers": 4, "memory": 1 << 30, "pids": 64, "cpu": 1.5, "seconds": 90},
             "devices": ["gpu"]}
    spec = verifier.verify(site.mint(clock, fiber=fiber)).spec
    assert spec.template.preload == ("json", "email.parser")
    assert spec.template.warm == "pkg.mod:warm" and spec.template.env == {"OMP_NUM_THREADS": "1"}
    assert (spec.limits.memory, spec.limits.cpu, spec.limits.seconds) == (1 << 30, 1.5, 90.0)
    assert spec.devices == ("gpu",)


def test_oversize_is_refused_before_parsing(verifier):
    assert refused(verifier, b"a" * (MAX_TOKEN_BYTES + 1)).reason is R.OVERSIZE


@pytest.mark.parametrize("raw", [
    "not-a-token", "a.b", "a.b.c.d", "ab$c.def.ghi", "é.é.é", b"\xff\xfe.a.b", 12345, None,
    "a.b.",
])
def test_malformed_shapes(verifier, raw):
    assert refused(verifier, raw).reason is R.MALFORMED


def test_truncated_tokens_never_escape(verifier, site, clock):
    token = site.mint(clock)
    for cut in range(1, len(token)):
        err = refused(verifier, token[:cut])
        assert err.reason in {R.MALFORMED, R.BAD_SIGNATURE, R.BAD_HEADER}


def test_extra_segments(verifier, site, clock):
    assert refused(verifier, site.mint(clock) + ".e30").reason is R.MALFORMED


@pytest.mark.parametrize("payload", [b"[1,2]", b'"text"', b"42", b"null", b"{nope", b"NaN"])
def test_payload_json_but_not_an_object(verifier, site, payload):
    assert refused(verifier, site.sign(payload)).reason is R.MALFORMED


def test_header_not_an_object(verifier, site, clock):
    assert refused(verifier, site.sign(site.claims(clock), header=b"[]")).reason is R.MALFORMED


@pytest.mark.parametrize("header", [
    b'{"alg":"EdDSA","kid":"K","alg":"EdDSA"}',
])
def test_duplicate_header_member(verifier, site, clock, header):
    h = header.replace(b'"K"', json.dumps(site.kid).encode())
    err = refused(verifier, site.sign(site.claims(clock), header=h))
    assert err.reason is R.BAD_HEADER and "alg" in err.detail


@pytest.mark.parametrize("crit", [["exp"], ["b64"], ["x", "x"], [], "exp", [1]])
def test_critical_headers_are_refused(verifier, site, clock, crit):
    token = site.sign(site.claims(clock), header=site.header(crit=crit, exp=1))
    assert refused(verifier, token).reason is R.BAD_HEADER


def test_missing_kid(verifier, site, clock):
    token = site.sign(site.claims(clock), header=site.header(kid=DROP))
    assert refused(verifier, token).reason is R.BAD_HEADER


def test_alg_none(verifier, site, clock):
    header = b64(json.dumps({"alg": "none", "kid": site.kid}).encode())
    token = f"{header}.{b64(json.dumps(site.claims(clock)).encode())}."
    assert refused(verifier, token).reason is R.ALG_NOT_ALLOWED


def test_hs256_signed_with_the_public_key_as_secret(verifier, site, clock):
    public_pem = site.key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    signing_input = (f"{b64(json.dumps({'alg': 'HS256', 'kid': site.kid}).encode())}."
                     f"{b64(json.dumps(site.claims(clock)).encode())}")
    mac = hmac.new(public_pem, signing_input.encode(), hashlib.sha256).digest()
    assert refused(verifier, f"{signing_input}.{b64(mac)}").reason is R.ALG_NOT_ALLOWED


def test_alg_other_than_the_keys_pin(verifier, site, other, clock):
    # An ES256 signature presented under the EdDSA key's kid: the key's pin decides.
    token = site.sign(site.claims(clock), header=site.header(alg="ES256"))
    err = refused(verifier, token)
    assert err.reason is R.ALG_NOT_ALLOWED and "pinned to EdDSA" in err.detail


def test_unknown_issuer(verifier, site, clock):
    assert refused(verifier, site.mint(clock, iss="stranger")).reason is R.UNKNOWN_ISSUER


def test_unknown_kid(verifier, site, clock):
    token = site.sign(site.claims(clock), header=site.header(kid="no-such-kid"))
    assert refused(verifier, token).reason is R.UNKNOWN_KID


def test_key_of_another_issuer(verifier, site, other, clock):
    # Signed by `other`'s key (a trusted key), but claiming to be `site`.
    token = other.sign(other.claims(clock, iss=site.name))
    err = refused(verifier, token)
    assert err.reason is R.KEY_ISSUER_MISMATCH and other.name in err.detail


def test_bad_signature(verifier, site, other, clock):
    token = site.mint(clock)
    head, _, sig = token.rpartition(".")
    flipped = ("A" if sig[0] != "A" else "B") + sig[1:]
    assert refused(verifier, f"{head}.{flipped}").reason is R.BAD_SIGNATURE
    # a valid signature over other claims
    forged = site.mint(clock, sub="someone-else").rpartition(".")[2]
    assert refused(verifier, f"{head}.{forged}").reason is R.BAD_SIGNATURE


@pytest.mark.parametrize("claim", ["iss", "sub", "aud", "exp", "iat", "jti", "fiber"])
def test_missing_claims(verifier, site, clock, claim):
    err = refused(verifier, site.mint(clock, **{claim: DROP}))
    assert err.reason is R.MISSING_CLAIM and claim in err.detail


@pytest.mark.parametrize("claims", [
    {"iss": 7}, {"sub": ["u"]}, {"aud": 3}, {"aud": ["job-1", 4]}, {"exp": "soon"},
    {"exp": True}, {"iat": None}, {"nbf": "now"}, {"jti": 5}, {"jti": ""}, {"fiber": []},
    {"fiber": {"limits": {"fibres": 2}}}, {"fiber": {"limits": {"fibers": 0}}},
    {"fiber": {"limits": {"fibers": 1.5}}}, {"fiber": {"limits": {"memory": True}}},
    {"fiber": {"limits": {"seconds": -1}}}, {"fiber": {"template": {"warm": "no-colon"}}},
    {"fiber": {"template": {"preload": ["os; rm"]}}}, {"fiber": {"template": {"env": {"A=": "x"}}}},
    {"fiber": {"devices": ["gpu", "gpu"]}}, {"fiber": {"other": 1}},
])
def test_mistyped_claims(verifier, site, clock, claims):
    assert refused(verifier, site.mint(clock, **claims)).reason is R.BAD_CLAIM


def test_exp_not_after_iat(verifier, site, clock):
    now = int(clock.wall())
    assert refused(verifier, site.mint(clock, iat=now, exp=now)).reason is R.BAD_CLAIM


def test_duplicate_claim(verifier, site, clock):
    body = json.dumps(site.claims(clock))[:-1] + ', "sub": "intruder"}'
    err = refused(verifier, site.sign(body.encode()))
    assert err.reason is R.BAD_CLAIM and "sub" in err.detail


@pytest.mark.parametrize("uid", ["", "-lead", "has space", "x" * 129, "semi;colon", "ü"])
def test_uid_outside_the_pattern(verifier, site, clock, uid):
    assert refused(verifier, site.mint(clock, sub=uid)).reason is R.BAD_UID


def test_wrong_audience(verifier, site, clock):
    assert refused(verifier, site.mint(clock, aud="job-2")).reason is R.WRONG_AUDIENCE
    assert verifier.verify(site.mint(clock, aud=["job-2", AUDIENCE])).audience[1] == AUDIENCE


def test_expired_has_no_leeway(verifier, site, clock: FakeClock):
    now = int(clock.wall())
    token = site.mint(clock, iat=now - 100, exp=now + 10)
    verifier.verify(token)
    clock.advance(10)  # exp == now: over, though well inside the 30 s leeway
    assert refused(verifier, token).reason is R.EXPIRED


def test_not_yet_valid_and_leeway(verifier, site, clock):
    now = int(clock.wall())
    assert refused(verifier, site.mint(clock, nbf=now + 31)).reason is R.NOT_YET_VALID
    vt = verifier.verify(site.mint(clock, nbf=now + 20))
    assert vt.leeway_used == 20 and vt.nbf == now + 20


def test_issued_in_the_future(verifier, site, clock):
    now = int(clock.wall())
    err = refused(verifier, site.mint(clock, iat=now + 31, exp=now + 900))
    assert err.reason is R.ISSUED_IN_FUTURE
    assert verifier.verify(site.mint(clock, iat=now + 29, exp=now + 900)).leeway_used == 29


def test_time_checks_follow_the_injected_clock_not_the_wall(trust, site, clock):
    # A token of 2001 on a fake clock that says 2001: the real wall clock (which
    # PyJWT would read) calls it long expired, yet it passes.
    old = FakeClock(wall=1_000_000_000.0)
    verifier = TokenVerifier(trust, AUDIENCE, old)
    vt = verifier.verify(site.mint(old))
    assert vt.exp == 1_000_003_600


def test_every_reason_code_is_exercised():
    # The tests above cover each code; this pins the closed set itself.
    assert {r.value for r in TokenReason} == {
        "oversize", "malformed", "bad_header", "alg_not_allowed", "unknown_issuer",
        "unknown_kid", "key_issuer_mismatch", "bad_signature", "missing_claim", "bad_claim",
        "bad_uid", "wrong_audience", "expired", "not_yet_valid", "issued_in_future",
    }


def test_the_parse_memo_never_skips_signature_or_time_checks(trust, site, clock):
    verifier = TokenVerifier(trust, AUDIENCE, clock, memo_size=2)
    token = site.mint(clock, exp=int(clock.wall()) + 60)
    verifier.verify(token)
    head, _, sig = token.rpartition(".")
    forged = ("A" if sig[0] != "A" else "B") + sig[1:]
    assert refused(verifier, f"{head}.{forged}").reason is R.BAD_SIGNATURE
    clock.advance(60)
    assert refused(verifier, token).reason is R.EXPIRED
    for i in range(5):  # bounded: older entries are dropped
        refused(verifier, site.mint(clock, sub=f"u{i}", aud="elsewhere"))
    assert len(verifier._memo) == 2


def test_a_memoised_refusal_is_raised_again(verifier, site, clock):
    token = site.mint(clock, sub="bad uid")
    first, second = refused(verifier, token), refused(verifier, token)
    assert first.reason is second.reason is R.BAD_UID and first is not second


HUGE = 10**400  # a JSON integer Python parses exactly and no float can hold
HOSTILE_NUMBERS = [HUGE, -HUGE, "1e400", "-1e400", -1, -0.5, True, False]
NUMBER_CLAIMS = ["exp", "iat", "nbf", *(f"fiber.limits.{n}" for n in
                                        ("fibers", "memory", "pids", "cpu", "seconds"))]


def claims_with(site, clock, where: str, value: object) -> bytes:
    """The site's claims as JSON with ``where`` set to ``value`` (a str is spliced in raw)."""
    marker = "__HOSTILE__"
    claims = site.claims(clock)
    if where.startswith("fiber.limits."):
        claims["fiber"] = {"limits": {where.rpartition(".")[2]: marker}}
    else:
        claims[where] = marker
    raw = value if isinstance(value, str) else json.dumps(value)
    return json.dumps(claims).replace(f'"{marker}"', raw).encode()


@pytest.mark.parametrize("where", NUMBER_CLAIMS)
@pytest.mark.parametrize("value", HOSTILE_NUMBERS, ids=lambda v: str(v)[:8])
def test_out_of_range_numbers_are_bad_claims_never_a_crash(verifier, site, clock, where, value):
    payload = claims_with(site, clock, where, value)
    err = refused(verifier, site.sign(payload))
    assert err.reason is R.BAD_CLAIM and where.rpartition(".")[2] in err.detail
    # not signed by the site (parsed all the same, before the signature): bad_signature
    forged = site.sign(payload, key=generate_key("EdDSA"))
    assert refused(verifier, forged).reason is R.BAD_SIGNATURE


@pytest.mark.parametrize(("name", "high"), [("fibers", 1 << 20), ("memory", (1 << 63) - 1),
                                            ("pids", 1 << 22), ("seconds", 1_000_000_000)])
def test_limits_have_an_upper_bound_the_kernel_can_apply(verifier, site, clock, name, high):
    ok = verifier.verify(site.mint(clock, fiber={"limits": {name: high}}))
    assert getattr(ok.spec.limits, name) == high
    err = refused(verifier, site.mint(clock, fiber={"limits": {name: high + 1}}))
    assert err.reason is R.BAD_CLAIM and f"at most {high}" in err.detail


def test_times_up_to_the_year_9999_and_no_further(verifier, site, clock):
    from slurm_fiber.core.trust.tokens import MAX_UNIX_TIME

    assert verifier.verify(site.mint(clock, exp=MAX_UNIX_TIME)).exp == MAX_UNIX_TIME
    err = refused(verifier, site.mint(clock, exp=MAX_UNIX_TIME + 1))
    assert err.reason is R.BAD_CLAIM and "'exp'" in err.detail
