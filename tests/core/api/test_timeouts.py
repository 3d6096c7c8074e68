"""Idle, slow and non-reading clients are cut on deadlines kept on the (fake) clock."""

from __future__ import annotations

import socket
import struct

import pytest

from slurm_fiber.client.connection import FiberdClient
from slurm_fiber.core.api.server import Phase, ServerConfig, phase_deadline
from slurm_fiber.core.clock import FakeClock
from tests.core.api.rawkit import read_replies
from tests.core.api.servicekit import serve


def test_phase_deadlines() -> None:
    config = ServerConfig(path=None, idle_timeout=30, frame_timeout=5, write_timeout=7)  # type: ignore[arg-type]
    assert phase_deadline(Phase.IDLE, 100.0, config) == 130.0
    assert phase_deadline(Phase.READING, 100.0, config) == 105.0
    assert phase_deadline(Phase.WRITING, 100.0, config) == 107.0
    assert phase_deadline(Phase.BUSY, 100.0, config) is None


def advance(s, clock: FakeClock, seconds: float) -> None:
    s.call(lambda: clock.advance_and_settle(seconds))


def test_idle_and_slow_clients_time_out_and_others_are_unaffected(tmp_path) -> None:
    clock = FakeClock()
    with serve(tmp_path / "t.sock", clock, idle_timeout=30, frame_timeout=5) as s:
        idle = socket.socket(socket.AF_UNIX)
        idle.connect(str(s.path))
        slow = socket.socket(socket.AF_UNIX)
        slow.connect(str(s.path))
        slow.sendall(struct.pack(">I", 50) + b'{"op"')  # a frame started, never finished
        with FiberdClient(s.path) as busy:
            busy.clone(exec={"argv": ["sleep", "0.5"]}, wait=True)  # waiting: no deadline
            s.call(clock.settle)
            advance(s, clock, 6)
            assert [r["error"]["code"] for r in read_replies(slow)] == ["timeout"]
            advance(s, clock, 25)  # idle for 31 s now
            assert [r["error"]["code"] for r in read_replies(idle)] == ["timeout"]
            assert busy.wait_exit()["status"] == 0
            assert busy.request("ready") == {"ready": True}
        assert [r.code for r in s.refusals] == ["timeout", "timeout"]
        idle.close()
        slow.close()


def test_running_out_of_descriptors_is_logged_once_a_minute_on_the_injected_clock(
        caplog: pytest.LogCaptureFixture) -> None:
    from slurm_fiber.core.api.server import LOG_EVERY, RateLimitedLog

    clock = FakeClock()
    fd_log = RateLimitedLog(clock)
    with caplog.at_level("WARNING", logger="slurm_fiber.core.api.server"):
        assert fd_log.warn("out of descriptors")
        assert not any(fd_log.warn("out of descriptors") for _ in range(500))
        clock.advance(LOG_EVERY - 1)
        assert not fd_log.warn("out of descriptors")
        clock.advance(1)
        assert fd_log.warn("out of descriptors")
    assert [r.getMessage() for r in caplog.records] == [
        "out of descriptors", "out of descriptors (501 more since the last such line)"]
