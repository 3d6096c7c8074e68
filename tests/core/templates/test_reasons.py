"""Why a fiber ended, as its exit says (issue 20), on real templates and fibers.

A deadline stop on the injected clock: the reason noted before the stop, completed
with "killed after N s grace" or "ended on SIGTERM"; a fiber lost with its template;
a SIGKILL fiberd did not send (out of memory "not known" without a memory controller,
ruled out with one that counts no oom_kill, ``oom`` when it counts one); an exec
that fails comes back as ``exec_failed`` with errno and path and a shell's status.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from slurm_fiber.core.cgroups.manager import CgroupManager
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.fibers.fiber import enforce_deadline
from slurm_fiber.core.fibers.handles import api_exit
from slurm_fiber.core.templates.parent import FiberRequest
from slurm_fiber.core.trust.grant import Limits
from tests.core.processkit import (
    EXEC_STARTS,
    aio,
    exec_template,
    marked_procs,
    read_line,
    stop_on_fake_clock,
    warm_template,
)
from tests.core.templates.stopkit import ignoring_fiber

T = "tests.core.templates.targetkit"


@aio
async def test_a_deadline_stop_says_why_and_how_it_went_on_the_injected_clock(tmp_path, mark):
    clock = FakeClock()
    t = await warm_template(tmp_path, mark, preload=(T,), clock=clock)
    fiber = await ignoring_fiber(t, "d")
    due = clock.mono() + 2

    def deadline() -> float:
        if clock.mono() >= due:
            fiber.note_reason("deadline", "deadline 2 s (limits.seconds) reached")
        return due

    bounded = asyncio.ensure_future(enforce_deadline(fiber, deadline, clock, grace=1))
    await clock.advance_and_settle(1.9)
    assert fiber.running and not bounded.done()
    await clock.advance_and_settle(0.2)  # deadline reached: SIGTERM, ignored
    await asyncio.sleep(0.2)
    assert fiber.running
    await clock.advance_and_settle(1.0)  # the grace is over: SIGKILL
    end = await bounded
    assert end.signal == signal.SIGKILL and end.reason is not None
    assert end.reason.to_json() == {
        "code": "deadline",
        "message": "deadline 2 s (limits.seconds) reached, killed after 1 s grace"}
    assert api_exit("d", "exec", end).to_json()["reason"] == end.reason.to_json()

    polite = await t.fork(FiberRequest(id="p", target=f"{T}:sleep", args=(60,)))
    polite.note_reason("stopped", "stopped on request")
    polite.note_reason("removed", "not this one: the first note counts")
    done = await polite.stop(grace=30)
    assert done.reason is not None and done.reason.code == "stopped"
    assert done.reason.message == "stopped on request, ended on SIGTERM"

    out_r, out_w = os.pipe()
    tidy = await t.fork(FiberRequest(  # handles SIGTERM by exiting 0
        id="t", mode="exec", stdio=(None, out_w, None),
        argv=("sh", "-c", "trap 'exit 0' TERM; sleep 60 & echo up; wait")))  # sleep first: the
    # stop's group SIGTERM must find it, or it would outlive the fiber (a race, seen in CI)
    os.close(out_w)
    assert await read_line(out_r) == b"up\n"
    os.close(out_r)
    tidy.note_reason("fiberd_shutdown", "fiberd is shutting down")
    done = await tidy.stop(grace=30)
    assert done.exit_code == 0 and done.reason is not None
    assert done.reason.message == "fiberd is shutting down, exited within the grace after SIGTERM"

    free = await t.fork(FiberRequest(id="f", argv=("sh", "-c", "exit 3"), mode="exec"))
    assert (await free.wait()).reason is None  # it ended by itself: nothing to say
    await stop_on_fake_clock(t, clock)
    assert marked_procs(mark) == []


@aio
async def test_a_fiber_lost_with_its_template_says_so(tmp_path, mark):
    t = await warm_template(tmp_path, mark, preload=(T,))
    fiber = await t.fork(FiberRequest(id="l", target=f"{T}:sleep", args=(60,)))
    assert t.pid is not None
    os.kill(t.pid, signal.SIGKILL)
    end = await fiber.wait()
    assert end.reason is not None and end.reason.code == "template_lost"
    assert "template" in end.reason.message and "the fiber with it" in end.reason.message
    await t.stop(0)


@aio
async def test_a_sigkill_fiberd_did_not_send_tells_whether_it_was_out_of_memory(
        tmp_path, mark, cgroup_root: Path):
    grant = CgroupManager(cgroup_root).carve_grant("g", Limits())
    assert grant is not None
    t = await warm_template(tmp_path, mark, preload=(T,), cgroup=grant)
    out_r, out_w = os.pipe()
    fiber = await t.fork(FiberRequest(id="k", target=f"{T}:ignore_term_and_sleep",
                                      args=(60,), stdio=(None, out_w, None)))
    os.close(out_w)
    assert await read_line(out_r) == b"ignoring\n"
    os.close(out_r)
    assert fiber.cgroup is not None
    has_memory = (fiber.cgroup / "memory.events").exists()
    os.kill(fiber.pid, signal.SIGKILL)  # not fiberd, not the OOM killer
    end = await fiber.wait()
    assert end.signal == signal.SIGKILL and end.reason is not None
    assert end.reason.code == "signal"
    if has_memory:
        assert end.reason.message.endswith("not by fiberd and not out of memory")
    else:
        assert "whether out of memory is not known: no memory controller" in end.reason.message
    await t.stop(0)


@aio
async def test_an_oom_kill_is_named_where_the_memory_controller_counts_it(
        tmp_path, mark, cgroup_root: Path):
    # auto: v2's memory controller where the v2 tree offers it, else (hybrid hosts) v1's.
    grant = CgroupManager(cgroup_root, backend="auto").carve_grant("g", Limits(memory=64 << 20))
    assert grant is not None
    t = await warm_template(tmp_path, mark, preload=(T,), cgroup=grant)
    hog = ("python3", "-c", "x = [bytearray(1 << 20) for _ in range(1024)]")
    fiber = await t.fork(FiberRequest(id="o", argv=hog, mode="exec"))
    end = await fiber.wait()
    assert end.signal == signal.SIGKILL and end.reason is not None
    assert end.reason.code == "oom" and "oom_kill" in end.reason.message
    await t.stop(0)


@pytest.mark.parametrize("start", EXEC_STARTS)
@aio
async def test_an_exec_that_fails_says_errno_and_path_with_a_shells_status(tmp_path, mark,
                                                                          start):
    t = await exec_template(tmp_path, mark, start)
    script = tmp_path / "script"
    script.write_text("#!/nonexistent/interpreter\n")
    script.chmod(0o755)
    plain = tmp_path / "plain"
    plain.write_text("echo hi\n")
    plain.chmod(0o644)
    cases = {
        "/nonexistent": (127, "ENOENT", None),
        "no-such-command-here": (127, "ENOENT", None),
        str(plain): (126, "EACCES", None),
        str(tmp_path): (126, "EACCES", None),
        str(script): (126, "ENOENT", "/nonexistent/interpreter"),
    }
    for i, (path, (status, name, interpreter)) in enumerate(cases.items()):
        # Spawned or not, a program that cannot start ends up in a spare (exec_spawn.py).
        fiber = await t.fork(FiberRequest(id=f"e{i}", argv=(path, "arg"), mode="exec"))
        exit_ = api_exit(fiber.id, "exec", await fiber.wait()).to_json()
        assert exit_["status"] == status, (path, exit_)
        failed = exit_["exec_failed"]
        assert isinstance(failed, dict)
        assert (failed["path"], failed["name"]) == (path, name)
        assert failed["errno"] == getattr(__import__("errno"), name)
        assert failed["message"] == os.strerror(failed["errno"])
        assert failed.get("interpreter") == interpreter
        assert exit_["reason"] is None
    await t.stop(0)
