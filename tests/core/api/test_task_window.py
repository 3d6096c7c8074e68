"""Task windows (fiberd's ``task_window = "template"``, a prototype, off by default): fiberd
decides a windowed batch of exec items once and the template starts each next task itself.
Each safety test is named for the rule the window changes; against the real fiberd, its
real template, real processes and (where named) real cgroup leaves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from slurm_fiber.client.connection import FiberdClient
from slurm_fiber.core.templates.window_parent import WindowLink
from tests.core.api.test_window import marking, most_at_once
from tests.core.runtime.fiberdkit import Site, ThreadFiberd, fiberd_in_thread, fsync_stalled
from tests.security.publicdirkit import public_dir


def records(served: ThreadFiberd) -> list[dict[str, object]]:
    return [json.loads(line)
            for line in Path(served.service.audit.path).read_text().splitlines()]


def stream(client: FiberdClient, first: list[dict[str, object]], count: int | None = None,
           within: float = 30) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """A windowed batch's answers (every ``started`` entry, in order) and exit events, read
    to the final event: until each of ``count`` items (default: as many as ``first``
    holds, or more) is answered and each fiber started has exited (the first event may
    have been the final one already: a window closed before it reported)."""
    entries, exits = list(first), []
    while count is None or len(entries) < count or \
            len(exits) < len([e for e in entries if e["ok"]]):
        message = client.receive(wait_forever=True, within=within)
        assert message["ok"], message
        if message["event"] == "started":
            entries += message["result"]["items"]
        elif message["event"] == "exit":
            exits.append(message["result"])
        if message["final"]:
            break
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


def fence_in(served: ThreadFiberd, seconds: float) -> None:
    """Give ``served``'s book a control plane that synced now and a fence ``seconds`` after."""
    def fence() -> None:
        book = served.service.book
        book.health.control_plane = True
        book.health.mark_sync()
        book.fence_ttl = seconds
    served.on_loop(fence)


def stamped(log: Path, key: str, seconds: float) -> dict[str, object]:
    """An item that logs "+key <wall time>" as it starts and "-key <wall time>" as it ends."""
    script = (f'echo "+{key} $(date +%s.%N)" >> {log}; sleep {seconds}; '
              f'echo "-{key} $(date +%s.%N)" >> {log}')
    return {"key": key, "exec": {"argv": ["sh", "-c", script]}}


def stamps(log: Path) -> dict[str, float]:
    out = {}
    for line in log.read_text().splitlines():
        mark, at = line.split()
        out[mark] = float(at)
    return out


@pytest.mark.parametrize("mode", ["exec", "call"])
def test_fence_closes_the_window_and_nothing_starts_or_runs_after_it(
        windowed: ThreadFiberd, tmp_path: Path, mode: str) -> None:
    log = tmp_path / "log"
    fence_in(windowed, 1.0)
    item = stamped if mode == "exec" else stamped_call
    items = [item(log, f"k{i}", 0.6) for i in range(6)]
    with FiberdClient(windowed.path) as client:
        started = client.clone_batch(items, wait=True, window=1)
        entries, exits = stream(client, started.items)
    opened = windows_opened(windowed)
    assert len(opened) == 1 and opened[0]["deadline_cause"] == "fence"
    fence = float(opened[0]["deadline"])  # type: ignore[arg-type]
    began = [at for mark, at in stamps(log).items() if mark.startswith("+")]
    assert began and max(began) < fence  # nothing started at or after the fence
    ran = [e for e in entries if e["ok"]]
    missed = [e for e in entries if not e["ok"]]
    assert {e["miss"]["code"] for e in missed} == {"fenced"}  # type: ignore[index]
    assert len(ran) + len(missed) == 6 and len(exits) == len(ran)
    killed = [x for x in exits if x["signal"] == signal.SIGKILL]
    assert len(killed) == 1 and killed[0]["reason"]["code"] == "fence"  # type: ignore[index]
    if mode == "call":
        assert killed[0]["error"]["type"] == "FiberDied"  # type: ignore[index]
    rows = records(windowed)
    assert not [r for r in rows if r["event"] == "fiber_start"
                and float(r["time"]) > fence + 5]  # type: ignore[arg-type]
    started_ids = sorted(str(r["fiber"]) for r in rows if r["event"] == "fiber_start")
    ended_ids = sorted(str(r["fiber"]) for r in rows if r["event"] == "fiber_exit")
    assert started_ids == ended_ids == sorted(str(e["fiber"]["id"]) for e in ran)  # type: ignore[index]
    assert [r["cause"] for r in rows if r["event"] == "window_close"] == ["fence"]


