"""``slurm_fiber.Executor`` against a real standalone fiberd: the semantics issue 14 asks
to be shown (results, exceptions with their remote traceback, cancellation, per-task
timeout, shutdown with pending work, retry of retryable misses, a killed fiber)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

from slurm_fiber import Executor
from slurm_fiber.cli.throwaway import Site
from slurm_fiber.client.executor import (
    FiberKilled,
    FiberMissed,
    RemoteError,
    RemoteTraceback,
    TaskTimeout,
    reference,
)
from slurm_fiber.client.tasks import NotReady
from slurm_fiber.core.trust.grant import Limits
from tests.core.processkit import alive
from tests.executor import fnkit
from tests.executor.sitekit import started_site, stop_site


def test_results_come_back_as_python_values_each_from_its_own_fiber(site: Site) -> None:
    with Executor(socket=site.socket, max_workers=2) as ex:
        assert ex.submit(fnkit.square, 7).result(timeout=30) == 49
        assert list(ex.map(fnkit.square, range(6), timeout=60)) == [0, 1, 4, 9, 16, 25]
        args, kwargs, pid = ex.submit(fnkit.describe, (1, 2), b"x", key={3}).result(30)
        other = ex.submit(fnkit.describe).result(30)[2]
    assert (args, kwargs) == (((1, 2), b"x"), {"key": {3}})  # not JSON: tuple, bytes, set
    assert pid != os.getpid() and other != pid


def test_a_library_function_runs_by_reference_with_keyword_arguments(site: Site) -> None:
    text = "a library function is found by name in the fiber"
    assert reference(textwrap.shorten) == "textwrap:shorten"
    with Executor(socket=site.socket) as ex:
        assert ex.submit(textwrap.shorten, text, width=20).result(30) == \
            textwrap.shorten(text, width=20)


def test_functions_not_importable_in_the_template_travel_by_value(site: Site) -> None:
    offset = 100

    def closure(x: int) -> int:
        return x + offset

    assert reference(fnkit.square) == "tests.executor.fnkit:square"
    assert reference(closure) is None and reference(lambda: 0) is None
    with Executor(socket=site.socket) as ex:
        assert ex.submit(closure, 1).result(30) == 101
        assert ex.submit(lambda: (lambda y: y * 2)).result(30)(4) == 8  # a lambda back


def test_an_exception_is_reraised_as_itself_with_the_remote_traceback(site: Site) -> None:
    with Executor(socket=site.socket) as ex:
        future = ex.submit(fnkit.fail, "no luck")
        with pytest.raises(fnkit.Boom, match="no luck") as raised:
            future.result(30)
    cause = raised.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "in fail" in cause.text and "raise Boom(message)" in cause.text

    class Local(Exception):
        pass

    def raises_local() -> None:
        raise Local("defined in a test")

    with Executor(socket=site.socket) as ex, pytest.raises(Local):  # travels by value and back
        ex.submit(raises_local).result(30)


def test_an_exception_that_cannot_come_back_is_a_remote_error(site: Site) -> None:
    def unpicklable() -> None:
        import threading

        err = RuntimeError("holds a lock")
        err.lock = threading.Lock()  # type: ignore[attr-defined]
        raise err

    with Executor(socket=site.socket) as ex, pytest.raises(RemoteError) as raised:
        ex.submit(unpicklable).result(30)
    assert raised.value.type == "RuntimeError" and "holds a lock" in raised.value.message
    assert "unpicklable" in raised.value.traceback


def test_a_fiber_killed_by_a_signal_is_named(site: Site) -> None:
    with Executor(socket=site.socket) as ex:
        with pytest.raises(FiberKilled, match="killed by SIGKILL") as raised:
            ex.submit(fnkit.die_by, signal.SIGKILL).result(30)
        assert raised.value.signal == signal.SIGKILL
        with pytest.raises(FiberKilled, match="SIGSEGV"):
            ex.submit(fnkit.die_by, signal.SIGSEGV).result(30)


def test_the_per_task_timeout_stops_the_fiber(site: Site, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with Executor(socket=site.socket, timeout=1.0, stop_grace=0.5) as ex:
        future = ex.submit(fnkit.sleep_then, 60, str(pid_file))
        with pytest.raises(TaskTimeout) as raised:
            future.result(30)
        assert isinstance(raised.value, cf.TimeoutError)
        assert ex.submit(fnkit.square, 3).result(30) == 9  # the connection is still good
    assert not alive(int(pid_file.read_text()))
    fibers = site.request("list_fibers")["fibers"]
    assert not [f for f in fibers if f.get("state") == "running"]


def test_pending_futures_can_be_cancelled_running_ones_finish(site: Site) -> None:
    ex = Executor(socket=site.socket, max_workers=1)
    running = ex.submit(fnkit.sleep_then, 0.5, None, "done")
    pending = [ex.submit(fnkit.square, i) for i in range(3)]
    assert pending[0].cancel()
    ex.shutdown(wait=True, cancel_futures=True)
    assert running.result(0) == "done"
    assert all(f.cancelled() for f in pending)
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(fnkit.square, 1)


def test_shutdown_with_pending_work_waits_for_all_of_it(site: Site) -> None:
    ex = Executor(socket=site.socket, max_workers=2)
    futures = [ex.submit(fnkit.sleep_then, 0.1, None, i) for i in range(6)]
    ex.shutdown(wait=True)
    assert [f.result(0) for f in futures] == list(range(6))


def test_retryable_misses_are_retried_and_a_final_miss_is_raised(tmp_path: Path) -> None:
    site = started_site(tmp_path / "one", Limits(fibers=1))
    pid_file = tmp_path / "first.pid"
    try:
        with Executor(socket=site.socket, max_workers=2) as ex:
            first = ex.submit(fnkit.sleep_then, 1.0, str(pid_file), 0)
            while not pid_file.exists() and not first.done():
                time.sleep(0.01)  # the one fiber the grant allows is running now
            second = ex.submit(fnkit.sleep_then, 0, None, 1)  # capacity, retried until free
            assert [first.result(60), second.result(60)] == [0, 1]
        with Executor(socket=site.socket, grant="no-such-grant", retries=3) as ex, \
                pytest.raises(FiberMissed) as raised:
            ex.submit(fnkit.square, 2).result(30)
        assert raised.value.code == "unknown_grant" and raised.value.attempts == 1
    finally:
        stop_site(site)
    records = [json.loads(line) for line in site.audit_path.read_text().splitlines()]
    assert any(r["event"] == "miss" and r["code"] == "capacity" for r in records)
    assert sum(r["event"] == "clone" for r in records) == 2


def test_wait_ready_returns_when_ready_and_times_out_on_nothing(site: Site,
                                                                tmp_path: Path) -> None:
    Executor(socket=site.socket).wait_ready(timeout=10)
    with pytest.raises(TimeoutError) as raised:
        Executor(socket=tmp_path / "nobody.sock").wait_ready(timeout=0.3)
    assert isinstance(raised.value, NotReady) and not raised.value.reachable


def test_a_call_too_big_for_the_protocol_fails_its_future_not_submit(site: Site) -> None:
    with Executor(socket=site.socket) as ex:
        future = ex.submit(fnkit.square, b"x" * 200_000)
    with pytest.raises(ValueError, match="pass big data by file name"):
        future.result(0)


def test_it_finds_fiberd_as_fiberctl_does(site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FIBERD_SOCKET", str(site.socket))
    with Executor() as ex:
        assert ex.socket == site.socket
        assert ex.submit(fnkit.square, 5).result(30) == 25
    monkeypatch.delenv("FIBERD_SOCKET")
    monkeypatch.setenv("FIBERD_STATE_DIR", str(site.state))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert Executor().socket == site.socket  # a standalone fiberd's default place


def test_calls_pending_together_start_as_one_batch_each_its_own_fiber(site: Site) -> None:
    before = len(site.audit_path.read_text().splitlines())
    with Executor(socket=site.socket, max_workers=6) as ex:
        results = list(ex.map(fnkit.describe, range(12), timeout=60))
        assert ex.submit(fnkit.square, 5).result(30) == 25  # a lone call afterwards: one clone
    assert [r[0] for r in results] == [(i,) for i in range(12)]
    assert len({r[2] for r in results}) == 12  # twelve processes
    records = [json.loads(line) for line in site.audit_path.read_text().splitlines()[before:]]
    clones = [r for r in records if r["event"] == "clone"]
    assert len(clones) == 13 and len({r["fiber"] for r in clones}) == 13
    assert clones[0].get("batch") == 6  # map queued all twelve: room for six at once
    assert "batch" not in clones[-1]
