"""Batch clones (``clone_batch``, protocol v3) against the real fiberd: each item its own
fiber, record, audit record and exit event; a bad or refused item does not sink the rest;
single clones (v1, v2) keep working beside it."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from slurm_fiber.client.connection import FiberdClient, Refused
from slurm_fiber.client.tasks import Task, TaskRunner
from slurm_fiber.core.api.service import Clone
from slurm_fiber.core.runtime.clones import Clones
from slurm_fiber.protocol import validate as protocol
from slurm_fiber.protocol.limits import MAX_BATCH
from tests.core.api.servicekit import Served
from tests.core.runtime.fiberdkit import Site, ThreadFiberd, fiberd_in_thread, fsync_stalled


def audit_records(served: ThreadFiberd, event: str) -> list[dict[str, object]]:
    path = Path(served.service.audit.path)  # read while fiberd appends: whole lines only
    records = [json.loads(line) for line in path.read_text().split("\n")[:-1]]
    return [r for r in records if r["event"] == event]


def wait_exits(client: FiberdClient, n: int) -> dict[str, dict[str, object]]:
    """The next ``n`` exit events of a waited batch, by fiber id."""
    exits = {}
    for _ in range(n):
        end = client.wait_exit(within=30)
        exits[str(end["fiber_id"])] = end
    return exits


def test_a_batch_of_n_starts_n_fibers_each_audited(fiberd_served: ThreadFiberd) -> None:
    n = 8
    with FiberdClient(fiberd_served.path) as client:
        items = [{"key": f"k{i}", "exec": {"argv": ["sh", "-c", f"exit {i}"]}} for i in range(n)]
        started = client.clone_batch(items, wait=True)
        fibers = started.fibers()
        assert list(fibers) == [f"k{i}" for i in range(n)]
        assert len({f.id for f in fibers.values()}) == n
        assert all(f.grant == "g1" and f.pid for f in fibers.values())
        exits = wait_exits(client, n)
        assert {exits[f.id]["status"] for f in fibers.values()} == set(range(n))
        assert {key: exits[f.id]["status"] for key, f in fibers.items()} == {
            f"k{i}": i for i in range(n)}
        assert client.ready().ready  # the stream ended: the connection serves again
    clones = {r["fiber"]: r for r in audit_records(fiberd_served, "clone")}
    for fiber in fibers.values():
        record = clones[fiber.id]
        assert record["batch"] == n and record["pid"] == fiber.pid and record["uid"] == "g1"
        assert record["deadline"] is not None
    exited = {r["fiber"] for r in audit_records(fiberd_served, "fiber_exit")}
    deadline = time.monotonic() + 10
    while not {f.id for f in fibers.values()} <= exited and time.monotonic() < deadline:
        time.sleep(0.05)
        exited = {r["fiber"] for r in audit_records(fiberd_served, "fiber_exit")}
    assert {f.id for f in fibers.values()} <= exited


def test_each_exit_event_comes_after_its_audit_record(fiberd_served: ThreadFiberd) -> None:
    # The design's order (docs/design.md, Audit): a fiber's exit record is in the file
    # before its exit event goes out, whichever way the stream learns of the exit.
    with FiberdClient(fiberd_served.path) as client:
        items = [{"key": f"k{i}", "exec": {"argv": ["true"]}} for i in range(6)]
        client.clone_batch(items, wait=True, window=2)
        for _ in items:
            end = client.wait_exit(within=30)
            exited = {r["fiber"] for r in audit_records(fiberd_served, "fiber_exit")}
            assert end["fiber_id"] in exited


def test_a_batchs_items_start_at_once_their_records_sharing_fsyncs(site: Site) -> None:
    """Under audit_fsync = always, with the fsync helper stopped: every item of a batch is
    forked and its record written while the first item's fsync has not ended (they wait
    for fsyncs together, not one each in turn); the batch is answered once they end."""
    items = [{"key": f"k{i}", "exec": {"argv": ["true"]}} for i in range(3)]
    keys: list[list[str]] = []
    with fiberd_in_thread(site, audit_fsync="always") as served, \
            FiberdClient(served.path) as client:
        thread = threading.Thread(target=lambda: keys.append(
            [str(i["key"]) for i in client.clone_batch(items).items]))
        with fsync_stalled(served):
            thread.start()
            deadline = time.monotonic() + 15
            while len([r for r in audit_records(served, "clone") if r.get("batch")]) < 3:
                assert time.monotonic() < deadline, "the items waited for each other's fsync"
                time.sleep(0.02)
            assert not keys and thread.is_alive()  # none answered before its fsync
        thread.join(30)
    assert keys == [["k0", "k1", "k2"]]


def test_an_item_fiberd_fails_on_is_answered_internal_alone(
        fiberd_served: ThreadFiberd, monkeypatch: pytest.MonkeyPatch) -> None:
    start = Clones._start

    async def failing(self: Clones, grant: Any, decision: Any, request: Clone,
                      *rest: Any) -> Any:
        if request.env.get("BREAK"):
            raise RuntimeError("a fault injected into fiberd")
        return await start(self, grant, decision, request, *rest)

    monkeypatch.setattr(Clones, "_start", failing)
    items = [{"key": "bad", "exec": {"argv": ["true"]}, "env": {"BREAK": "1"}},
             {"key": "good", "exec": {"argv": ["true"]}}]
    with FiberdClient(fiberd_served.path) as client:
        started = client.clone_batch(items, wait=True)
        by_key = {i["key"]: i for i in started.items}
        assert by_key["bad"]["error"]["code"] == "internal" and by_key["good"]["ok"]
        assert wait_exits(client, 1)[started.fibers()["good"].id]["status"] == 0


def test_one_bad_item_is_refused_alone(fiberd_served: ThreadFiberd) -> None:
    items = [
        {"key": "good-1", "exec": {"argv": ["true"]}},
        {"key": "bad key!", "exec": {"argv": ["true"]}},  # bad key
        {"key": "good-1", "exec": {"argv": ["true"]}},  # duplicate key
        {"key": "no-what", "env": {"A": "1"}},  # neither exec nor call
        {"key": "gpu", "exec": {"argv": ["true"]}, "env": {"CUDA_VISIBLE_DEVICES": "0"}},
        {"key": "good-2", "call": {"target": "tests.core.runtime.targetkit:sleep", "args": [0]}},
    ]
    with FiberdClient(fiberd_served.path) as client:
        started = client.clone_batch(items, wait=True)
        by_order = [(i.get("key"), i["ok"], (i.get("error") or {}).get("code"))
                    for i in started.items]
        assert by_order == [("good-1", True, None), (None, False, "bad_request"),
                            ("good-1", False, "bad_request"), ("no-what", False, "bad_request"),
                            ("gpu", False, "bad_request"), ("good-2", True, None)]
        assert "twice" in started.items[2]["error"]["reason"]
        exits = wait_exits(client, 2)
        fibers = started.fibers()
        assert exits[fibers["good-1"].id]["status"] == 0
        assert exits[fibers["good-2"].id]["result"] == "slept"
    refused = [r for r in audit_records(fiberd_served, "api_refuse")
               if r.get("op") == "clone_batch"]
    assert [r["code"] for r in refused] == ["bad_request"] * 4


def test_a_refused_item_miss_leaves_the_others_running(fiberd_served: ThreadFiberd,
                                                        site: Site) -> None:
    site_token = site.token("g2", fibers=2)
    with FiberdClient(fiberd_served.path) as client:
        sleepers = [{"key": f"s{i}", "exec": {"argv": ["sleep", "30"]}} for i in range(3)]
        deadline = time.monotonic() + 30
        while True:  # the token is admitted inline by the first batch; its template warms
            started = client.clone_batch(sleepers, token=site_token)
            codes = [(i.get("miss") or {}).get("code") for i in started.items]
            if "cold" not in codes or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert codes == [None, None, "capacity"]
        assert started.items[2]["miss"]["retryable"] is True
        for fiber in started.fibers().values():
            assert client.stop_fiber(fiber.id, 0.2).id == fiber.id
    admits = [r for r in audit_records(fiberd_served, "admit") if r["uid"] == "g2"]
    assert len(admits) == 1  # the carried token: verified and admitted once, not per item
    misses = [r for r in audit_records(fiberd_served, "miss") if r.get("code") == "capacity"]
    assert misses and misses[-1]["batch"] == 3


def test_old_single_clones_and_v2_clients_still_work(fiberd_served: ThreadFiberd) -> None:
    with FiberdClient(fiberd_served.path) as client:
        for version in (None, 1, 2):
            fields = {} if version is None else {"v": version}
            fiber = client.clone(exec={"argv": ["sh", "-c", "exit 5"]}, wait=True, **fields)
            assert client.wait_exit(within=30)["status"] == 5 and fiber.grant == "g1"
        reply = client.exchange({"op": "clone", "v": 2, "id": 9, "wait": False,
                                 "call": {"target": "tests.core.runtime.targetkit:sleep",
                                          "args": [0]}})
        assert reply["event"] == "started" and reply["final"] is True and reply["id"] == 9
        with pytest.raises(Refused) as refused:  # a batch must say it is v3
            client.exchange({"op": "clone_batch", "v": 2,
                             "items": [{"key": "a", "exec": {"argv": ["true"]}}]})
        assert refused.value.code == "bad_request"


def test_a_batch_over_the_cap_or_with_stray_descriptors_is_refused_whole(
        fiberd_served: ThreadFiberd) -> None:
    with FiberdClient(fiberd_served.path) as client:
        too_many = [{"key": f"k{i}", "exec": {"argv": ["true"]}} for i in range(MAX_BATCH + 1)]
        with pytest.raises(Refused) as refused:
            client.clone_batch(too_many)
        assert refused.value.code == "bad_request"
        with pytest.raises(Refused) as refused:
            client.exchange({"op": "clone_batch", "v": 3,
                             "items": [{"key": "a", "exec": {"argv": ["true"]}}]}, [0])
        assert refused.value.code == "bad_fds"


def test_a_runner_does_not_fall_back_when_fiberd_refuses_batches(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every released fiberd speaks v5: a refused version is the tasks' failure, with its
    code, never a silent fallback to one Clone per task."""
    monkeypatch.setattr(protocol, "VERSIONS", (1, 2))  # this server now speaks v1 and v2 only
    runner = TaskRunner(served.path)
    ended: list[int] = []
    try:
        outcomes = runner.run_many([Task(exec={"argv": ["sh", "-c", f"exit {i}"]})
                                    for i in range(3)], lambda i, _o: ended.append(i))
    finally:
        runner.close()
    assert all(o.refused and o.failure is not None and o.failure.startswith(
        "unsupported_version: this fiberd speaks protocol v1, v2") for o in outcomes)
    assert sorted(ended) == [0, 1, 2]
    assert [r.code for r in served.refusals] == ["unsupported_version"]  # asked once