@pytest.mark.parametrize("how", ["epoch_bump", "removal"])
def test_removal_and_epoch_bump_close_the_window_and_kill_its_fibers(
        windowed: ThreadFiberd, site: Site, tmp_path: Path, how: str) -> None:
    log = tmp_path / "log"
    items = [stamped(log, f"k{i}", 30) for i in range(5)]
    with FiberdClient(windowed.path) as client:
        started = client.clone_batch(items, wait=True, window=2)
        if how == "epoch_bump":
            async def bump() -> int:
                return await windowed.service.bump_epoch("test: window revoked")
            import asyncio
            asyncio.run_coroutine_threadsafe(bump(), windowed.loop).result(30)
        else:
            site.remove()
        entries, exits = stream(client, started.items)
    cause = "revoked" if how == "epoch_bump" else "removed"
    ran = [e for e in entries if e["ok"]]
    assert 1 <= len(ran) <= 2 and len(exits) == len(ran)
    assert {x["signal"] for x in exits} == {signal.SIGKILL}
    missed = [e for e in entries if not e["ok"]]
    assert len(missed) == 5 - len(ran)
    assert not [m for m in stamps(log) if m.startswith("-")]  # none ran its 30 s
    assert [r["cause"] for r in records(windowed) if r["event"] == "window_close"] == [cause]


def test_no_window_fiber_runs_past_its_seconds(site: Site, tmp_path: Path) -> None:
    mint = site.token
    site.token = lambda *a, **kw: mint(*a, **{**kw, "seconds": 0.5})  # type: ignore[method-assign]
    with fiberd_in_thread(site, task_window="template") as served, \
            FiberdClient(served.path) as client:
        began = time.monotonic()
        started = client.clone_batch([stamped(tmp_path / "log", f"k{i}", 30)
                                      for i in range(2)], wait=True, window=2)
        _, exits = stream(client, started.items)
        took = time.monotonic() - began
    assert {x["signal"] for x in exits} == {signal.SIGKILL} and len(exits) == 2
    assert took < 20


@pytest.mark.parametrize("mode", ["exec", "call"])
def test_every_window_fiber_has_durable_records_admission_before_the_first(
        site: Site, tmp_path: Path, mode: str) -> None:
    log = tmp_path / "log"
    item = stamped if mode == "exec" else stamped_call
    with fiberd_in_thread(site, task_window="template", audit_fsync="always") as served, \
            FiberdClient(served.path) as client:
        answer: list[object] = []
        with fsync_stalled(served):
            thread = threading.Thread(target=lambda: answer.append(client.clone_batch(
                [item(log, f"k{i}", 0) for i in range(4)], wait=True, window=2)))
            thread.start()
            time.sleep(1.0)
            assert not log.exists() and not answer  # the admission waits for its fsync
        thread.join(30)
        assert answer
        _, exits = stream(client, answer[0].items)  # type: ignore[attr-defined]
        assert len(exits) == 4
        if mode == "call":
            assert {x["result"] for x in exits} == {0}
        rows = records(served)
    events = [r["event"] for r in rows if r.get("window")]
    assert events[0] == "window_open"
    starts = [r for r in rows if r["event"] == "fiber_start"]
    ends = [r for r in rows if r["event"] == "fiber_exit" and r.get("window")]
    assert sorted(r["key"] for r in starts) == [f"k{i}" for i in range(4)]  # type: ignore[type-var]
    assert {r["mode"] for r in starts} == {mode}
    assert sorted(r["fiber"] for r in ends) == sorted(r["fiber"] for r in starts)  # type: ignore[type-var]


def test_window_events_wait_for_their_records_fsync(site: Site, tmp_path: Path) -> None:
    log = tmp_path / "log"
    with fiberd_in_thread(site, task_window="template", audit_fsync="always") as served, \
            FiberdClient(served.path) as client:
        client.clone(exec={"argv": ["true"]}, wait=True)  # starts the fsync helper
        client.wait_exit(within=30)
        started = client.clone_batch([stamped(log, "k0", 0.5), stamped(log, "k1", 0.5)],
                                     wait=True, window=1)
        with fsync_stalled(served):
            time.sleep(1.5)  # k0 has ended and k1 started meanwhile: both reported
            assert "-k0" in stamps(log)
            with pytest.raises(TimeoutError):
                client.receive(within=0.5)  # not told before the records are durable
        _, exits = stream(client, started.items)
        assert len(exits) == 2


