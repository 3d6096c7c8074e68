"""``slurm-fiber audit`` on real logs written by AuditLog: lines, JSON, filters, junk, follow."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slurm_fiber.cli.audit import COLUMNS
from slurm_fiber.cli.main import app
from slurm_fiber.core.audit.log import AuditLog

SLURM_FIBER = str(Path(sys.executable).parent / "slurm-fiber")


def write_log(path: Path) -> list[dict[str, object]]:
    """A log as fiberd writes it; returns its records."""
    log = AuditLog(path, "never")
    log.write("start", home="standalone", pid=42)
    log.write("admit", uid="g1", jti="j-1", new_grant=True)
    log.write("clone", uid="g1", fiber="ab-1", pid=4242, mode="call")
    log.write("miss", uid="g1", code="capacity", reason="2 fibers of 2 are running")
    log.write("fiber_exit", uid="g1", fiber="ab-1", exit={"exit_code": 0})
    log.close()
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(*args: str) -> tuple[int, list[str], str]:
    out = CliRunner().invoke(app, ["audit", *args])
    return out.exit_code, out.stdout.splitlines(), out.stderr


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "audit.jsonl"
    write_log(path)
    return path


def test_one_aligned_line_per_record_with_the_reason_last(log: Path) -> None:
    code, lines, err = run("--path", str(log))
    assert code == 0 and err == ""
    header, *rows = lines
    assert header.split()[:6] == ["TIME", "SEQ", "EVENT", "UID", "FIBER", "CODE"]
    assert len(rows) == 5
    starts = [sum(w + 1 for _, w in COLUMNS[:i]) for i in range(len(COLUMNS))]
    for row in rows:  # every column starts at the same offset as its header
        assert all(row[s - 1] == " " for s in starts[1:])
    miss = rows[3].split()
    assert miss[1:6] == ["4", "miss", "g1", "-", "capacity"]
    assert rows[3].endswith('reason="2 fibers of 2 are running"')
    assert rows[0].startswith(time.strftime("%Y-", time.gmtime())) and "Z " in rows[0]
    assert "exit={\"exit_code\":0}" in rows[4]


def test_json_passes_the_records_through(log: Path) -> None:
    code, lines, _ = run("--path", str(log), "--json")
    assert code == 0
    assert lines == log.read_text().splitlines()


def test_filters_by_seq_and_event(log: Path) -> None:
    _, lines, _ = run("--path", str(log), "--json", "--since", "2")
    assert [json.loads(x)["seq"] for x in lines] == [3, 4, 5]
    _, lines, _ = run("--path", str(log), "--json", "--event", "miss", "--event", "admit")
    assert [json.loads(x)["event"] for x in lines] == ["admit", "miss"]
    _, lines, _ = run("--path", str(log), "--json", "--since", "3", "--event", "clone")
    assert lines == []


def test_junk_and_a_torn_tail_are_reported_once_and_skipped(log: Path) -> None:
    with log.open("ab") as f:
        f.write(b"not json at all\n[1, 2]\n{\"seq\": \"x\", \"event\": 1}\n\xff\xfe\n")
        f.write(b'{"seq":99,"time":1,"event":"cl')  # torn: a crash mid-write
    code, lines, err = run("--path", str(log), "--json")
    assert code == 0 and len(lines) == 5
    reports = err.splitlines()
    assert len(reports) == 5 and all("skipped" in r for r in reports)
    assert f"{log}:6: not a JSON record" in reports[0]
    assert f"{log}:7: not a JSON object" in reports[1]
    assert f"{log}:10: torn last line" in reports[4]
    assert "Traceback" not in err


def test_the_log_is_found_from_the_state_dir_and_a_missing_one_is_one_line(
        log: Path, tmp_path: Path) -> None:
    code, lines, _ = run("--state-dir", str(tmp_path), "--json")
    assert code == 0 and len(lines) == 5
    code, _, err = run("--path", str(tmp_path / "nope.jsonl"))
    assert code == 1 and err.count("\n") == 1 and "No such file" in err
    code, _, _ = run("--path", str(log), "--state-dir", str(tmp_path))
    assert code == 2


class Follower:
    """``slurm-fiber audit --follow --json`` as a subprocess, read with a deadline."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen([SLURM_FIBER, "audit", "--follow", "--json", "--path",
                                      str(path)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.buffer = {1: b"", 2: b""}

    def lines(self, stream: int, count: int, within: float = 10.0) -> list[str]:
        """The next ``count`` lines of stdout (1) or stderr (2)."""
        pipe = self.proc.stdout if stream == 1 else self.proc.stderr
        assert pipe is not None
        end = time.monotonic() + within
        while self.buffer[stream].count(b"\n") < count:
            left = end - time.monotonic()
            assert left > 0, f"only got {self.buffer[stream]!r}"
            if select.select([pipe], [], [], left)[0]:
                chunk = os.read(pipe.fileno(), 65536)
                assert chunk, "the follower exited"
                self.buffer[stream] += chunk
        *got, rest = self.buffer[stream].split(b"\n", count)
        self.buffer[stream] = rest
        return [g.decode() for g in got]

    def stop(self) -> tuple[int, bytes]:
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=10)
        return self.proc.returncode, err


def test_follow_picks_up_appended_records_and_waits_for_a_torn_line(log: Path) -> None:
    follower = Follower(log)
    try:
        assert len(follower.lines(1, 5)) == 5
        with log.open("ab") as f:  # half a line: waited for, not reported
            f.write(b'{"seq":6,"time":1,"event":"clo')
            f.flush()
            time.sleep(0.5)
            f.write(b'ne","uid":"g2"}\n')
        assert json.loads(follower.lines(1, 1)[0]) == {"seq": 6, "time": 1, "event": "clone",
                                                       "uid": "g2"}
        appended = AuditLog(log, "never")  # a restarted fiberd appends
        appended.write("miss", code="cold", reason="warming")
        appended.close()
        assert json.loads(follower.lines(1, 1)[0])["seq"] == 7
        with log.open("ab") as f:
            f.write(b"junk\n")
        assert "8: not a JSON record; skipped" in follower.lines(2, 1)[0]
        log.write_text('{"seq":1,"time":2,"event":"start"}\n')  # truncated and rewritten
        assert "the log was truncated" in follower.lines(2, 1)[0]
        assert json.loads(follower.lines(1, 1)[0]) == {"seq": 1, "time": 2, "event": "start"}
        fresh = log.with_name("fresh.jsonl")  # replaced by rename, as a rotation does
        fresh.write_text('{"seq":1,"time":3,"event":"start"}\n')
        fresh.rename(log)
        assert "the log was replaced" in follower.lines(2, 1)[0]
        assert json.loads(follower.lines(1, 1)[0])["time"] == 3
    finally:
        code, err = follower.stop()
    assert code == 0 and b"Traceback" not in err
