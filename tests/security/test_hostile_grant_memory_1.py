"""Finding (issue 38, low): a grant with ``memory: 1`` answered ``cold`` for ever and kept
its cgroup.

A template cannot start in a 1-byte memory cgroup: it was killed, re-warmed with
backoff, killed again, and every Clone got the retryable ``cold`` while its grant's
cgroup stayed carved. A limit below its floor (core/fiberspec.py ``LIMIT_FLOORS``) is
now ``invalid_token`` with a one-line reason, audited, and nothing is carved. A real
root fiberd on this host's cgroups (hybrid), in-process.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.trust.issuers import public_jwk
from slurm_fiber.core.trust.mint import compact_jws
from tests.core.processkit import aio
from tests.core.runtime.fiberdkit import AUDIENCE, REPO, Site, running_fiberd


def tiny_token(site: Site, uid: str) -> str:
    """A site-signed grant asking for 1 byte of memory (minted by hand: ``mint`` refuses it
    now, as the verifier does)."""
    now = int(time.time())
    claims: dict[str, Any] = {
        "iss": "site", "sub": uid, "aud": AUDIENCE, "iat": now, "exp": now + 600,
        "jti": uuid.uuid4().hex,
        "fiber": {"limits": {"memory": 1},
                  "template": {"env": {"SF_TEST_MARK": site.mark, "PYTHONPATH": str(REPO)}}}}
    return compact_jws(claims, site.key, public_jwk(site.key)["kid"])


@aio
async def test_hostile_grant_memory_1_is_refused_not_cold_and_carves_nothing(
        tmp_path: Path, cgroup_root: Path) -> None:
    site = Site(tmp_path, uuid.uuid4().hex)
    site.drop("tiny", token=tiny_token(site, "tiny"))
    async with running_fiberd(site, cgroup_root=str(cgroup_root), cgroup_backend="auto") as live:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the grantdir's delivery, and a warm's time
            miss = await live.clone("tiny", argv=("true",))
            assert isinstance(miss, Miss) and miss.code is not MissCode.COLD, miss
            await asyncio.sleep(0.2)
        inline = await live.clone(None, argv=("true",), token=tiny_token(site, "tiny2"))
        assert isinstance(inline, Miss) and inline.code is MissCode.INVALID_TOKEN, inline
        assert "fiber.limits.memory is 1, below" in inline.reason
        assert not [p for p in cgroup_root.iterdir() if p.name.startswith("grant-")]
    records = [json.loads(x) for x in (site.state / "audit.jsonl").read_text().splitlines()]
    refused = [r for r in records if r["event"] == "refuse"]
    assert refused and all("fiber.limits.memory is 1" in r["reason"] for r in refused), refused
    assert all(r["detail"] == "bad_claim" for r in refused), refused
