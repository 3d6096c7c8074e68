"""Windowed batches (``clone_batch`` with ``window``, protocol v5): fiberd keeps at most N of
the batch's fibers running and starts the next item as one ends; ``cancel`` stops it
starting more; a client that leaves starts none of the rest; each item's descriptors are
closed once it is answered. Against the real fiberd and the small test runtime."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from slurm_fiber.client.connection import FiberdClient, Missed, Refused
from slurm_fiber.client.tasks import Task, TaskRunner
from slurm_fiber.core.api.service import Clone, Stdio
from slurm_fiber.core.api.window import BatchWindow, Outcome, Pending
from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.protocol import validate as protocol
from slurm_fiber.protocol.validate import ApiError, parse_request
from tests.core.api.servicekit import Served
from tests.core.processkit import aio
from tests.core.runtime.fiberdkit import Site, ThreadFiberd, fiberd_in_thread, fsync_stalled


def marking(log: Path, key: str, seconds: float) -> dict[str, object]:
    """An item that appends "+key" to ``log`` as it starts and "-key" as it ends."""
    script = f'echo "+{key}" >> {log}; sleep {seconds}; echo "-{key}" >> {log}'
    return {"key": key, "exec": {"argv": ["sh", "-c", script]}}


def most_at_once(log: Path) -> int:
    running = most = 0
    for line in log.read_text().split():
        running += 1 if line.startswith("+") else -1
        most = max(most, running)
    return most


def audit(served: ThreadFiberd, event: str) -> list[dict[str, object]]:
    records = [json.loads(line)
               for line in Path(served.service.audit.path).read_text().splitlines()]
    return [r for r in records if r["event"] == event]


def stream(client: FiberdClient, first: list[dict[str, object]]) -> tuple[list[str], int]:
    """Read a windowed batch's events to its final one: the keys in the order they were
    answered (the first ``started`` event's, then later ones'), and how many exits came."""
    order = [str(i["key"]) for i in first]
    exits = 0
    while True:
        message = client.receive(wait_forever=True, within=30)
        assert message["ok"], message
        if message["event"] == "started":
            order += [str(i["key"]) for i in message["result"]["items"]]
        elif message["event"] == "exit":
            exits += 1
        if message["final"]:
            return order, exits


def test_a_window_keeps_n_fibers_running_and_starts_the_rest_in_order(
        fiberd_served: ThreadFiberd, tmp_path: Path) -> None:
    log = tmp_path / "log"
    items = [marking(log, f"k{i}", 0.05 * (i % 3)) for i in range(7)]
    with FiberdClient(fiberd_served.path) as client:
        started = client.clone_batch(items, wait=True, window=2)
        assert [i["key"] for i in started.items] == ["k0", "k1"]
        order, exits = stream(client, started.items)
        assert order == [f"k{i}" for i in range(7)] and exits == 7
        assert client.ready().ready  # the stream ended: the connection serves again
    assert most_at_once(log) == 2
    clones = audit(fiberd_served, "clone")
    assert len(clones) == 7 and {r["batch"] for r in clones} == {7}


def test_a_cancel_starts_nothing_more_and_the_running_fiber_ends_the_stream(
        fiberd_served: ThreadFiberd) -> None:
    items = [{"key": "k0", "exec": {"argv": ["sleep", "30"]}}] + [
        {"key": f"k{i}", "exec": {"argv": ["true"]}} for i in range(1, 4)]
    with FiberdClient(fiberd_served.path) as client:
        started = client.clone_batch(items, wait=True, window=1)
        sleeper = started.fibers()["k0"]
        assert client.cancel(within=10).keys == ["k1", "k2", "k3"]
        assert sleeper.pid is not None
        os.kill(sleeper.pid, signal.SIGTERM)
        message = client.receive(wait_forever=True, within=30)
        assert (message["event"], message["final"]) == ("exit", True)
        assert message["result"]["fiber_id"] == sleeper.id
        assert client.ready().ready
    assert len(audit(fiberd_served, "clone")) == 1  # none of the rest ran


def test_a_cancel_after_the_stream_ended_gets_no_reply(fiberd_served: ThreadFiberd) -> None:
    with FiberdClient(fiberd_served.path) as client:
        started = client.clone_batch([{"key": f"k{i}", "exec": {"argv": ["true"]}}
                                      for i in range(2)], wait=True, window=1)
        assert stream(client, started.items)[1] == 2
        client.send({"op": "cancel", "v": 5, "id": 77})
        reply = client.exchange({"op": "ready", "id": 78})
        assert reply["id"] == 78 and reply["result"] == {"ready": True}


def test_a_retryable_miss_waits_for_a_running_fiber_to_end(
        fiberd_served: ThreadFiberd, site: Site, tmp_path: Path) -> None:
    log = tmp_path / "log"
    token = site.token("g2", fibers=2)
    items = [marking(log, f"k{i}", 0.3) for i in range(4)]
    with FiberdClient(fiberd_served.path) as client:
        deadline = time.monotonic() + 30
        while True:  # the token is admitted inline by the first clone; its template warms
            try:
                client.clone(exec={"argv": ["true"]}, token=token, wait=True)
                client.wait_exit(within=30)
                break
            except Missed as miss:
                assert miss.code == "cold" and time.monotonic() < deadline
                time.sleep(0.1)
        started = client.clone_batch(items, wait=True, window=3, token=token)
        assert [i["key"] for i in started.items] == ["k0", "k1"]  # k2 waits: capacity 2
        order, exits = stream(client, started.items)
    assert order == ["k0", "k1", "k2", "k3"] and exits == 4
    assert most_at_once(log) == 2


def test_a_fiber_that_ends_while_its_record_awaits_the_fsync_frees_its_place(
        site: Site, tmp_path: Path) -> None:
    """Under audit_fsync = always, with the fsync helper stopped: each fiber of a window of
    one ends before its start can land, so the next starts (one at a time all the same),
    and none is answered before its record is durable; the stream ends in order once the
    helper goes on."""
    log = tmp_path / "log"
    items = [marking(log, f"k{i}", 0) for i in range(3)]
    answered: list[list[str]] = []
    with fiberd_in_thread(site, audit_fsync="always") as served, \
            FiberdClient(served.path) as client:

        def batch() -> None:
            started = client.clone_batch(items, wait=True, window=1)
            answered.append(stream(client, started.items)[0])

        thread = threading.Thread(target=batch)
        with fsync_stalled(served):
            thread.start()
            deadline = time.monotonic() + 15
            while not (log.exists() and log.read_text().split().count("-k2")):
                assert time.monotonic() < deadline, "the window waited for the fsync"
                time.sleep(0.02)
            assert not answered and thread.is_alive()  # none answered before its fsync
        thread.join(30)
    assert answered == [["k0", "k1", "k2"]]
    assert most_at_once(log) == 1
    assert [r.get("batch") for r in audit(served, "clone")] == [None, 3, 3, 3]


class Ends:
    """A fiber handle that holds its ``on_exit`` callbacks until told it ended."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[Any], None]] = []

    def on_exit(self, callback: Callable[[Any], None]) -> None:
        self.callbacks.append(callback)

    def end(self) -> None:
        for callback in self.callbacks:
            callback(None)


