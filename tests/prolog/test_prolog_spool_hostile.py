"""One hostile spooled token never costs a job its valid ones (issue 13, "hostile input").

The real ``slurm-fiber-prolog`` console script runs as slurmd runs it
(hookkit: ``env -i``, root) over a spool holding valid tokens next to
tokens with out-of-range numbers (signed by the site, and unsigned), a FIFO
and a directory. Before the fix, one token with ``exp`` 10**400 made the
verifier raise OverflowError and the whole spool step failed: no spooled
token of the job was placed.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from slurm_fiber.core.trust.issuers import public_jwk
from slurm_fiber.core.trust.mint import compact_jws, generate_key
from slurm_fiber.homes.slurm.paths import job_paths
from tests.hooks.hookkit import ISSUER, Site, job_env, run_hook

if TYPE_CHECKING:
    from tests.security.userkit import JobUser

HUGE = 10**400


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path / "site")


def token(key: Any, audience: str, *, kid_of: Any = None, **over: Any) -> bytes:
    """A compact JWS of ``key`` (under the kid of ``kid_of``, default ``key``'s own)."""
    now = int(time.time())
    claims: dict[str, Any] = {"iss": ISSUER, "sub": "cp-1", "aud": audience, "iat": now,
                              "exp": now + 600, "jti": uuid.uuid4().hex, "fiber": {}}
    claims.update(over)
    return compact_jws(claims, key, public_jwk(kid_of or key)["kid"]).encode()


def test_one_bad_spooled_token_never_drops_the_others(site: Site, test_user: JobUser) -> None:
    spool = site.root / "spool"
    site.configure(f'spool_dir = "{spool}"')
    drop = spool / ISSUER / "47"
    drop.mkdir(parents=True)
    audience = f"slurm:{ISSUER}:47"
    (drop / "a-good.jwt").write_bytes(token(site.key, audience))
    (drop / "b-huge-exp.jwt").write_bytes(token(site.key, audience, exp=HUGE))
    (drop / "c-unsigned.jwt").write_bytes(token(generate_key(), audience, kid_of=site.key,
                                                    exp=HUGE))
    (drop / "d-huge-memory.jwt").write_bytes(
        token(site.key, audience, fiber={"limits": {"memory": HUGE}}))
    (drop / "e-negative-iat.jwt").write_bytes(token(site.key, audience, iat=-HUGE))
    os.mkfifo(drop / "f-fifo.jwt")
    (drop / "g-dir.jwt").mkdir()
    (drop / "z-good.jwt").write_bytes(token(site.key, audience))
    out = run_hook("prolog", job_env(site, 47, test_user.uid, test_user.gid, test_user.name))
    assert out.returncode == 0, out.stderr
    grants = job_paths(site.state_root, "n1", 47).grantdir
    assert sorted(p.name for p in grants.iterdir()) == [
        "job-47.jwt", "spool-a-good.jwt", "spool-z-good.jwt"]
    lines = out.stderr.splitlines()
    assert "Traceback" not in out.stderr and len(lines) == 6, out.stderr
    assert all(line.startswith("slurm-fiber-prolog: job 47: spool: ") for line in lines)
    said = {name: [line for line in lines if f"/{name}.jwt: skipped, " in line]
            for name in ("b-huge-exp", "c-unsigned", "d-huge-memory", "e-negative-iat",
                         "f-fifo", "g-dir")}
    assert all(len(found) == 1 for found in said.values()), said
    assert "bad_claim: claim 'exp' must be" in said["b-huge-exp"][0]
    assert "bad_signature" in said["c-unsigned"][0]
    assert "fiber.limits.memory must be" in said["d-huge-memory"][0]
    assert "not a regular file" in said["f-fifo"][0]