def test_a_client_leaving_a_waited_batch_hangs_up_every_fiber_still_running(
        served: Served) -> None:
    client = FiberdClient(served.path)
    started = client.clone_batch([{"key": "quick", "exec": {"argv": ["true"]}},
                                  {"key": "s1", "exec": {"argv": ["sleep", "30"]}},
                                  {"key": "s2", "exec": {"argv": ["sleep", "30"]}}], wait=True)
    fibers = started.fibers()
    assert client.wait_exit(within=10)["fiber_id"] == fibers["quick"].id
    client.close()
    for key in ("s1", "s2"):
        end = served.call(served.service.fibers[fibers[key].id].wait)
        assert end.signal == 1  # SIGHUP


def test_descriptors_reach_each_item_in_order(served: Served, tmp_path: Path) -> None:
    outs = [open(tmp_path / f"out{i}", "w+b") for i in range(3)]  # noqa: SIM115
    try:
        with FiberdClient(served.path) as client:
            items = [{"key": f"k{i}", "exec": {"argv": ["sh", "-c", f"echo item{i}"]}}
                     for i in range(3)]
            items.insert(1, {"key": "k1", "exec": {"argv": ["true"]}})  # duplicate: refused
            stdio = [{"stdout": outs[0].fileno()}, {}, {"stdout": outs[1].fileno()},
                     {"stdout": outs[2].fileno(), "stderr": outs[2].fileno()}]
            started = client.clone_batch(items, stdio=stdio, wait=True)
            assert [i["ok"] for i in started.items] == [True, True, False, True]
            for _ in range(3):
                client.wait_exit(within=10)
        assert [(tmp_path / f"out{i}").read_text() for i in range(3)] == [
            "item0\n", "", "item2\n"]
    finally:
        for f in outs:
            f.close()