@pytest.mark.parametrize("mode", ["exec", "call"])
def test_a_template_killed_mid_window_loses_no_record_of_a_started_fiber(
        site: Site, tmp_path: Path, cgroup_root: Path, mode: str) -> None:
    log = tmp_path / "log"
    if mode == "exec":  # the shell's parent is the template
        kill_template = f'echo "+k1 0" >> {log}; kill -KILL $PPID; sleep 30'
        items = [stamped(log, "k0", 30),
                 {"key": "k1", "exec": {"argv": ["sh", "-c", kill_template]}},
                 stamped(log, "k2", 30)]
    else:  # os.system's shell's parent is the call fiber, whose parent is the template
        kill_template = f'echo "+k1 0" >> {log}; kill -KILL $(ps -o ppid= -p $PPID); sleep 30'
        items = [stamped_call(log, "k0", 30),
                 {"key": "k1", "call": {"target": "os:system", "args": [kill_template]}},
                 stamped_call(log, "k2", 30)]
    with fiberd_in_thread(site, task_window="template", cgroup_root=str(cgroup_root)) as served, \
            FiberdClient(served.path) as client:
        started = client.clone_batch(items, wait=True, window=2)
        entries, exits = stream(client, started.items, len(items))
        rows = [r for r in records(served) if r.get("window")]
    assert len([r for r in rows if r["event"] == "window_open"]) == 1
    ran = {m[1:] for m in stamps(log) if m.startswith("+")}
    assert "k1" in ran and ran <= {"k0", "k1"}  # k0 may die before its first line
    starts = [r for r in rows if r["event"] == "fiber_start"]
    ends = [r for r in rows if r["event"] == "fiber_exit"]
    # each fiber that ran has its start (reported, or learnt from its leaf) and its end
    assert sorted(str(r["key"]) for r in starts) == ["k0", "k1"]
    assert sorted(str(r["fiber"]) for r in ends) == sorted(str(r["fiber"]) for r in starts)
    assert [e["key"] for e in entries if not e["ok"]] == ["k2"]
    if mode == "call":
        assert {x["error"]["type"] for x in exits} == {"FiberLost"}  # type: ignore[index]
    assert not (stamps(log).keys() & {"-k0", "-k1"})  # killed with their leaves


def test_a_template_gone_before_its_first_report_answers_every_item_at_once(
        site: Site, tmp_path: Path) -> None:
    """The interleaving that made the killed-template test flaky: the template dies before
    it reports anything, so the window's first batch is its last (what the leaves tell)
    and the first ``started`` event is already final. Made certain here: the template is
    stopped before the order reaches it and killed once fiberd has sent it."""
    log = tmp_path / "log"
    with fiberd_in_thread(site, task_window="template") as served, \
            FiberdClient(served.path) as client:
        pid = served.on_loop(lambda: served.service.grant("g1").template.process.pid)
        os.kill(pid, signal.SIGSTOP)
        answer: list[object] = []
        thread = threading.Thread(target=lambda: answer.append(client.clone_batch(
            [stamped(log, f"k{i}", 30) for i in range(3)], wait=True, window=2)))
        thread.start()
        deadline = time.monotonic() + 30
        while not served.on_loop(lambda: bool(served.service.windows)):  # the order is sent
            assert time.monotonic() < deadline, "the window never opened"
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        thread.join(30)
        assert answer
        first = answer[0].items  # type: ignore[attr-defined]
        entries, exits = stream(client, first, 3)
        rows = [r for r in records(served) if r.get("window")]
    assert not log.exists() and not exits  # nothing started
    assert sorted(str(e["key"]) for e in first) == ["k0", "k1", "k2"]  # all in the first
    assert entries == first and not any(e["ok"] for e in entries)
    assert [r["event"] for r in rows] == ["window_open"]