@aio
async def test_a_held_item_waits_for_a_fibers_end_not_for_a_start_to_land() -> None:
    """A's fiber ends while its start waits (its record's fsync): B may start in its place;
    B misses retryably while A still starts, so B is held, and not tried again until
    another fiber ends (then once), however often the window launches meanwhile."""
    loop = asyncio.get_running_loop()
    landing: dict[str, asyncio.Future[Outcome]] = {}
    tries: list[str] = []
    fibers = {"a": Ends(), "c": Ends()}

    async def start(item: Pending, forked: Callable[[Any], None]) -> Outcome:
        tries.append(item.key)
        if item.key == "b":
            return Miss(MissCode.CAPACITY, "full", retry_after=0.1)
        forked(fibers[item.key])
        landing[item.key] = loop.create_future()
        return await landing[item.key]

    items = [Pending(n, key, Clone(), Stdio())
             for n, key in enumerate("abc")]
    window = BatchWindow(items, 1, start, lambda key, _o: {"key": key})
    window.launch(0)
    await asyncio.sleep(0)
    fibers["a"].end()  # before its start lands
    window.launch(0)  # b takes a's place
    await asyncio.wait(set(window.starting), timeout=5, return_when=asyncio.FIRST_COMPLETED)
    fibers_landed, entries = window.land({t for t in window.starting if t.done()}, 0)
    assert (fibers_landed, entries, window.held) == ([], [], True)  # b held, a still starts
    for _ in range(3):
        window.launch(0)
        await asyncio.sleep(0)
    assert tries == ["a", "b"]
    window.ended()  # a fiber of the batch ended: b is tried again, once
    window.launch(0)
    await asyncio.sleep(0)
    assert tries == ["a", "b", "b"]
    window.close()


def test_a_client_leaving_a_window_starts_none_of_the_rest(served: Served) -> None:
    client = FiberdClient(served.path)
    started = client.clone_batch([{"key": "s", "exec": {"argv": ["sleep", "30"]}}] + [
        {"key": f"k{i}", "exec": {"argv": ["true"]}} for i in range(3)], wait=True, window=1)
    fiber = started.fibers()["s"]
    client.close()
    end = served.call(served.service.fibers[fiber.id].wait)
    assert end.signal == signal.SIGHUP  # hung up as the server saw the client leave,
    assert served.on_loop(lambda: served.server.connections) == 0  # which ended its stream
    assert list(served.service.fibers) == [fiber.id]  # with no other item started


