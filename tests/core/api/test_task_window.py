"""Task windows (fiberd's ``task_window = "template"``, a prototype, off by default): fiberd
decides a windowed batch of exec items once and the template starts each next task itself.
Each safety test is named for the rule the window changes; against the real fiberd, its
real template, real processes and (where named) real cgroup leaves."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.core.api.client import FiberdClient
from tests.core.api.test_window import marking, most_at_once
from tests.core.runtime.fiberdkit import Site, ThreadFiberd, fiberd_in_thread


def records(served: ThreadFiberd) -> list[dict[str, object]]:
    return [json.loads(line)
            for line in Path(served.service.audit.path).read_text().splitlines()]


def stream(client: FiberdClient, first: list[dict[str, object]],
           within: float = 30) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """A windowed batch's answers (every ``started`` entry, in order) and exit events, read
    to the final event."""
    entries, exits = list(first), []
    while True:
        message = client.receive(wait_forever=True, within=within)
        assert message["ok"], message
        if message["event"] == "started":
            entries += message["result"]["items"]
        elif message["event"] == "exit":
            exits.append(message["result"])
        if message["final"]:
            return entries, exits


@pytest.fixture
def windowed(site: Site) -> Iterator[ThreadFiberd]:
    with fiberd_in_thread(site, task_window="template") as served:
        yield served


def test_the_window_path_is_off_by_default(fiberd_served: ThreadFiberd, tmp_path: Path) -> None:
    items = [marking(tmp_path / "log", f"k{i}", 0) for i in range(3)]
    with FiberdClient(fiberd_served.path) as client:
        started = client.clone_batch(items, wait=True, window=2)
        stream(client, started.items)
    assert not [r for r in records(fiberd_served) if r["event"] == "window_open"]


def test_a_task_window_keeps_n_running_and_answers_every_item(
        windowed: ThreadFiberd, tmp_path: Path) -> None:
    log = tmp_path / "log"
    items = [marking(log, f"k{i}", 0.05 * (i % 3)) for i in range(7)]
    with FiberdClient(windowed.path) as client:
        started = client.clone_batch(items, wait=True, window=2)
        entries, exits = stream(client, started.items)
        assert client.ready().ready
    assert sorted(str(e["key"]) for e in entries) == [f"k{i}" for i in range(7)]
    assert all(e["ok"] for e in entries) and len(exits) == 7
    assert {x["status"] for x in exits} == {0}
    assert most_at_once(log) <= 2
    assert [str(e["key"]) for e in entries] == [f"k{i}" for i in range(7)]