def test_a_leaf_tells_a_start_the_template_never_reported(cgroup_root: Path) -> None:
    leaves = [cgroup_root / "slot-0", cgroup_root / "slot-1", cgroup_root / "slot-2"]
    for leaf in leaves:
        leaf.mkdir()
    link = WindowLink("w1", ["a", "b", "c"], list(leaves))
    link.reported({"t": "window_report", "id": "w1", "starts": [["b", 1, 1]], "ends": [],
                   "done": False})
    procs = (leaves[0] / "cgroup.procs").open("w")
    subprocess.run(["sh", "-c", "i=0; while [ $i -lt 2000 ]; do i=$((i+1)); done"],
                   preexec_fn=lambda: (procs.write("0"), procs.flush()), check=True)
    link.gone()
    first, last = link.batches.get_nowait(), link.batches.get_nowait()
    assert first.starts == [{"key": "b", "pid": 1, "leaf": 1}]
    assert last.done and last.lost
    assert [(s["leaf"], s["key"]) for s in last.starts] == [(0, "a")]  # slot-0: unreported
    assert sorted(str(e["key"]) for e in last.ends) == ["a", "b"]  # their ends: lost


def test_a_grant_with_fewer_places_than_the_window_takes_fiberds_path(
        site: Site, tmp_path: Path) -> None:
    mint = site.token
    site.token = lambda *a, **kw: mint(*a, **{**kw, "fibers": 1})  # type: ignore[method-assign]
    log = tmp_path / "log"
    with fiberd_in_thread(site, task_window="template") as served, \
            FiberdClient(served.path) as client:
        started = client.clone_batch([marking(log, f"k{i}", 0) for i in range(3)],
                                     wait=True, window=2)
        entries, exits = stream(client, started.items, 3)
        rows = records(served)
    # fiberd's path answers in the order items land, not the request's: a start that missed
    # for capacity is held back while one launched meanwhile (a place freed by an end that
    # came before its start landed) may land first
    assert sorted(str(e["key"]) for e in entries if e["ok"]) == ["k0", "k1", "k2"]
    assert len(exits) == 3 and most_at_once(log) == 1
    assert not [r for r in rows if r["event"] == "window_open"]


# ---------------------------------------------------------------- call items (issue 42, W2)

T = "tests.core.runtime.targetkit"


def windows_opened(served: ThreadFiberd) -> list[dict[str, object]]:
    return [r for r in records(served) if r["event"] == "window_open"]


def by_fiber(entries: list[dict[str, object]], exits: list[dict[str, object]]
             ) -> dict[str, dict[str, object]]:
    """Each started item's exit event, by the item's key."""
    ids = {e["fiber"]["id"]: str(e["key"]) for e in entries if e["ok"]}  # type: ignore[index]
    return {ids[str(x["fiber_id"])]: x for x in exits}


def stamped_call(log: Path, key: str, seconds: float) -> dict[str, object]:
    """A call item whose fiber runs (os.system) what ``stamped`` execs: its shell is the
    call fiber's child, in its leaf and process group."""
    script = (f'echo "+{key} $(date +%s.%N)" >> {log}; sleep {seconds}; '
              f'echo "-{key} $(date +%s.%N)" >> {log}')
    return {"key": key, "call": {"target": "os:system", "args": [script]}}


def test_a_window_of_calls_returns_every_value(windowed: ThreadFiberd) -> None:
    import base64
    import pickle
    items: list[dict[str, object]] = [
        {"key": f"k{i}", "call": {"target": "math:factorial", "args": [i]}} for i in range(6)]
    items.append({"key": "p", "call": {"target": "math:gcd", "pickled": base64.b64encode(
        pickle.dumps(((12, 18), {}))).decode()}})
    with FiberdClient(windowed.path) as client:
        started = client.clone_batch(items, wait=True, window=2)
        entries, exits = stream(client, started.items)
        assert client.ready().ready
    assert [str(e["key"]) for e in entries] == [*(f"k{i}" for i in range(6)), "p"]
    assert all(e["ok"] and e["fiber"]["mode"] == "call" for e in entries)  # type: ignore[index]
    ends = by_fiber(entries, exits)
    assert {k: x["result"] for k, x in ends.items() if k != "p"} == {
        f"k{i}": [1, 1, 2, 6, 24, 120][i] for i in range(6)}
    pickled = ends["p"]["result"]["pickled"]  # type: ignore[index]
    assert pickle.loads(base64.b64decode(pickled)) == 6
    assert {x["status"] for x in exits} == {0} and not any("error" in x for x in exits)
    assert len(windows_opened(windowed)) == 1  # the task window ran them, not fiberd's path
    starts = [r for r in records(windowed) if r["event"] == "fiber_start"]
    assert {r["mode"] for r in starts} == {"call"} and len(starts) == 7


