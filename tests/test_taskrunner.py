"""``TaskRunner`` against the socket API's process-backed test service (tests/core/api/
servicekit.py): connection reuse across fiberd's idle timeout, and which requests
declare protocol v2."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from slurm_fiber.client.executor import encode_call
from slurm_fiber.client.tasks import Task, TaskRunner
from slurm_fiber.core.clock import SystemClock
from slurm_fiber.protocol.framing import FrameDecoder, encode_frame
from tests.core.api.servicekit import serve


def test_a_connection_fiberd_closed_while_idle_is_replaced_not_failed(tmp_path: Path) -> None:
    with serve(tmp_path / "fiberd.sock", SystemClock(), idle_timeout=0.2) as served:
        runner = TaskRunner(served.path)
        first = runner.run(Task(exec={"argv": ["true"]}))
        assert first.ok, first
        time.sleep(0.6)  # fiberd drops the idle connection
        second = runner.run(Task(exec={"argv": ["true"]}))
        runner.close()
    assert second.ok and second.failure is None, second


def requests_seen(path: Path, tasks: list[Task]) -> list[dict[str, object]]:
    """The clone requests ``tasks`` send, as a fake fiberd that misses each one finally."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    seen: list[dict[str, object]] = []

    def serve() -> None:
        conn, _ = listener.accept()
        decoder = FrameDecoder()
        with conn:
            while data := conn.recv(65536):
                decoder.feed(data)
                while (frame := decoder.next_frame()) is not None:
                    seen.append(frame.body)  # type: ignore[arg-type]
                    conn.sendall(encode_frame({"id": None, "ok": False, "final": True, "miss": {
                        "code": "unknown_grant", "reason": "fake", "retryable": False}}))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    runner = TaskRunner(path)
    for task in tasks:
        assert runner.run(task).miss is not None
    runner.close()
    thread.join(10)
    listener.close()
    return seen


def test_only_a_pickled_call_declares_protocol_v2(tmp_path: Path) -> None:
    seen = requests_seen(tmp_path / "fake.sock", [
        Task(exec={"argv": ["true"]}),
        Task(call={"target": "m:f", "args": [1]}),
        Task(call=encode_call(len, ("abc",), {})),
    ])
    assert ["v" in r for r in seen] == [False, False, True]  # a v1 fiberd runs the first two
    assert seen[2]["v"] == 2 and seen[2]["call"]["target"] == "builtins:len"  # type: ignore[index]
