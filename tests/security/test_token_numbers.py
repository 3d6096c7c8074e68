"""Hostile numbers in a token's claims, against a real fiberd (issue 13, "hostile input").

A token's claims are parsed before its signature is checked, so a client (or
whoever can drop a file in the grantdir) controls every number in them. A
value such as ``10**400`` used to escape the verifier as OverflowError: the
client got ``internal`` and fiberd logged a traceback. Now each is an
audited ``invalid_token`` miss, and the daemon and its valid grants carry on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_fiber.client.connection import FiberdClient, Missed
from slurm_fiber.core.trust.issuers import public_jwk
from slurm_fiber.core.trust.mint import compact_jws
from tests.core.runtime.fiberdkit import AUDIENCE, Site, ThreadFiberd, fiberd_in_thread

HUGE = 10**400


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path, uuid.uuid4().hex)


@pytest.fixture
def fiberd(site: Site) -> Iterator[ThreadFiberd]:
    with fiberd_in_thread(site) as served:
        yield served


def signed(site: Site, **over: Any) -> str:
    """A token the site really signed, with ``over`` replacing (or adding) claims."""
    now = int(time.time())
    claims: dict[str, Any] = {"iss": "site", "sub": "g9", "aud": AUDIENCE, "iat": now,
                              "exp": now + 600, "jti": uuid.uuid4().hex, "fiber": {}}
    claims.update(over)
    return compact_jws(claims, site.key, public_jwk(site.key)["kid"])


def audit_records(fiberd: ThreadFiberd) -> list[dict[str, Any]]:
    path = fiberd.path.parent / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("claims", [
    {"exp": HUGE}, {"iat": -HUGE}, {"nbf": HUGE},
    {"fiber": {"limits": {"memory": HUGE}}}, {"fiber": {"limits": {"pids": -HUGE}}},
    {"fiber": {"limits": {"cpu": HUGE}}}, {"fiber": {"limits": {"seconds": HUGE}}},
    {"fiber": {"limits": {"fibers": HUGE}}},
], ids=lambda c: json.dumps(c)[:40])
def test_a_huge_number_in_a_claim_is_an_audited_invalid_token(
        site: Site, fiberd: ThreadFiberd, claims: dict[str, Any]) -> None:
    token = signed(site, **claims)
    with FiberdClient(fiberd.path) as client:
        with pytest.raises(Missed) as miss:
            client.clone(token=token, exec={"argv": ["true"]})
        assert miss.value.code == "invalid_token" and not miss.value.retryable
        assert "\n" not in miss.value.reason and "must be" in miss.value.reason
        assert client.request("ready") == {"ready": True}  # the same connection carries on
    refusals = [r for r in audit_records(fiberd)
                if r["event"] == "refuse" and r.get("detail") == "bad_claim"]
    assert len(refusals) == 1 and "must be" in refusals[0]["reason"]


def test_a_huge_number_in_a_grant_file_refuses_that_grant_alone(site: Site,
                                                               fiberd: ThreadFiberd) -> None:
    site.drop("g9", token=signed(site, exp=HUGE))  # next to the valid grant g1
    end = time.monotonic() + 15
    while not [r for r in audit_records(fiberd) if r.get("detail") == "bad_claim"]:
        assert time.monotonic() < end, "the bad grant file was never refused"
        time.sleep(0.05)
    with FiberdClient(fiberd.path) as client:
        assert client.clone(grant="g1", exec={"argv": ["true"]})["grant"] == "g1"
        grants = [g["uid"] for g in client.request("list_grants")["grants"]]  # type: ignore[union-attr]
        assert grants == ["g1"]


def test_token_inspect_and_verify_show_a_huge_time_without_a_traceback(site: Site) -> None:
    script = Path(sys.executable).with_name("slurm-fiber")
    token = signed(site, exp=HUGE, iat=-HUGE)
    inspect = subprocess.run([str(script), "token", "inspect", token], capture_output=True,
                             text=True, timeout=60)
    assert inspect.returncode == 0 and "Traceback" not in inspect.stderr, inspect.stderr
    shown = json.loads(inspect.stdout)
    assert shown["exp_utc"] == shown["iat_utc"] == "out of range" and "expires_in" not in shown
    verify = subprocess.run([str(script), "token", "verify", "--trust", f"site={site.jwks}",
                             "--aud", AUDIENCE, token], capture_output=True, text=True, timeout=60)
    assert verify.returncode == 1 and "Traceback" not in verify.stderr, verify.stderr
    assert json.loads(verify.stdout)["reason"] == "bad_claim"
