"""``slurm_fiber.Executor(windows=True)`` against real fiberds: pending calls go as one
windowed batch (protocol v5) of at most ``max_workers`` running, results and errors come
back as without windows, ``max_workers`` is never exceeded, and ``shutdown`` with
``cancel_futures`` has a window start nothing more. Each test runs against fiberd's own
path and against a fiberd with ``task_window = "template"``, whose template runs each
window of calls itself (docs/design.md, "Task windows")."""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber import Executor
from slurm_fiber.cli.throwaway import Site
from slurm_fiber.client.executor import FiberKilled, RemoteTraceback, TaskTimeout
from tests.core.processkit import alive
from tests.executor import fnkit
from tests.executor.sitekit import PRELOADS, stop_site


@pytest.fixture(scope="module", params=["fiberd", "template"])
def site(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Site]:
    s = Site.create(tmp_path_factory.mktemp(f"site-{request.param}"), PRELOADS)
    if request.param == "template":
        s.options["task-window"] = "template"
    s.start(cgroup_root="delegate")
    s.wait_warm(60, lambda _state, _s: None)
    yield s
    stop_site(s)


def records(site: Site, after: int = 0) -> list[dict[str, object]]:
    return [json.loads(line) for line in site.audit_path.read_text().splitlines()[after:]]


def windowed(site: Site, after: int) -> list[int]:
    """The task counts of the windowed batches fiberd took since line ``after`` of its
    audit log: on a task-window fiberd, its task windows' (``window_open``: the template
    ran them); on fiberd's path, its batches' (the ``batch`` of a run of ``clone`` records,
    one per batch)."""
    if site.options.get("task-window") == "template":
        return [int(str(r["tasks"])) for r in records(site, after)
                if r["event"] == "window_open"]
    sizes: list[int] = []
    seen_batch = 0
    for r in records(site, after):
        if r["event"] == "clone" and "batch" in r:
            if seen_batch == 0:
                sizes.append(int(str(r["batch"])))
                seen_batch = int(str(r["batch"]))
            seen_batch -= 1
    return sizes


def wait_for(path: Path, future: cf.Future[object] | None = None) -> None:
    """Until ``path`` exists (the call of ``future`` wrote it), at most 60 s."""
    for _ in range(6000):
        if path.exists() or (future is not None and future.done()):
            break
        if future is None:
            time.sleep(0.01)
        else:
            cf.wait([future], timeout=0.01)
    assert path.exists(), future


def test_results_come_back_in_order_each_call_its_own_fiber(site: Site) -> None:
    before = len(site.audit_path.read_text().splitlines())
    with Executor(socket=site.socket, max_workers=3, windows=True) as ex:
        assert list(ex.map(fnkit.square, range(20), timeout=120)) == [i * i for i in range(20)]
        pids = [r[2] for r in ex.map(fnkit.describe, range(8), timeout=120)]
        assert ex.submit(fnkit.square, 9).result(60) == 81  # a lone call: one Clone
    assert len(set(pids)) == 8
    assert 20 in windowed(site, before)  # map queued all twenty: one window of them


def test_exceptions_kills_output_and_timeouts_as_without_windows(
        site: Site, capsys: pytest.CaptureFixture[str]) -> None:
    with Executor(socket=site.socket, max_workers=1, windows=True, timeout=20.0) as ex:
        words = ["a", "bad", "c"]
        futures = [ex.submit(fnkit.echo_and_fail, w) for w in words]
        assert futures[0].result(60) == "a" and futures[2].result(60) == "c"
        with pytest.raises(ValueError, match="no bad") as raised:
            futures[1].result(60)
        assert isinstance(raised.value.__cause__, RemoteTraceback)
        assert [f.stdout() for f in futures] == [f"printed {w}\n" for w in words]
        with pytest.raises(FiberKilled, match="SIGKILL"):
            list(ex.map(fnkit.die_by, [signal.SIGKILL, signal.SIGKILL], timeout=60))
    out = capsys.readouterr().out
    assert all(f"printed {w}\n" in out for w in words)  # echoed, each call's whole


