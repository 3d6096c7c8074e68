"""The audit log: whole lines only, seq continues across restarts, torn tails repaired."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slurm_fiber.core.audit.log import AuditEvent, AuditLog, check_chain
from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.trust.grant import ScopeClaim


def records(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n")
    return [json.loads(line) for line in data.splitlines()]


def test_one_line_per_record_with_scope_and_fields(tmp_path, clock):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, "always", clock=clock, scope=[ScopeClaim("slurm.job_id", "42")])
    miss = Miss(MissCode.COLD, "warming", retry_after=1.0)
    assert log.write(AuditEvent.MISS, uid="g1", miss=miss, caller_uid=1000, caller_pid=7,
                     reason="multi\nline") == 1
    assert log.write(AuditEvent.EPOCH_BUMP, epoch=3, health_age=None) == 2
    log.close()
    first, second = records(path)
    assert first["seq"] == 1 and first["event"] == "miss" and first["time"] == clock.wall()
    assert first["scope"] == {"slurm.job_id": "42"} and first["miss"]["code"] == "cold"
    assert first["reason"] == "multi\nline" and second["epoch"] == 3
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_reserved_names_are_refused(tmp_path, clock):
    log = AuditLog(tmp_path / "a", "never", clock=clock)
    with pytest.raises(ValueError, match="reserved"):
        log.write("admit", seq=9)


def test_seq_continues_across_restarts(tmp_path, clock):
    path = tmp_path / "audit.jsonl"
    for _ in range(3):
        log = AuditLog(path, "interval", clock=clock)
        log.write("admit")
        log.close()
    assert [r["seq"] for r in records(path)] == [1, 2, 3]


def test_a_torn_last_line_is_cut_and_noted(tmp_path, clock):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, "never", clock=clock)
    log.write("admit", uid="g1")
    log.close()
    with path.open("ab") as f:
        f.write(b'{"seq":2,"time":1,"event":"cl')  # a crash mid-line
    log = AuditLog(path, "never", clock=clock)
    log.write("clone", uid="g1")
    log.close()
    rs = records(path)
    assert [r["event"] for r in rs] == ["admit", "audit_repaired", "clone"]
    assert rs[1]["bytes_dropped"] == 29 and [r["seq"] for r in rs] == [1, 2, 3]


def test_a_log_that_is_only_a_torn_line(tmp_path, clock):
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b'{"seq":1,"ti')
    AuditLog(path, "never", clock=clock).close()
    assert [r["event"] for r in records(path)] == ["audit_repaired"]


WRITER = textwrap.dedent("""
    import sys
    from slurm_fiber.core.audit.log import AuditLog
    log = AuditLog(sys.argv[1], "never")
    pad = "x" * 3000
    i = 0
    while True:
        i += 1
        log.write("clone", uid="g1", i=i, pad=pad)
        if i == 200:
            print("ready", flush=True)
