"""fiberd's record in the state dir: atomic write, tolerant read, a reused pid is not fiberd."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from slurm_fiber.homes.slurm.fiberdrecord import (
    FiberdRecord,
    parse_record,
    read_record,
    record_path,
    remove_record,
    start_time,
    this_process,
    write_record,
)


def test_write_read_remove(tmp_path: Path) -> None:
    record = this_process(tmp_path / "fiberd.sock", Path("/sys/fs/cgroup/x"))
    assert record.pid == os.getpid() and record.uid == os.geteuid() and record.is_running()
    write_record(tmp_path, record)
    assert read_record(tmp_path) == (record, None)
    assert [p.name for p in tmp_path.iterdir()] == ["fiberd.json"]  # no temporary left
    remove_record(tmp_path)
    remove_record(tmp_path)
    record_, why = read_record(tmp_path)
    assert record_ is None and why is not None and "No such file" in why


@pytest.mark.parametrize(("raw", "why"), [
    (b"", "not a JSON document"),
    (b"\xff", "not a JSON document"),
    (b"[]", "not a JSON object"),
    (b'{"pid": 0, "start": 1, "socket": "s", "cgroup_root": null, "uid": 0}', "pid"),
    (b'{"pid": true, "start": 1, "socket": "s", "cgroup_root": null, "uid": 0}', "pid"),
    (b'{"pid": 5, "start": "x", "socket": "s", "cgroup_root": null, "uid": 0}', "start"),
    (b'{"pid": 5, "start": 1, "socket": 3, "cgroup_root": null, "uid": 0}', "socket"),
    (b'{"pid": 5, "start": 1, "socket": "s", "cgroup_root": "rel", "uid": 0}', "absolute"),
    (b'{"pid": 5, "start": 1, "socket": "s", "cgroup_root": null, "uid": -1}', "uid"),
])
def test_junk_is_refused_in_one_line(raw: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_record(raw)


def test_read_tolerates_junk_links_and_oversize(tmp_path: Path) -> None:
    record_path(tmp_path).write_bytes(b"{" * 10_000)
    assert read_record(tmp_path)[1] is not None and "larger than" in str(read_record(tmp_path)[1])
    record_path(tmp_path).unlink()
    (tmp_path / "elsewhere.json").write_text("{}")
    record_path(tmp_path).symlink_to(tmp_path / "elsewhere.json")
    record, why = read_record(tmp_path)
    assert record is None and why is not None  # a link is never followed


def test_start_time_is_psutils_create_time() -> None:
    """fiberd records its start from /proc; the epilog checks it with psutil: they agree."""
    import psutil

    child = subprocess.Popen(["sleep", "30"])
    try:
        for pid in (os.getpid(), child.pid):
            assert start_time(pid) == pytest.approx(psutil.Process(pid).create_time(), abs=1e-6)
        assert FiberdRecord(child.pid, round(start_time(child.pid), 2), "s", None, 0).is_running()
    finally:
        child.kill()
        child.wait()
    with pytest.raises(OSError):
        start_time(child.pid)


def test_a_dead_or_reused_pid_is_not_fiberd() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        import psutil

        start = psutil.Process(child.pid).create_time()
        alive = FiberdRecord(child.pid, start, "s", None, 0)
        assert alive.is_running()
        assert not FiberdRecord(child.pid, start - 100, "s", None, 0).is_running()  # reused
    finally:
        child.kill()
        child.wait()
    assert not alive.is_running()
