"""Stale holders: reclaimed only when provably gone, only with steal_stale, always audited."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.lease.dirlease import Dir
from slurm_fiber.lease.holder import Holder, ProcessRef, compose_session
from slurm_fiber.lease.leases import Caller, Leases
from slurm_fiber.lease.rules import Refusal
from slurm_fiber.lease.stale import AUDIT_FILE, holder_gone_reason, process_ref
from slurm_fiber.lease.state import Party

HOST = "node1"
ME = Caller(Party(session="me", host=HOST), process=process_ref(os.getpid()))


def dead_process() -> ProcessRef:
    child = subprocess.Popen(["true"])
    ref = process_ref(child.pid)
    child.wait()
    return ref


def holder(process: ProcessRef | None, host: str = HOST) -> Holder:
    return Holder(env="gpu0", holder="bob", session=compose_session("old", process),
                  purpose="crashed job", since="2027-01-01T00:00:00Z", host=host)


@pytest.mark.parametrize(
    ("record", "gone"),
    [
        (lambda: holder(dead_process()), "no longer exists"),
        (lambda: holder(ProcessRef(os.getpid(), 1.0)), "now belongs to a process started"),
        (lambda: holder(process_ref(os.getpid())), None),
        (lambda: holder(ProcessRef(os.getpid())), None),
        (lambda: holder(dead_process(), host="elsewhere"), None),
        (lambda: holder(dead_process(), host=""), None),
        (lambda: holder(None), None),
    ],
    ids=["dead", "pid-reused", "alive", "alive-no-start", "other-host", "no-host", "no-pid"],
)
def test_provably_gone(record, gone: str | None) -> None:
    reason = holder_gone_reason(record(), HOST)
    assert (reason is None) if gone is None else (gone in (reason or ""))


def test_steal_stale_is_explicit_and_audited(tmp_path: Path, clock: FakeClock) -> None:
    leases = Leases(tmp_path, tmp_path / "state.json", clock, host=HOST)
    stale = holder(dead_process())
    Dir(tmp_path).claim("gpu0", stale)
    with pytest.raises(Refusal, match="is held by bob"):
        leases.claim("gpu0", ME, "mine")
    assert Dir(tmp_path).get("gpu0") == stale, "never reclaimed silently"
    mine = leases.claim("gpu0", ME, "mine", steal_stale=True)
    assert Dir(tmp_path).get("gpu0") == mine and mine.party() == ME.party
    lines = (tmp_path / AUDIT_FILE).read_text().splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["action"] == "steal-stale" and entry["holder"] == stale.to_json()
    assert "no longer exists" in entry["reason"] and entry["by"]["session"] == "me"


def test_a_live_holder_is_never_stolen(tmp_path: Path, clock: FakeClock) -> None:
    leases = Leases(tmp_path, tmp_path / "state.json", clock, host=HOST)
    live = holder(process_ref(os.getpid()))
    Dir(tmp_path).claim("gpu0", live)
    with pytest.raises(Refusal, match="is held by bob"):
        leases.claim("gpu0", ME, "mine", steal_stale=True)
    assert Dir(tmp_path).get("gpu0") == live
    assert not (tmp_path / AUDIT_FILE).exists()
