"""A job's own code stops or kills its template: Clones never hang and never get ``internal``.

A fiber runs the grant owner's code, and that code can SIGSTOP the template
it was forked from (its parent); the template can also die (OOM killer,
SIGKILL). Before issue 13 a stopped template hung every later Clone and
every fiber's exit report, ``status`` still said ready, and a Clone racing a
killed template got ``internal``. Each test runs the real fiberd (in
process, as the ``fiberd`` command wires it) with real templates and fibers,
and fails on that code. ``HANG`` only turns a hang into a failure; the bound
itself is checked on the injected clock in tests/core/templates/test_stalls.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Awaitable, Iterator
from typing import Any

from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.fibers.fiber import FiberState
from slurm_fiber.core.fibers.handles import FiberView
from tests.core.processkit import aio, marked_procs, proc_state, wait_dead
from tests.core.runtime.conftest import site
from tests.core.runtime.fiberdkit import Live, Site, running_fiberd, until, warm

__all__ = ["site"]  # the runtime tests' fixture: a standalone fiberd's issuer and dirs

STOPPER = "tests.core.templates.targetkit:stop_my_template"
ADD = "tests.core.templates.targetkit:add"
SLEEP = "tests.core.runtime.targetkit:sleep"
HANG = 30.0  # seconds after which a wait that should have ended counts as a hang


async def unless_hung(awaitable: Awaitable[Any]) -> Any:
    return await asyncio.wait_for(awaitable, HANG)


def template_pid(live: Live, uid: str = "g1") -> int:
    [grant] = [g for g in live.core.list_grants() if g["uid"] == uid]
    pid = grant["template"]["pid"]
    assert isinstance(pid, int)
    return pid


@contextlib.contextmanager
def resumed_after(pid: int) -> Iterator[None]:
    """SIGCONT ``pid`` on the way out, so a failing test still lets fiberd stop."""
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def audit_events(site: Site, event: str) -> list[dict[str, Any]]:
    lines = (site.state / "audit.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == event]


async def a_later_clone_runs(live: Live, old: int) -> None:
    """Once the template is re-warmed in a new process, a Clone runs in it."""
    await until(lambda: template_pid(live) != old)
    await warm(live)
    fiber = await unless_hung(live.clone(target=ADD, args=(2, 3)))
    assert isinstance(fiber, FiberView)
    assert (await unless_hung(fiber.wait())).result == 5


@aio
async def test_a_clone_waiting_on_a_template_its_fiber_stopped_gets_cold(site: Site) -> None:
    site.drop()
    async with running_fiberd(site, template_timeout="1", spares="0") as live:
        await warm(live)
        old = template_pid(live)
        with resumed_after(old):
            stopper = await live.clone(target=STOPPER)
            assert isinstance(stopper, FiberView)
            end = await unless_hung(stopper.wait())  # seen exiting although nothing reaps it
            assert end.exit_code == 0 and end.result == "stopped" and end.error is None
            assert proc_state(old) in ("T", "Z", "")

            miss = await unless_hung(live.clone(target=ADD, args=(1, 1)))
            assert isinstance(miss, Miss) and miss.code is MissCode.COLD and miss.retryable
            assert miss.retry_after is not None and miss.retry_after > 0
            assert live.core.status()["templates"]["g1"] != "ready"  # type: ignore[index]
            assert not live.core.ready()
            await until(lambda: proc_state(old) in ("Z", ""))  # killed, although stopped
            await a_later_clone_runs(live, old)
    [lost] = audit_events(site, "template_lost")
    assert lost["pid"] == old and "template_timeout 1 s" in lost["reason"]
    assert any(m["code"] == "cold" for m in audit_events(site, "miss"))
    assert not marked_procs(site.mark)


@aio
async def test_a_stopped_template_turns_not_ready_with_no_clone_asking(site: Site) -> None:
    site.drop()
    async with running_fiberd(site, template_timeout="1") as live:
        await warm(live)
        old = template_pid(live)
        with resumed_after(old):
            stopper = await live.clone(target=STOPPER)
            assert isinstance(stopper, FiberView)
            await until(lambda: live.core.status()["templates"]["g1"] != "ready")  # type: ignore[index]
            assert not live.core.ready()
            ready_file = site.state / "ready.json"
            await until(lambda: json.loads(ready_file.read_text())["warm"] == [])
            miss = await unless_hung(live.clone(target=ADD, args=(1, 1)))
            assert isinstance(miss, Miss) and miss.code is MissCode.COLD
            await a_later_clone_runs(live, old)
    assert not marked_procs(site.mark)


@aio
async def test_fibers_started_before_the_stall_have_their_exits_reported(site: Site) -> None:
    site.drop()
    async with running_fiberd(site, template_timeout="3") as live:
        await warm(live)
        old = template_pid(live)
        with resumed_after(old):
            sleeper = await live.clone(target=SLEEP, args=(60,))
            stopper = await live.clone(target=STOPPER)
            assert isinstance(sleeper, FiberView) and isinstance(stopper, FiberView)
            await until(lambda: proc_state(old) == "T")
            os.kill(sleeper.fiber.pid, signal.SIGTERM)  # ends while its template is stopped
            end = await unless_hung(sleeper.wait())
            assert end.signal == signal.SIGTERM
            assert sleeper.fiber.exit is not None
            assert sleeper.fiber.exit.state is FiberState.EXITED  # not lost
            end = await unless_hung(stopper.wait())
            assert end.exit_code == 0 and end.result == "stopped"
            await a_later_clone_runs(live, old)
    exits = {e["fiber"]: e["exit"] for e in audit_events(site, "fiber_exit")}
    assert exits[sleeper.fiber.id]["signal"] == signal.SIGTERM
    assert exits[sleeper.fiber.id]["state"] == "exited"
    assert exits[stopper.fiber.id]["exit_code"] == 0
    assert not marked_procs(site.mark)


@aio
async def test_clones_in_the_rewarm_window_after_a_sigkill_get_cold(site: Site) -> None:
    site.drop()
    async with running_fiberd(site) as live:
        await warm(live)
        ran = await unless_hung(live.clone(target=ADD, args=(1, 1)))  # cloned: spares kept
        assert isinstance(ran, FiberView) and (await ran.wait()).exit_code == 0
        old = template_pid(live)
        await until(lambda: len(marked_procs(site.mark)) == 3)  # the template, its 2 spares
        spawned = marked_procs(site.mark)
        os.kill(old, signal.SIGKILL)
        # Blocking, so fiberd has not heard of it yet: the Clone races the death.
        assert all(wait_dead(pid) for pid in spawned)
        # Clone until one starts: the template is warm again by then. (Polling the status
        # between Clones raced: a Clone is a task of its own, and the template could turn
        # warm between the status read and the Clone's decision.)
        misses = []
        while not isinstance(outcome := await unless_hung(live.clone(target=ADD, args=(1, 1))),
                             FiberView):
            misses.append(outcome)
            await asyncio.sleep(0.05)
        assert live.core.status()["templates"]["g1"] == "ready"  # type: ignore[index]
        assert (await outcome.wait()).exit_code == 0
        assert misses, "a Clone racing the template's death started a fiber"
        assert all(isinstance(m, Miss) and m.code is MissCode.COLD and m.retry_after
                   for m in misses), misses
        await a_later_clone_runs(live, old)
    [lost] = audit_events(site, "template_lost")
    assert lost["pid"] == old
    assert not marked_procs(site.mark)
