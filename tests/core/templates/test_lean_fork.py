"""The template's fork (core/lean_fork.py) as fibers see it: at-fork handlers that
preloads register still run where os.fork runs them, threading works in a fiber, and a
template with a thread of its own forks with os.fork and says why in its log."""

from __future__ import annotations

import sys
from pathlib import Path

from slurm_fiber.core.templates.child.lean_fork import VERIFIED_ON
from slurm_fiber.core.templates.parent import FiberRequest
from tests.core.processkit import aio, warm_template

T = "tests.core.templates.targetkit"
OS_FORK = "template: forking with os.fork"


def _log(tmp: Path) -> str:
    return (tmp / "state" / "template-grant-1.log").read_text()


@aio
async def test_a_preloads_at_fork_handlers_run_in_template_and_fiber(tmp_path: Path, mark: str):
    t = await warm_template(tmp_path, mark, preload=(T,), warm=f"{T}:register_fork_handlers")
    for i in range(2):
        ex = await (await t.fork(FiberRequest(id=f"f{i}", target=f"{T}:fork_seen"))).wait()
        seen = ex.result["result"]
        assert seen["child"] == seen["self"]  # after_in_child ran in the fiber
        assert seen["before"] == seen["ppid"]  # before ran in the template, ahead of the fork
    ex = await (await t.fork(FiberRequest(id="f2", target=f"{T}:fork_seen"))).wait()
    assert ex.result["result"]["parent"] == ex.result["result"]["ppid"]  # after earlier forks
    await t.stop(1.0)
    verified = (sys.implementation.name, sys.version_info[:2]) == VERIFIED_ON
    assert (OS_FORK in _log(tmp_path)) is not verified


@aio
async def test_threading_works_in_a_fiber(tmp_path: Path, mark: str):
    t = await warm_template(tmp_path, mark, preload=(T,))
    ex = await (await t.fork(FiberRequest(id="t", target=f"{T}:threads_work"))).wait()
    assert ex.exit_code == 0 and ex.result["result"] == [["Thread-1 (<lambda>)"], True, 1, True]
    await t.stop(1.0)


@aio
async def test_a_template_with_a_thread_forks_with_os_fork(tmp_path: Path, mark: str):
    t = await warm_template(tmp_path, mark, preload=(T,), warm=f"{T}:start_a_thread")
    ex = await (await t.fork(FiberRequest(id="a", target=f"{T}:add", args=(1, 2)))).wait()
    assert ex.exit_code == 0 and ex.result["result"] == 3
    ex = await (await t.fork(FiberRequest(id="t", target=f"{T}:threads_work"))).wait()
    assert ex.result["result"][1:] == [True, 1, True]
    await t.stop(1.0)
    assert f"{OS_FORK}: the template has 2 threads after its warm" in _log(tmp_path)
