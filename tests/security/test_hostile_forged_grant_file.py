"""The grant source hands the core what it knows; it never reads an unverified token.

A grantdir file counts as holding a grant only once the core verified its token. Before
issue 41 the grantdir read each file's ``sub`` unverified to track which UIDs the files
held, so a forged file (another key, the right issuer's name) naming a real grant kept
that grant held: deleting the real grant's file, the documented way to withdraw it,
removed nothing while the forged file stayed. Now the forged token is refused after
verification and audited as before (a ``refuse`` record, ``unknown_kid``), the file
holds nothing, and deleting the real file removes the grant.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from slurm_fiber.core.trust.mint import generate_key
from tests.core.processkit import aio
from tests.core.runtime.fiberdkit import Site, running_fiberd, until, warm


@aio
async def test_hostile_a_forged_file_naming_a_grant_does_not_keep_it_held(
        tmp_path: Path) -> None:
    site = Site(tmp_path, uuid.uuid4().hex)
    forger = Site(tmp_path / "forger", site.mark, key=generate_key())
    site.drop("g1")

    def records(event: str) -> list[dict[str, object]]:
        lines = (site.state / "audit.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["event"] == event]

    async with running_fiberd(site) as live:
        await warm(live)
        site.drop("forged", token=forger.token("g1"))  # forged.jwt names g1
        await until(lambda: bool(records("refuse")))
        assert live.core.book.grant("g1") is not None
        site.remove("g1")  # withdraw the real grant
        await until(lambda: live.core.book.grant("g1") is None, within=10)
        assert [r["uid"] for r in records("remove")] == ["g1"]
    (refused,) = records("refuse")
    assert refused["detail"] == "unknown_kid", refused