def test_a_raising_call_returns_its_exception_and_a_silent_one_fiber_died(
        windowed: ThreadFiberd) -> None:
    items = [{"key": "raises", "call": {"target": "math:sqrt", "args": [-1]}},
             {"key": "silent", "call": {"target": "os:_exit", "args": [3]}},
             {"key": "missing", "call": {"target": f"{T}:no_such_function"}}]
    with FiberdClient(windowed.path) as client:
        started = client.clone_batch(items, wait=True, window=3)
        entries, exits = stream(client, started.items)
    ends = by_fiber(entries, exits)
    assert ends["raises"]["error"]["type"] == "ValueError"  # type: ignore[index]
    assert ends["raises"]["exit_code"] == 1 and "result" not in ends["raises"]
    assert ends["missing"]["error"]["type"] == "AttributeError"  # type: ignore[index]
    assert ends["silent"]["exit_code"] == 3  # it died before writing a record
    assert ends["silent"]["error"] == {"type": "FiberDied",
                                       "message": "the fiber ended before reporting a result"}
    assert len(windows_opened(windowed)) == 1
    exits_audited = [r for r in records(windowed) if r["event"] == "fiber_exit"]
    assert sorted(r["exit"]["error"]["type"] for r in exits_audited) == [  # type: ignore[index]
        "AttributeError", "FiberDied", "ValueError"]


def test_a_large_call_result_arrives_whole_and_one_past_a_reply_is_refused(
        windowed: ThreadFiberd) -> None:
    items = [{"key": "big", "call": {"target": "operator:mul", "args": ["x", 2 << 20]}},
             {"key": "huge", "call": {"target": "operator:mul", "args": ["y", 17 << 20]}}]
    with FiberdClient(windowed.path) as client:
        started = client.clone_batch(items, wait=True, window=2)
        entries, exits = stream(client, started.items)
    ends = by_fiber(entries, exits)
    assert ends["big"]["result"] == "x" * (2 << 20)
    assert ends["huge"]["error"]["type"] == "ResultTooLarge"  # type: ignore[index]
    assert len(windows_opened(windowed)) == 1


def test_a_mixed_window_of_exec_and_call_items(windowed: ThreadFiberd, tmp_path: Path) -> None:
    log = tmp_path / "log"
    items: list[dict[str, object]] = []
    for i in range(6):
        items.append(marking(log, f"x{i}", 0.05) if i % 2 else
                     {"key": f"c{i}", "call": {"target": "operator:add", "args": [i, 100]}})
    with FiberdClient(windowed.path) as client:
        started = client.clone_batch(items, wait=True, window=2)
        entries, exits = stream(client, started.items)
    ends = by_fiber(entries, exits)
    assert sorted(ends) == sorted(str(i["key"]) for i in items)
    assert {k: x["result"] for k, x in ends.items() if k.startswith("c")} == {
        "c0": 100, "c2": 102, "c4": 104}
    assert {x["status"] for x in exits} == {0}
    assert {str(e["key"]): e["fiber"]["mode"] for e in entries} == {  # type: ignore[index]
        str(i["key"]): "call" if "call" in i else "exec" for i in items}
    assert most_at_once(log) <= 2
    assert len(windows_opened(windowed)) == 1


def test_a_client_that_leaves_has_its_call_fibers_killed_and_their_ends_audited(
        windowed: ThreadFiberd, tmp_path: Path) -> None:
    log = tmp_path / "log"
    with FiberdClient(windowed.path) as client:
        client.clone_batch([stamped_call(log, f"k{i}", 30) for i in range(4)],
                           wait=True, window=2)
        deadline = time.monotonic() + 30
        while not log.exists() or len(stamps(log)) < 2:  # both running: then leave
            assert time.monotonic() < deadline, "the calls never ran"
            time.sleep(0.02)
    deadline = time.monotonic() + 30
    while not [r for r in records(windowed) if r["event"] == "window_close"] or \
            len([r for r in records(windowed) if r["event"] == "fiber_exit"]) < len(
                [r for r in records(windowed) if r["event"] == "fiber_start"]):
        assert time.monotonic() < deadline, "the window's ends were never audited"
        time.sleep(0.05)
    rows = records(windowed)
    starts = [r for r in rows if r["event"] == "fiber_start"]
    assert sorted(str(r["key"]) for r in starts) == ["k0", "k1"]  # none after the close
    assert {r["mode"] for r in starts} == {"call"}
    ends = [r for r in rows if r["event"] == "fiber_exit"]
    assert {r["exit"]["signal"] for r in ends} == {signal.SIGKILL}  # type: ignore[index]
    assert [r["cause"] for r in rows if r["event"] == "window_close"] == ["cancelled"]
    time.sleep(0.5)
    assert sorted(stamps(log)) == ["+k0", "+k1"]  # none ran its 30 s, none started after


