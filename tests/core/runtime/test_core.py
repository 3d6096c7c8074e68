"""The core runtime with real templates and fibers, fed by a real standalone home's grantdir.

Each test runs fiberd in-process (as the ``fiberd`` command wires it) and
checks what the runtime does with the book's decisions: warm before the
first Clone, removal and redelivery, epoch bumps and scope loss that return
once fibers are gone, leases that stop fibers, inline tokens, capacity,
shutdown and restart, and the audit trail of each.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from slurm_fiber.client.connection import FiberdClient
from slurm_fiber.config import FiberdConfig
from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.fibers.handles import FiberView
from slurm_fiber.daemon import FiberdRefused, shutdown, started
from slurm_fiber.homes.problem import ProblemSink
from slurm_fiber.homes.select import BuiltHome, build_home
from slurm_fiber.safefs import UnsafePath
from tests.core.processkit import aio, marked_procs
from tests.core.runtime.fiberdkit import Live, Site, running_fiberd, until, warm


def audit_events(site: Site) -> list[dict[str, object]]:
    lines = (site.state / "audit.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@aio
async def test_delivered_grant_is_warm_before_the_first_clone_and_runs_in_it(site: Site) -> None:
    site.drop(preload=("decimal",))
    async with running_fiberd(site) as live:
        await warm(live)
        ready_file = site.state / "ready.json"
        await until(lambda: ready_file.exists() and json.loads(ready_file.read_text())["ready"])
        assert json.loads(ready_file.read_text())["warm"] == ["g1"]
        fiber = await live.clone(target="tests.core.runtime.targetkit:imported", args=("decimal",))
        assert isinstance(fiber, FiberView)
        end = await fiber.wait()
        assert end.result is True and end.exit_code == 0
        shell = await live.clone(argv=("sh", "-c", "exit 7"))
        assert (await shell.wait()).status == 7
    events = [e["event"] for e in audit_events(site)]
    assert events[:2] == ["start", "admit"] and events[-1] == "stop"
    assert events.count("clone") == 2 and events.count("fiber_exit") == 2
    assert not marked_procs(site.mark)


async def ended_true(live: Live) -> FiberView:
    """A fiber of `true` run to its end, once g1 is warm."""
    await warm(live)
    fiber = await live.clone(argv=("true",))
    assert isinstance(fiber, FiberView)
    await fiber.wait()
    return fiber


@aio
async def test_a_fiber_exit_shares_the_next_clones_fsync(site: Site, monkeypatch) -> None:
    """Under audit_fsync = always, a fiber_exit record (an observation, not a decision) is in
    the log before its exit is seen, and made durable by the next Clone's fsync: a busy
    fiberd fsyncs once per task, not twice."""
    monkeypatch.setattr("slurm_fiber.core.runtime.trail.EXIT_SYNC_DELAY", 3600.0)
    site.drop()
    async with running_fiberd(site, audit_fsync="always") as live:
        first = await ended_true(live)
        last = audit_events(site)[-1]
        assert (last["event"], last["fiber"]) == ("fiber_exit", first.id)
        assert live.core.audit.unsynced
        second = await live.clone(argv=("sleep", "0.3"))  # running still as it is answered
        assert isinstance(second, FiberView) and not live.core.audit.unsynced
        await second.wait()


@aio
async def test_a_fiber_exit_no_decision_follows_is_made_durable_soon(site: Site,
                                                                     monkeypatch) -> None:
    monkeypatch.setattr("slurm_fiber.core.runtime.trail.EXIT_SYNC_DELAY", 0.05)
    site.drop()
    async with running_fiberd(site, audit_fsync="always") as live:
        await ended_true(live)
        await until(lambda: not live.core.audit.unsynced)
        assert audit_events(site)[-1]["event"] == "fiber_exit"


@aio
async def test_a_grant_never_cloned_holds_its_template_alone(site: Site) -> None:
    """Idle grants do not multiply idle processes: a template forks its spares ahead only
    once its grant has been cloned, and keeps them (two by default) from then on."""

    def spares() -> object:
        [grant] = live.core.list_grants()
        return grant["template"]["spares"]  # type: ignore[index]

    site.drop()
    async with running_fiberd(site) as live:
        await warm(live)
        assert spares() == 0 and len(marked_procs(site.mark)) == 1  # the template
        fiber = await live.clone(target="tests.core.runtime.targetkit:imported", args=("os",))
        assert (await fiber.wait()).exit_code == 0
        await until(lambda: spares() == 2)
    assert not marked_procs(site.mark)


@aio
async def test_a_grant_not_cloned_for_spares_idle_is_back_to_its_template_alone(
        site: Site) -> None:
    """The upkeep dismisses the spares of a grant not cloned for ``spares_idle`` seconds;
    its next Clone forks on the spot and brings them back."""

    def spares() -> object:
        [grant] = live.core.list_grants()
        return grant["template"]["spares"]  # type: ignore[index]

    site.drop()
    async with running_fiberd(site, spares_idle=1.0) as live:
        await warm(live)
        for _ in range(2):
            fiber = await live.clone(target="tests.core.runtime.targetkit:sleep", args=(0,))
            assert (await fiber.wait()).exit_code == 0
            await until(lambda: spares() == 2)
            await until(lambda: spares() == 0 and len(marked_procs(site.mark)) == 1)
    assert not marked_procs(site.mark)


@aio
async def test_removal_stops_fibers_denies_and_redelivery_lifts(site: Site) -> None:
    token = site.drop()
    async with running_fiberd(site) as live:
        await warm(live)
        sleeper = await live.clone(target="tests.core.runtime.targetkit:sleep", args=(60,))
        site.remove()
        end = await sleeper.wait()
        assert end.signal is not None
        miss = await live.clone()
        assert isinstance(miss, Miss) and miss.code is MissCode.DENIED
        assert miss.until is not None
        inline = await live.clone(token=token)  # a token inside a Clone never lifts a denial
        assert isinstance(inline, Miss) and inline.code is MissCode.DENIED
        site.drop(token=token)  # the home delivers it again: lifted
        await warm(live)
        again = await live.clone(target="tests.core.runtime.targetkit:getenv",
                                 args=("SF_TEST_MARK",))
        assert (await again.wait()).result == site.mark
    events = [e["event"] for e in audit_events(site)]
    assert "remove" in events and "lift" in events and "release" in events
    assert not marked_procs(site.mark)


@aio
async def test_epoch_bump_returns_once_older_fibers_are_gone(site: Site) -> None:
    site.drop()
    async with running_fiberd(site) as live:
        await warm(live)
        old = [await live.clone(target="tests.core.runtime.targetkit:stubborn", args=(60,))
               for _ in range(3)]
        epoch = await live.core.bump_epoch("test: fences revoked")
        assert epoch == 1
        assert all(not f.fiber.running for f in old)
        new = await live.clone(target="tests.core.runtime.targetkit:sleep", args=(0,))
        assert new.fiber.epoch == 1 and (await new.wait()).result == "slept"
    bumps = [e for e in audit_events(site) if e["event"] == "epoch_bump"]
    assert bumps == [{**bumps[0], "epoch": 1, "reason": "test: fences revoked"}]


@aio
async def test_scope_loss_that_removes_grants_stops_everything(site: Site) -> None:
    site.drop()
    async with running_fiberd(site) as live:
        await warm(live)
        fiber = await live.clone(target="tests.core.runtime.targetkit:sleep", args=(60,))
        await live.core.lose_scope("job 7 left RUNNING: CANCELLED", removes_grants=True)
        assert not fiber.fiber.running
        miss = await live.clone()
        assert isinstance(miss, Miss) and miss.code is MissCode.DENIED
        assert live.core.status()["templates"] == {}
    events = [e["event"] for e in audit_events(site)]
    assert events.index("scope_loss") < events.index("epoch_bump") < events.index("remove")


@aio
async def test_a_fiber_that_ignores_sigterm_is_killed_at_lease_end(site: Site) -> None:
    site.drop(ttl=3)
    async with running_fiberd(site) as live:
        await warm(live)
        fiber = await live.clone(target="tests.core.runtime.targetkit:stubborn", args=(60,))
        deadline = fiber.to_json()["deadline_wall"]
        end = await fiber.wait()
        overshoot = time.time() - float(deadline)  # type: ignore[arg-type]
        assert end.signal == 9 and overshoot < 1.0, overshoot
        await until(lambda: live.core.status()["templates"] == {})  # cooled at expiry
        miss = await live.clone()
        assert isinstance(miss, Miss) and miss.code is MissCode.EXPIRED
    events = [e for e in audit_events(site) if e["event"] in ("release", "expire")]
    assert [e["event"] for e in events] == ["release", "expire"]
    assert events[0]["cause"] == "lease"


@aio
async def test_inline_tokens_warm_then_start_and_bad_ones_miss(site: Site) -> None:
    async with running_fiberd(site) as live:
        fresh = site.token("inline-1")
        first = await live.clone(token=fresh)
        assert isinstance(first, Miss) and first.code is MissCode.COLD and first.retryable
        await warm(live, "inline-1")
        started = await live.clone(token=fresh, target="tests.core.runtime.targetkit:sleep",
                                   args=(0,))
        assert isinstance(started, FiberView) and started.fiber.uid == "inline-1"
        await started.wait()
        other = await live.clone(token=site.token("x", audience="another-job"))
        assert isinstance(other, Miss) and other.code is MissCode.INVALID_TOKEN
        assert other.detail == "wrong_audience"
        junk = await live.clone(token="not.a.token")
        assert isinstance(junk, Miss) and junk.code is MissCode.INVALID_TOKEN
    refusals = [e for e in audit_events(site) if e["event"] == "refuse"]
    assert len(refusals) == 2


@aio
async def test_capacity_and_unnamed_grants(site: Site) -> None:
    site.drop("g1", fibers=1)
    async with running_fiberd(site) as live:
        await warm(live)
        only = await live.clone(None, target="tests.core.runtime.targetkit:sleep", args=(30,))
        assert isinstance(only, FiberView)  # the one grant held is the default
        full = await live.clone(target="tests.core.runtime.targetkit:sleep", args=(0,))
        assert isinstance(full, Miss) and full.code is MissCode.CAPACITY
        site.drop("g2")
        await warm(live, "g2")
        ambiguous = await live.clone(None, argv=("true",))
        assert isinstance(ambiguous, Miss) and ambiguous.code is MissCode.UNKNOWN_GRANT
        assert "name one" in ambiguous.reason
    assert not marked_procs(site.mark)


@pytest.mark.machine_may_lack("a writable cgroup2 hierarchy")
@aio
async def test_shutdown_refuses_clones_and_leaves_nothing(site: Site, cgroup_root: Path) -> None:
    site.drop()
    async with running_fiberd(site, cgroup_root=str(cgroup_root)) as live:
        await warm(live)
        fibers = [await live.clone(argv=("sh", "-c", "sleep 60 & sleep 60; wait"))
                  for _ in range(3)]
        assert live.core.status()["mode"] == "carved"
        assert all(f.fiber.cgroup is not None for f in fibers)
        await live.core.shutdown()  # what fiberd's shutdown does first
        assert not marked_procs(site.mark)
        miss = await live.clone()
        assert isinstance(miss, Miss) and miss.code is MissCode.CLOSED
    assert not marked_procs(site.mark)
    assert [p for p in cgroup_root.iterdir() if p.is_dir()] == []
    assert not (site.state / "fiberd.sock").exists()


@aio
async def test_a_restart_remembers_denials_and_the_epoch(site: Site) -> None:
    token = site.drop()
    async with running_fiberd(site) as live:
        await warm(live)
        await live.core.bump_epoch("test")
        site.remove()
        await until(lambda: live.core.status()["grants"] == 0)
    async with running_fiberd(site) as live:
        assert live.core.status()["epoch"] == 1
        miss = await live.clone(token=token)
        assert isinstance(miss, Miss) and miss.code is MissCode.DENIED


@aio
async def test_a_start_whose_announcement_fails_frees_the_socket_for_the_next(
        site: Site) -> None:
    """A home that cannot leave its record (the Slurm home refusing a state dir fiberd does
    not trust) makes the start a one-line refusal, and shuts the half-started fiberd down."""
    async def refusing_announce(config: FiberdConfig, clock: Clock,
                                environ: Mapping[str, str], sink: ProblemSink) -> BuiltHome:
        built = await build_home(config, clock, environ, sink)

        def announce(sock: Path) -> None:
            raise UnsafePath(f"{site.state} is owned by uid 995, not by a trusted owner")

        return built.replaced(announce=announce)

    with pytest.raises(FiberdRefused, match=r"cannot announce fiberd: .* is owned by uid 995"):
        async with started(site.config(), {}, build=refusing_announce):
            pytest.fail("started despite the failed announcement")
    assert not (site.state / "fiberd.sock").exists()
    assert [e["event"] for e in audit_events(site)][-2:] == ["start", "stop"]
    site.drop()
    async with running_fiberd(site) as live:  # the same socket: not "in use"
        await warm(live)


@aio
async def test_no_request_is_answered_before_the_start_record(site: Site) -> None:
    """The socket listens from the start, but fiberd answers it only once the audit log
    holds its start record: a client that sees this fiberd answer finds its start."""
    gate, entered = asyncio.Event(), asyncio.Event()

    async def gated_readiness(config: FiberdConfig, clock: Clock,
                              environ: Mapping[str, str], sink: ProblemSink) -> BuiltHome:
        built = await build_home(config, clock, environ, sink)
        publish = built.home.publish_ready

        async def publish_ready(uid: str, ready: bool) -> None:
            entered.set()
            await gate.wait()  # start-up waits here, the socket already listening
            await publish(uid, ready)

        built.home.publish_ready = publish_ready  # type: ignore[method-assign]
        return built

    def status_then_audit() -> list[object]:
        with FiberdClient(site.state / "fiberd.sock", timeout=30) as client:
            client.request("status")
        return [e["event"] for e in audit_events(site)]

    async def ask_while_gated() -> list[object]:
        await entered.wait()
        asyncio.get_running_loop().call_later(0.3, gate.set)  # room for a wrong early answer
        return await asyncio.to_thread(status_then_audit)

    asking = asyncio.ensure_future(ask_while_gated())
    async with started(site.config(), {}, build=gated_readiness) as fiberd:
        assert "start" in await asking
        await shutdown(fiberd.running, [], "test over")