def test_with_a_per_task_timeout_calls_go_unwindowed_and_a_late_one_is_stopped(
        site: Site, tmp_path: Path) -> None:
    """A task window's fibers cannot be stopped one by one (a task-window fiberd closes
    a window whole), so a timeout takes the calls out of windows: the late call's fiber is
    stopped, whichever path fiberd takes."""
    pid_file = tmp_path / "late.pid"
    with Executor(socket=site.socket, max_workers=1, windows=True, timeout=1.0,
                  stop_grace=0.5) as ex:
        assert not ex.windows
        results = ex.map(fnkit.sleep_then, [0, 60], [None, str(pid_file)], ["first", "late"],
                         timeout=120)
        assert next(results) == "first"
        with pytest.raises(TaskTimeout):
            next(results)
    assert not alive(int(pid_file.read_text()))


def test_max_workers_is_never_exceeded_and_every_slot_is_used(site: Site) -> None:
    before = len(site.audit_path.read_text().splitlines())
    with Executor(socket=site.socket, max_workers=2, windows=True) as ex:
        spans = list(ex.map(fnkit.span, [0.3] * 10, timeout=120))
        late = [ex.submit(fnkit.span, 0.3) for _ in range(5)]  # submitted one by one
        spans += [f.result(120) for f in late]
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert peak == 2
    assert 10 in windowed(site, before)


def test_a_slot_a_window_gives_back_runs_a_call_submitted_later(site: Site,
                                                               tmp_path: Path) -> None:
    """A window of three calls holding both slots: once two of them ended, it gives one
    slot back while its third still runs, and a call submitted then starts with it."""
    gate, opened = tmp_path / "gate", tmp_path / "opened"
    opened.touch()
    with Executor(socket=site.socket, max_workers=2, windows=True) as ex:
        try:
            held = ex.map(fnkit.gated, [str(gate), str(opened), str(opened)],
                          [str(tmp_path / f"started{i}") for i in range(3)], range(3),
                          timeout=120)
            wait_for(tmp_path / "started2")  # the window is sent: the call below not in it
            assert ex.submit(fnkit.square, 3).result(30) == 9  # the window's first waits
            assert not gate.exists()
        finally:
            gate.touch()
        assert list(held) == [0, 1, 2]


def test_shutdown_with_cancel_futures_starts_nothing_more_of_a_window(
        site: Site, tmp_path: Path) -> None:
    gate0, gate1 = tmp_path / "gate0", tmp_path / "gate1"
    started0, started1 = tmp_path / "started0", tmp_path / "started1"
    before = len(site.audit_path.read_text().splitlines())
    ex = Executor(socket=site.socket, max_workers=1, windows=True)
    try:
        first = ex.submit(fnkit.gated, str(gate0), str(started0), "first")
        wait_for(started0, first)  # a window of its own, running
        window = [ex.submit(fnkit.gated, str(gate1), str(started1), "second")] + \
            [ex.submit(fnkit.square, i) for i in range(4)]  # queued behind the first
        gate0.touch()
        assert first.result(60) == "first"
        wait_for(started1, window[0])  # the window's first call runs, the others wait in it
        assert not window[1].cancel()  # taken into the window: not cancelled one by one
        ex.shutdown(wait=False, cancel_futures=True)
        cf.wait(window[1:], timeout=60)
        assert all(f.cancelled() for f in window[1:])
        gate1.touch()
        assert window[0].result(60) == "second"
    finally:
        gate0.touch()
        gate1.touch()
        ex.shutdown(wait=True)
    assert windowed(site, before)[-1] == 5  # the four others were in its window
    started = [r for r in records(site, before) if r["event"] in ("clone", "fiber_start")]
    assert len(started) == 2