def test_an_early_result_comes_before_its_exit_even_while_the_exit_waits_for_fsync(
        site: Site) -> None:
    items = [{"key": "k0", "call": {"target": f"{T}:sleep", "args": [1.0]}},
             {"key": "k1", "call": {"target": f"{T}:sleep", "args": [0]}}]
    with fiberd_in_thread(site, task_window="template", audit_fsync="always") as served, \
            FiberdClient(served.path) as client:
        client.clone(exec={"argv": ["true"]}, wait=True)  # starts the fsync helper
        client.wait_exit(within=30)
        started = client.clone_batch(items, wait=True, window=1, early=True)
        seen = [("started", {"items": started.items})]
        while not any(name == "started" and any(e["key"] == "k0" and e["ok"]
                                                for e in body["items"])  # type: ignore[union-attr]
                      for name, body in seen):
            seen.append(client.wait_event(within=30))
        k0 = next(e["fiber"]["id"] for _, body in seen for e in body["items"]  # type: ignore[union-attr]
                  if e["key"] == "k0")
        with fsync_stalled(served):  # k0's exit cannot be told; its result can
            name, body = client.wait_event(within=30)
            while name == "started":
                name, body = client.wait_event(within=30)
            assert (name, body) == ("result", {"fiber_id": k0, "result": "slept"})
        rest = []
        while not rest or not client.ready:
            event = client.wait_event(within=30)
            rest.append(event)
            if sum(1 for n, _ in rest if n == "exit") == 2:
                break
        assert len(windows_opened(served)) == 1
    order = [(n, b.get("fiber_id")) for n, b in rest]
    assert ("exit", k0) in order
    results = [b for n, b in rest if n == "result"]
    assert all(r["fiber_id"] != k0 for r in results)  # its exit carried it: no second one
    for r in results:
        assert order.index(("result", r["fiber_id"])) < order.index(("exit", r["fiber_id"]))


def test_a_window_whose_descriptors_pass_one_message_takes_fiberds_path(
        windowed: ThreadFiberd) -> None:
    count = 64  # 64 calls, each with stdin, stdout, stderr and its result: 256 > 253
    nulls = [os.open(os.devnull, os.O_RDWR) for _ in range(3 * count)]
    try:
        stdio = [{"stdin": nulls[3 * i], "stdout": nulls[3 * i + 1],
                  "stderr": nulls[3 * i + 2]} for i in range(count)]
        items = [{"key": f"k{i}", "call": {"target": "operator:neg", "args": [i]}}
                 for i in range(count)]
        with FiberdClient(windowed.path) as client:
            started = client.clone_batch(items, stdio=stdio, wait=True, window=4)
            _, exits = stream(client, started.items, count, within=120)
            assert sorted(x["result"] for x in exits) == sorted(-i for i in range(count))
            assert not windows_opened(windowed)  # fiberd's own path ran them
            started = client.clone_batch(items[:63], stdio=stdio[:63], wait=True, window=4)
            _, exits = stream(client, started.items, 63, within=120)
    finally:
        for fd in nulls:
            os.close(fd)
    assert len(exits) == 63 and len(windows_opened(windowed)) == 1  # 252 fit: a window