""")


def test_sigkill_mid_stream_leaves_only_whole_lines(tmp_path):
    path = tmp_path / "audit.jsonl"
    for _ in range(3):  # kill, reopen (repair) and kill again
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        AuditLog(path, "never").close()  # what a restarted fiberd does first
        rs = records(path)  # every line parses
        assert [r["seq"] for r in rs] == list(range(1, len(rs) + 1))
    assert len(rs) > 600


def test_write_many_appends_whole_records_with_consecutive_seqs(tmp_path, clock):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, "always", clock=clock)
    log.write(AuditEvent.ADMIT, uid="g1")
    batch = [(AuditEvent.RELEASE, {"fiber": f"f{i}", "reason": "a\nb"}) for i in range(3)]
    assert log.write_many(batch) == 4
    assert log.write_many([]) == 4
    with pytest.raises(ValueError, match="reserved"):
        log.write_many([(AuditEvent.RELEASE, {"fiber": "x"}), ("exit", {"seq": 1})])
    assert log.write("exit") == 5  # a refused batch wrote nothing and took no seq
    log.close()
    got = records(path)
    assert [r["seq"] for r in got] == [1, 2, 3, 4, 5]
    assert [r.get("fiber") for r in got[1:4]] == ["f0", "f1", "f2"]
    assert got[2]["reason"] == "a\nb" and got[4]["event"] == "exit"


def test_a_batch_that_cannot_be_written_leaves_nothing(tmp_path, clock):
    log = AuditLog(tmp_path / "audit.jsonl", "always", clock=clock)
    log.write(AuditEvent.ADMIT, uid="g1")
    log.close()
    with pytest.raises(OSError):
        log.write_many([(AuditEvent.RELEASE, {"fiber": "f1"})])
    assert log.seq == 1 and len(records(tmp_path / "audit.jsonl")) == 1


@pytest.fixture
def fsyncs(monkeypatch):
    """Every fsync the audit log makes, by descriptor (os.fsync still runs)."""
    calls: list[int] = []
    real = os.fsync

    def counted(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr("slurm_fiber.core.audit.log.os.fsync", counted)
    return calls


def test_an_observation_shares_the_next_decisions_fsync(tmp_path, clock, fsyncs):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, "always", clock=clock)
    log.write(AuditEvent.CLONE, fiber="f1")
    assert len(fsyncs) == 1 and not log.unsynced
    log.write_many([(AuditEvent.FIBER_EXIT, {"fiber": "f1"})], durable=False)
    assert len(fsyncs) == 1 and log.unsynced
    assert records(path)[-1]["event"] == "fiber_exit"  # in the file at once, whole
    log.write(AuditEvent.CLONE, fiber="f2")  # one fsync makes both durable
    assert len(fsyncs) == 2 and not log.unsynced
    log.sync()  # nothing waits: no fsync
    assert len(fsyncs) == 2


def test_sync_makes_waiting_observations_durable_once(tmp_path, clock, fsyncs):
    log = AuditLog(tmp_path / "audit.jsonl", "always", clock=clock)
    log.write_many([(AuditEvent.FIBER_EXIT, {"fiber": "f1"})], durable=False)
    log.write_many([(AuditEvent.FIBER_EXIT, {"fiber": "f2"})], durable=False)
    assert fsyncs == [] and log.unsynced
    log.sync()
    log.sync()
    assert len(fsyncs) == 1 and not log.unsynced


@pytest.mark.parametrize("policy", ["never", "interval"])
def test_other_policies_leave_observations_as_any_record(tmp_path, clock, fsyncs, policy):
    log = AuditLog(tmp_path / "audit.jsonl", policy, interval=0.0, clock=clock)
    log.write_many([(AuditEvent.FIBER_EXIT, {"fiber": "f1"})], durable=False)
    assert not log.unsynced
    assert len(fsyncs) == (1 if policy == "interval" else 0)


def test_records_chain_and_check_chain_names_edits_gaps_and_a_missing_stop(
        tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, "never")
    log.write("start")
    log.write("clone", fiber="a")
    log.close()
    again = AuditLog(path, "never")  # a restart continues the chain from the last line
    again.write("clone", fiber="b")
    again.write("stop")
    again.close()
    lines = path.read_bytes().splitlines()
    assert json.loads(lines[0])["prev"] == ""
    good = check_chain(lines)
    assert good.consistent and (good.first_seq, good.last_seq, good.lines) == (1, 4, 4)
    edited = [*lines[:1], lines[1].replace(b'"a"', b'"z"'), *lines[2:]]
    assert check_chain(edited).problems == [
        "line 3 does not chain to the line before it (a line was edited, removed or inserted)"]
    gap = check_chain([*lines[:1], *lines[2:]])
    assert "line 2: seq 3 follows 1" in gap.problems and not gap.consistent
    cut = check_chain(lines[:3])
    assert cut.problems == [] and not cut.stopped and not cut.consistent
    assert check_chain(lines[1:]).problems[0].startswith("the log begins at seq 2")
    assert check_chain([b"junk", *lines]).problems[0] == "line 1 is not an audit record"
