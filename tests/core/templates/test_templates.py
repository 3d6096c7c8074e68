"""Templates and fibers with real processes: warm, fork, results, stdio, signals, re-warm."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.devices import Device, DeviceChannel
from slurm_fiber.core.fibers.fiber import FiberState
from slurm_fiber.core.templates.parent import (
    Backoff,
    FiberRequest,
    ForkFailed,
    TemplateNotReady,
    TemplateState,
    template_env,
)
from slurm_fiber.core.trust.grant import TemplateSpec
from tests.core.processkit import (
    EXEC_STARTS,
    aio,
    exec_template,
    fork_as,
    marked_procs,
    read_line,
    start_template,
    wait_state,
    warm_template,
)

T = "tests.core.templates.targetkit"


@aio
async def test_warm_then_call_returns_the_result(tmp_path: Path, mark: str):
    t = await warm_template(tmp_path, mark, preload=("json", T), warm=f"{T}:warm")
    fiber = await t.fork(FiberRequest(id="f1", target=f"{T}:add", args=(2, 3)))
    # (a fiber this short may have exited before fork() returns: its state is not asserted)
    assert fiber.pid != t.pid
    ex = await fiber.wait()
    assert ex.exit_code == 0 and ex.result == {"ok": True, "result": 5}
    assert ex.cpu_time is not None and ex.maxrss and ex.maxrss > 1 << 20
    assert fiber.to_json()["exit"]["exit_code"] == 0
    await t.stop(1.0)
    assert t.state is TemplateState.STOPPED and marked_procs(mark) == []


@aio
async def test_a_result_larger_than_a_socket_buffer_comes_back_whole(tmp_path: Path, mark: str):
    t = await warm_template(tmp_path, mark, preload=(T,))
    n = 3_000_000  # many datagrams, more than the socket buffers hold at once
    fiber = await t.fork(FiberRequest(id="big", target=f"{T}:text_of", args=(n,)))
    ex = await fiber.wait()
    assert ex.exit_code == 0 and ex.result == {"ok": True, "result": "x" * n}
    await t.stop(1.0)


@pytest.mark.parametrize(("preload", "warm", "error"), [
    (("no_such_module_xyz",), None, "ModuleNotFoundError"),
    ((), f"{T}:warm_fails", "RuntimeError"),
    ((), f"{T}:no_such_function", "AttributeError"),
])
@aio
async def test_warm_failure_reports_class_and_one_line(tmp_path: Path, mark: str,
                                                       preload, warm, error):
    t = await start_template(tmp_path, mark, preload=preload, warm=warm)
    assert await t.wait_warm() is TemplateState.WARM_FAILED
    assert t.warm_error is not None and t.warm_error.error == error
    assert "\n" not in t.warm_error.message and t.warm_error.message
    with pytest.raises(TemplateNotReady, match="warm_failed"):
        await t.fork(FiberRequest(id="f", target=f"{T}:add", args=(1, 1)))
    await t.stop(1.0)


@aio
async def test_exceptions_come_back_as_error_records(tmp_path: Path, mark: str):
    t = await warm_template(tmp_path, mark, preload=(T,))
    ex = await (await t.fork(FiberRequest(id="e1", target=f"{T}:boom"))).wait()
    assert ex.exit_code == 1 and ex.result is not None and ex.result["ok"] is False
    err = ex.result["error"]
    assert err["type"] == "ValueError" and err["message"] == "bad thing"
    assert "Traceback" in err["traceback"]
    ex = await (await t.fork(FiberRequest(id="e2", target=f"{T}:unserialisable"))).wait()
    assert ex.result["error"]["type"] == "TypeError"
    ex = await (await t.fork(FiberRequest(id="e3", mode="exec", argv=("no-such-cmd-x",)))).wait()
    assert ex.exit_code == 127 and ex.result["exec_failed"]["name"] == "ENOENT"
    await t.stop(1.0)


@pytest.mark.parametrize("start", EXEC_STARTS)
@aio
async def test_exec_mode_output_to_state_files_and_exit_status(tmp_path: Path, mark: str,
                                                               start: str):
    t = await exec_template(tmp_path, mark, start)
    fiber = await fork_as(t, start, FiberRequest(
        id="x1", mode="exec",
        argv=("sh", "-c", "echo out $SLURM_FIBER_ID $EXTRA; echo err >&2; exit 7"),
        env={"EXTRA": "yes", "CUDA_VISIBLE_DEVICES": "0,1,2"}))
    ex = await fiber.wait()
    assert ex.exit_code == 7 and ex.result is None
    assert fiber.stdout_path is not None and fiber.stdout_path.read_text() == "out x1 yes\n"
    assert fiber.stderr_path is not None and fiber.stderr_path.read_text() == "err\n"
    # Uncarved, a stray descendant might still write: even empty files are kept.
    quiet = await fork_as(t, start, FiberRequest(id="x2", mode="exec", argv=("true",)))
    assert (await quiet.wait()).exit_code == 0
    record = quiet.to_json()
    assert record["stdout"] == str(quiet.stdout_path) and quiet.stdout_path.read_text() == ""
    assert record["stderr"] == str(quiet.stderr_path) and quiet.stderr_path.read_text() == ""
    await t.stop(1.0)


@aio
async def test_passed_stdio_streams_live(tmp_path: Path, mark: str):
    t = await warm_template(tmp_path, mark, preload=(T,))
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    fiber = await t.fork(FiberRequest(id="s1", target=f"{T}:echo_lines",
                                      stdio=(in_r, out_w, None)))
    os.close(in_r)
    os.close(out_w)
    os.write(in_w, b"hello\n")
    # The fiber is still running: its answer arrives before stdin closes.
    line = await read_line(out_r)
    assert line == b"HELLO\n" and fiber.running
    os.close(in_w)
    assert (await fiber.wait()).exit_code == 0
    os.close(out_r)
    await t.stop(1.0)


@aio
async def test_sigint_reaches_the_fiber(tmp_path: Path, mark: str):
    t = await warm_template(tmp_path, mark, preload=(T,))
    out_r, out_w = os.pipe()
    fiber = await t.fork(FiberRequest(id="c1", target=f"{T}:wait_for_interrupt",
                                      stdio=(None, out_w, None)))
    os.close(out_w)
    assert await read_line(out_r) \
        == b"waiting\n"
    assert fiber.signal(signal.SIGINT)
    ex = await fiber.wait()
    os.close(out_r)
    assert ex.exit_code == 130 and ex.result["error"]["type"] == "KeyboardInterrupt"
    assert not fiber.signal(signal.SIGINT)  # ended: nothing is signalled
    await t.stop(1.0)


@aio
async def test_rngs_are_reseeded_in_each_fiber(tmp_path: Path, mark: str):
    numpy = pytest.importorskip("numpy")
    del numpy
    t = await warm_template(tmp_path, mark, preload=(T, "numpy"))
    results = []
    for i in range(3):
        ex = await (await t.fork(FiberRequest(id=f"r{i}", target=f"{T}:rand"))).wait()
        results.append(tuple(ex.result["result"]))
    assert len(results[0]) == 2  # random and numpy both sampled
    assert len(set(results)) == 3
    assert len({r[1] for r in results}) == 3
    await t.stop(1.0)


@aio
async def test_devices_env_is_exact_and_cannot_be_widened(tmp_path: Path, mark: str):
    channel = DeviceChannel.of([Device("gpu", 3, uuid="GPU-c"), Device("gpu", 1)])
    spec = TemplateSpec(env={"CUDA_VISIBLE_DEVICES": "0,1,2,3", "OTHER": "kept"})
    env = template_env({"ZE_AFFINITY_MASK": "", "PATH": "/bin"}, spec, channel)
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3" and env["ZE_AFFINITY_MASK"] == "1,3"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "1,GPU-c" and env["OTHER"] == "kept"
    none = template_env({"CUDA_VISIBLE_DEVICES": "0"}, spec, channel.narrowed(()))
    assert none["CUDA_VISIBLE_DEVICES"] == "" and none["ZE_AFFINITY_MASK"] == "-1"
    assert none["NVIDIA_VISIBLE_DEVICES"] == "void" and none["ROCR_VISIBLE_DEVICES"] == "-1"


@pytest.mark.parametrize("bad", [
    FiberRequest(id="../x", target=f"{T}:add"),
    FiberRequest(id="ok", target="no_colon"),
    FiberRequest(id="ok", mode="exec", argv=()),
    FiberRequest(id="ok", mode="teleport"),  # type: ignore[arg-type]
])
def test_malformed_requests_are_refused_before_any_fork(bad: FiberRequest):
    with pytest.raises(ValueError):
        bad.check()


@aio
async def test_dead_template_is_rewarmed_with_backoff_and_its_fibers_accounted(
        tmp_path: Path, mark: str):
    clock = FakeClock()
    t = await warm_template(tmp_path, mark, preload=(T,), clock=clock)
    t.backoff = Backoff(initial=2.0)
    fiber = await t.fork(FiberRequest(id="l1", target=f"{T}:sleep", args=(60,)))
    first_pid = t.pid
    assert first_pid is not None
    os.kill(first_pid, signal.SIGKILL)
    ex = await fiber.wait()  # the fiber died with its template: accounted, not orphaned
    assert ex.state is FiberState.LOST and ex.status is None
    while t.state is not TemplateState.REWARMING:
        await asyncio.sleep(0.01)
    await clock.advance_and_settle(1.9)
    assert t.state is TemplateState.REWARMING  # still inside its backoff
    await clock.advance_and_settle(0.2)
    assert await t.wait_warm() is TemplateState.READY
    assert t.pid != first_pid and t.restarts == 1
    ex = await (await t.fork(FiberRequest(id="l2", target=f"{T}:add", args=(1, 2)))).wait()
    assert ex.result == {"ok": True, "result": 3}
    stopping = asyncio.ensure_future(t.stop(1.0))
    while not stopping.done():
        await clock.advance_and_settle(0.5)
        await asyncio.sleep(0.01)
    assert marked_procs(mark) == []


@aio
async def test_duplicate_id_and_stopped_template_are_refused(tmp_path: Path, mark: str):
    t = await warm_template(tmp_path, mark, preload=(T,))
    running = await t.fork(FiberRequest(id="dup", target=f"{T}:sleep", args=(60,)))
    with pytest.raises(ForkFailed, match="in use"):
        await t.fork(FiberRequest(id="dup", target=f"{T}:add", args=(1, 1)))
    await t.stop(1.0)
    assert not running.running and running.exit is not None and running.exit.stopped
    with pytest.raises(TemplateNotReady, match="stopped"):
        await t.fork(FiberRequest(id="late", target=f"{T}:add", args=(1, 1)))
    assert marked_procs(mark) == []


@aio
async def test_a_reap_ask_leaves_a_running_fiber_alone_and_its_exit_is_still_reported(
        tmp_path: Path, mark: str) -> None:
    # fiberd asks the template to reap a fiber whose exit outran its report (its SIGCHLD
    # may have coalesced, core/child_exits.py); an ask that comes early must not end it.
    t = await warm_template(tmp_path, mark)
    fiber = await t.fork(FiberRequest(id="r", mode="exec", argv=("sleep", "60")))
    t._ask_reap(fiber.pid)
    t._ask_reap(os.getpid())  # not the template's child: ignored
    after = await t.fork(FiberRequest(id="a", mode="exec", argv=("true",)))
    assert (await after.wait()).exit_code == 0  # the template has served what came before
    assert fiber.state is FiberState.RUNNING and wait_state(fiber.pid, "S")  # sleeping
    os.kill(fiber.pid, signal.SIGKILL)
    end = await fiber.wait()
    assert end.state is FiberState.EXITED and end.signal == signal.SIGKILL
    assert end.maxrss is not None  # the template's report: the kernel's record has none
    await t.stop(1.0)


@aio
async def test_a_call_fiber_blocks_no_signal_though_its_template_blocks_sigchld(
        tmp_path: Path, mark: str) -> None:
    t = await warm_template(tmp_path, mark, preload=(T,))
    fiber = await t.fork(FiberRequest(id="m", target=f"{T}:blocked_signals"))
    end = await fiber.wait()
    assert end.exit_code == 0 and end.result == {"ok": True, "result": []}
    assert signal.SIGCHLD in status_blocked(t.pid)  # the template's own: read by signalfd
    await t.stop(1.0)


def status_blocked(pid: int) -> set[int]:
    """The signals process ``pid``'s main thread blocks (/proc/<pid>/status SigBlk)."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                if x.startswith("SigBlk:"))
    mask = int(line.split()[1], 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}