def test_a_template_of_another_account_takes_fiberds_path_for_calls(
        tmp_path: Path, other_user: Any) -> None:
    """A root fiberd whose templates run as another account (``fiber_user``): a windowed
    batch of calls is served by fiberd's own path, as exec items are."""
    from tests.cli.commandkit import wait_ready, wait_socket
    from tests.security.test_hostile_root_fiberd_fibers import run_root_fiberd
    if os.geteuid() != 0:
        pytest.skip("needs root: a fiberd whose templates run as another account")
    site = Site(tmp_path, "other-account")
    tmp_path.chmod(0o755)
    site.drop()
    proc = run_root_fiberd(site, {"fiber-user": other_user.name, "task-window": "template"})
    try:
        sock = wait_socket(site, proc)
        wait_ready(sock)
        items = [{"key": f"k{i}", "call": {"target": "os:getuid"}} for i in range(3)]
        with FiberdClient(sock) as client:
            started = client.clone_batch(items, grant="g1", wait=True, window=2)
            entries, exits = stream(client, started.items, 3)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert all(e["ok"] for e in entries) and {x["result"] for x in exits} == {other_user.uid}
    rows = [json.loads(line) for log in site.state.glob("audit*.jsonl")
            for line in log.read_text().splitlines()]
    assert rows and not [r for r in rows if r["event"] == "window_open"]  # fiberd's path
    assert len([r for r in rows if r["event"] == "clone"]) == 3


def test_no_call_fiber_runs_past_its_seconds(site: Site) -> None:
    mint = site.token
    site.token = lambda *a, **kw: mint(*a, **{**kw, "seconds": 0.5})  # type: ignore[method-assign]
    items = [{"key": f"k{i}", "call": {"target": f"{T}:sleep", "args": [30]}} for i in range(2)]
    with fiberd_in_thread(site, task_window="template") as served, \
            FiberdClient(served.path) as client:
        began = time.monotonic()
        started = client.clone_batch(items, wait=True, window=2)
        _, exits = stream(client, started.items)
        took = time.monotonic() - began
        assert len(windows_opened(served)) == 1
    assert {x["signal"] for x in exits} == {signal.SIGKILL} and len(exits) == 2
    assert {x["error"]["type"] for x in exits} == {"FiberDied"}  # type: ignore[index]
    assert took < 20


CALL_WINDOWS = r"""
import json, socket, struct, sys
path, n = sys.argv[1], int(sys.argv[2])
socks, answers = [], []
for c in range(n):  # a sleeper holds the window; 63 calls wait, each with its result channel
    items = [{"key": "s", "call": {"target": "time:sleep", "args": [30]}}] + [
        {"key": f"k{i}", "call": {"target": "operator:neg", "args": [i]}} for i in range(63)]
    body = json.dumps({"op": "clone_batch", "v": 5, "id": c, "wait": True, "window": 1,
                       "grant": "g1", "items": items}).encode()
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(20)
    s.connect(path)
    s.sendall(struct.pack(">I", len(body)) + body)
    (size,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
    reply = json.loads(s.recv(size, socket.MSG_WAITALL))
    answers.append(reply.get("event") or reply.get("error", {}).get("code"))
    socks.append(s)
print(json.dumps({"answers": answers}), flush=True)
sys.stdin.read()  # hold the batches until stdin closes
"""


def test_another_users_call_windows_hold_a_bounded_number_of_result_channels(
        site: Site, tmp_path: Path, other_user: Any) -> None:
    """fiberd holds a window's result channels while it runs: another user's windows count
    them against ``max_window_fds_per_uid`` (256), as fiberd's path counts the descriptors
    of items not started: four windows of 64 calls run, a fifth is refused busy."""
    if os.geteuid() != 0:
        pytest.skip("needs root: a client of another account")
    with public_dir() as where:
        path = where / "fiberd.sock"
        with fiberd_in_thread(site, task_window="template", socket=str(path),
                              allowed_uids=str(other_user.uid)) as served:
            proc = subprocess.Popen(["/usr/bin/python3", "-c", CALL_WINDOWS, str(path), "5"],
                                    text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, **other_user.spawn_args())
            try:
                line = proc.stdout.readline() if proc.stdout else ""
                assert line, proc.stderr.read() if proc.stderr else ""
                assert json.loads(line)["answers"] == ["started"] * 4 + ["busy"]
                assert served.on_loop(served.server.window_fds_by_uid) == {
                    other_user.uid: 256}
                assert len(windows_opened(served)) == 4
            finally:
                if proc.stdin:
                    proc.stdin.close()
                proc.wait(30)
            end = time.monotonic() + 30  # its windows closed: their channels given up
            while served.on_loop(served.server.window_fds_by_uid):
                assert time.monotonic() < end, served.on_loop(served.server.window_fds_by_uid)
                time.sleep(0.05)