def test_an_items_descriptors_close_once_it_started(served: Served) -> None:
    """The first item's pipe reaches end of file when it exits, though the second item
    (whose own pipe fiberd holds until it starts) has not started."""
    first_r, first_w = os.pipe()
    second_r, second_w = os.pipe()
    try:
        with FiberdClient(served.path) as client:
            items = [{"key": "a", "exec": {"argv": ["sh", "-c", "echo a; sleep 0.2"]}},
                     {"key": "b", "exec": {"argv": ["sh", "-c", "echo b"]}},
                     {"key": "c", "exec": {"argv": ["sleep", "30"]}}]
            items = [items[2], items[0], items[1]]  # c holds the window's other slot
            started = client.clone_batch(items, stdio=[{}, {"stdout": first_w},
                                                       {"stdout": second_w}],
                                         wait=True, window=2)
            os.close(first_w)
            os.close(second_w)
            first_w = second_w = -1
            assert [i["key"] for i in started.items] == ["c", "a"]
            with os.fdopen(first_r, "rb", closefd=False) as f:
                assert f.read() == b"a\n"  # EOF: fiberd closed a's pipe once a started
            sleeper = started.fibers()["c"]
            os.kill(sleeper.pid or 0, signal.SIGTERM)
            order, exits = stream(client, started.items)
            assert order == ["c", "a", "b"] and exits == 3
            with os.fdopen(second_r, "rb", closefd=False) as f:
                assert f.read() == b"b\n"
    finally:
        for fd in (first_r, first_w, second_r, second_w):
            if fd >= 0:
                os.close(fd)


@pytest.mark.parametrize(("fields", "says"), [
    ({"v": 4, "window": 2, "wait": True}, "needs \"v\": 5"),
    ({"v": 5, "window": 0, "wait": True}, "1..64"),
    ({"v": 5, "window": 65, "wait": True}, "1..64"),
    ({"v": 5, "window": 2}, "needs \"wait\": true"),
    ({"v": 5, "window": "2", "wait": True}, "1..64"),
])
def test_a_bad_window_refuses_the_batch(fields: dict[str, object], says: str) -> None:
    body = {"op": "clone_batch", "items": [{"key": "a", "exec": {"argv": ["true"]}}], **fields}
    with pytest.raises(ApiError) as refused:
        parse_request(body, 0)
    assert refused.value.code.value == "bad_request" and says in refused.value.reason


def test_a_runner_with_a_window_runs_every_task_n_at_once(served: Served,
                                                          tmp_path: Path) -> None:
    log = tmp_path / "log"
    tasks = [Task(exec=marking(log, f"k{i}", 0.02)["exec"]) for i in range(70)]  # two batches
    runner = TaskRunner(served.path)
    ended: list[int] = []
    try:
        outcomes = runner.run_many(tasks, lambda i, _o: ended.append(i), window=3)
    finally:
        runner.close()
    assert all(o.ok for o in outcomes) and sorted(ended) == list(range(70))
    assert most_at_once(log) == 3


def test_cancel_pending_ends_the_tasks_not_started_as_cancelled(served: Served) -> None:
    tasks = [Task(exec={"argv": ["sleep", "0.5"]})] + [Task(exec={"argv": ["true"]})] * 5
    runner = TaskRunner(served.path)
    ended: list[int] = []

    def first_ended(i: int, _o: object) -> None:
        ended.append(i)

    threading.Timer(0.2, runner.cancel_pending).start()
    try:
        outcomes = runner.run_many(tasks, first_ended, window=1)
    finally:
        runner.close()
    assert outcomes[0].ok and all(o.cancelled and o.exit is None for o in outcomes[1:])
    assert sorted(ended) == list(range(6))
    assert len(served.service.fibers) == 1


def test_stop_all_stops_the_running_and_cancels_the_rest(served: Served) -> None:
    tasks = [Task(exec={"argv": ["sleep", "30"]})] * 2 + [Task(exec={"argv": ["true"]})] * 3
    runner = TaskRunner(served.path, stop_grace=0.2)
    threading.Timer(0.3, runner.stop_all).start()
    try:
        outcomes = runner.run_many(tasks, window=2)
    finally:
        runner.close()
    assert [o.status for o in outcomes[:2]] == [128 + signal.SIGTERM] * 2
    assert all(o.cancelled for o in outcomes[2:])


def test_a_runner_does_not_fall_back_to_slices_on_a_v4_fiberd(
        served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "VERSIONS", (1, 2, 3, 4))  # this server now speaks up to v4
    log = tmp_path / "log"
    runner = TaskRunner(served.path)
    try:
        outcomes = runner.run_many([Task(exec=marking(log, f"k{i}", 0)["exec"])
                                    for i in range(5)], window=2)
    finally:
        runner.close()
    assert all(o.refused and o.failure is not None
               and o.failure.startswith("unsupported_version:") for o in outcomes)
    assert not log.exists() or most_at_once(log) == 0  # nothing started
    assert [r.code for r in served.refusals] == ["unsupported_version"]  # asked once
    with FiberdClient(served.path) as client, pytest.raises(Refused):
        client.clone_batch([{"key": "a", "exec": {"argv": ["true"]}}], wait=True, window=1)
