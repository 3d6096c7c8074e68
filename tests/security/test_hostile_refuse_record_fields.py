"""Finding (issue 38, low): refuse records swapped ``reason`` and ``detail``.

A refused token's audit record said ``reason: "bad_signature"`` and put the sentence a
person acts on in ``detail``, the other way round from every miss and from the Clone's
answer. A token another key signed, dropped into the grantdir as a job user could, is
refused and audited with the person's line in ``reason`` and the code in ``detail``.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from slurm_fiber.core.trust.mint import generate_key
from tests.core.processkit import aio
from tests.core.runtime.fiberdkit import Site, running_fiberd, until


@aio
async def test_hostile_refuse_record_has_reason_for_a_person_and_detail_the_code(
        tmp_path: Path) -> None:
    site = Site(tmp_path, uuid.uuid4().hex)
    forger = Site(tmp_path / "forger", site.mark, key=generate_key())
    site.drop("g1", token=forger.token("g1"))  # the right issuer's name, another key

    def refusals() -> list[dict[str, object]]:
        lines = (site.state / "audit.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["event"] == "refuse"]

    async with running_fiberd(site):
        await until(lambda: bool(refusals()))
    (refused, *_) = refusals()
    assert refused["detail"] == "unknown_kid", refused  # a key the site never published
    assert refused["reason"].startswith("token refused: "), refused
    assert refused["reason"] != refused["detail"]
