"""core/refusal_log.py: refusals audited whole once per caller, code and window, the rest
counted, with a real audit log and a fake clock."""

from __future__ import annotations

import json
from pathlib import Path

from slurm_fiber.core.api.server import Refusal
from slurm_fiber.core.api.service import Peer
from slurm_fiber.core.audit.log import AuditLog
from slurm_fiber.core.audit.refusals import RefusalLog
from slurm_fiber.core.clock import FakeClock


def refusals(path: Path) -> list[dict[str, object]]:
    return [r for r in map(json.loads, path.read_text().splitlines())
            if r["event"] == "api_refuse"]


def test_a_window_writes_one_whole_record_and_one_count_per_caller_and_code(
        tmp_path: Path) -> None:
    clock = FakeClock()
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(path, "never", clock=clock)
    rl = RefusalLog(audit, clock, window=60, max_keys=2)
    for uid in (1001, 1002, 1003, 1004):  # 1003 and 1004 overflow max_keys: counted as None
        for _ in range(10):
            rl.refused(Refusal("forbidden", "not allowed", Peer(7, uid, uid)))
    assert [r["caller_uid"] for r in refusals(path)] == [1001, 1002, None]
    clock.advance(30)
    rl.flush_due()  # the windows have not passed
    assert len(refusals(path)) == 3
    clock.advance(31)
    rl.flush_due()
    counted = {r["caller_uid"]: r["repeated"] for r in refusals(path) if "repeated" in r}
    assert counted == {1001: 9, 1002: 9, None: 19}
    rl.refused(Refusal("forbidden", "not allowed", Peer(7, 1001, 1001)))  # a new window
    rl.refused(Refusal("forbidden", "not allowed", Peer(7, 1001, 1001)))
    rl.flush()
    got = refusals(path)
    assert sum(int(r.get("repeated", 1)) for r in got) == 42  # every refusal accounted for
    assert len(got) == 8
