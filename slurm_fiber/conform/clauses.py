"""The contract clauses grant-conform checks, one async function each (DESIGN §8).

Each clause starts its own fiberd (so one failure cannot spill into the
next), pulls the stage's levers, and checks what the real core and the
home's control plane then show. A clause fails by raising ``ClauseFailed``
with one line; it names the capabilities it needs, and the runner skips it
(declared) on a stage that lacks one. Grant UIDs are unique per run and per
clause, so clauses never see each other's grants, even in a stage whose
state outlives fiberd (denials are persisted).

Waits are bounded (see ``context``); only the expiry clause waits for real
time to pass, for tokens of a few seconds. Nothing sleeps a fixed time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from slurm_fiber.conform.context import Context, expect_miss, holds, stopped_by_signal
from slurm_fiber.conform.issuer import TARGETS
from slurm_fiber.conform.live import POLL, ClauseFailed, Live, until
from slurm_fiber.conform.stage import Capability
from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.devices import ALL_VISIBILITY_VARS, DeviceChannel
from slurm_fiber.core.fibers.handles import FiberView
from slurm_fiber.core.trust.tokens import decode_unverified

LONG_SLEEP = 300.0  # a fiber that only ends when fiberd stops it
SHORT_TTL = 3.0  # seconds: the first of two short-lived tokens
RENEWAL_TTL = 4.0  # the renewal that outlives it
EXPIRY_SLACK = 1.0  # exp is whole seconds; a denial may end up to this much early

ClauseRun = Callable[[Context], Awaitable[None]]


@dataclass(frozen=True)
class Clause:
    """One sentence of the contract: its name, what it checks, and the levers it needs."""

    name: str
    summary: str
    run: ClauseRun
    needs: frozenset[Capability] = frozenset()


async def preadmission_warms(ctx: Context) -> None:
    async with ctx.fiberd() as live:
        uid = ctx.uid()
        await ctx.grant(live, uid)
        await ctx.warm(live, uid)
        await until(lambda: ctx.stage.readiness().current is True, ctx.settle,
                    "readiness published to the control plane before any Clone")
        if not await live.call(uid, f"{TARGETS}:warmed"):
            raise ClauseFailed("the first Clone's fiber was not forked from a warmed template")


async def sleeping_fiber(ctx: Context, live: Live) -> tuple[str, FiberView]:
    """A new grant delivered and warm, with one long-sleeping fiber running under it."""
    uid = ctx.uid()
    await ctx.grant(live, uid)
    await ctx.warm(live, uid)
    fiber = await live.clone(uid, f"{TARGETS}:sleep", LONG_SLEEP)
    if isinstance(fiber, Miss):
        raise ClauseFailed(f"Clone of a warm grant missed: {fiber.code}: {fiber.reason}")
    return uid, fiber


async def removal_releases(ctx: Context) -> None:
    async with ctx.fiberd() as live:
        uid, fiber = await sleeping_fiber(ctx, live)
        await ctx.stage.remove(uid)
        await ctx.removed(live, uid)
        await stopped_by_signal(ctx, fiber, "its grant was removed")
        await ctx.processes_gone("the grant's removal")


async def removal_denies_until_expiry(ctx: Context) -> None:
    async with ctx.fiberd() as live:
        uid = ctx.uid()
        await ctx.grant(live, uid, ttl=SHORT_TTL)
        await ctx.warm(live, uid)
        renewal = await ctx.grant(live, uid, ttl=RENEWAL_TTL)
        await until(lambda: len(_jtis(live, uid)) == 2, ctx.settle,
                    "renewal admitted next to the first token")
        last_exp = float(decode_unverified(renewal).claims["exp"])
        await ctx.stage.remove(uid)
        await ctx.removed(live, uid)
        miss = expect_miss(await live.clone(uid, f"{TARGETS}:warmed"), MissCode.DENIED,
                           "Clone of a removed grant")
        if miss.until is None or abs(miss.until - last_exp) > EXPIRY_SLACK:
            raise ClauseFailed(f"denial ends at {miss.until}, not when the last token "
                               f"expires ({last_exp:.0f})")
        expect_miss(await live.clone(None, f"{TARGETS}:warmed", token=renewal),
                    MissCode.DENIED, "Clone carrying the removed grant's token")
        outcome, lifted_at = await _first_not_denied(live, uid, last_exp + ctx.settle)
        if lifted_at < last_exp - EXPIRY_SLACK:
            raise ClauseFailed(f"denial lifted {last_exp - lifted_at:.1f} s before the last "
                               "token expired")
        if not isinstance(outcome, Miss) or outcome.code not in (MissCode.UNKNOWN_GRANT,
                                                                 MissCode.SOURCE_STALE):
            seen = f"{outcome.code}" if isinstance(outcome, Miss) else "a fiber"
            raise ClauseFailed(f"after expiry a Clone of the removed UID gave {seen}, "
                               "not unknown_grant or source_stale")


def _jtis(live: Live, uid: str) -> list[object]:
    jtis = (live.held(uid) or {}).get("jtis")
    return list(jtis) if isinstance(jtis, list) else []


async def _first_not_denied(live: Live, uid: str, deadline: float) -> tuple[FiberView | Miss,
                                                                            float]:
    """Clone ``uid`` until it is not denied; that outcome and when (wall time) it came."""
    while True:
        outcome = await live.clone(uid, f"{TARGETS}:warmed")
        now = time.time()
        if not (isinstance(outcome, Miss) and outcome.code is MissCode.DENIED):
            return outcome, now
        if now > deadline:
            raise ClauseFailed("still denied long after every token of the removed grant "
                               "expired")
        await asyncio.sleep(POLL)


async def redelivery_lifts(ctx: Context) -> None:
    async with ctx.fiberd() as live:
        uid = ctx.uid()
        token = await ctx.grant(live, uid)
        await ctx.warm(live, uid)
        await ctx.stage.remove(uid)
        await ctx.removed(live, uid)
        expect_miss(await live.clone(uid, f"{TARGETS}:warmed"), MissCode.DENIED,
                    "Clone of a removed grant")
        await ctx.stage.deliver(uid, token)
        await ctx.warm(live, uid)
        if not await live.call(uid, f"{TARGETS}:warmed"):
            raise ClauseFailed("the redelivered grant's fiber was not forked warm")


async def unknown_grant_while_fresh(ctx: Context) -> None:
    async with ctx.fiberd() as live:
        await ctx.settled_health(live, fresh=True)
        expect_miss(await live.clone(ctx.uid(), f"{TARGETS}:warmed"), MissCode.UNKNOWN_GRANT,
                    "Clone of an unknown UID while the source is fresh")


async def _unknown_once_restored(ctx: Context, live: Live, uid: str) -> None:
    """Restore the control plane; once fresh, an unknown UID misses unknown_grant again."""
    await ctx.stage.restore()
    await ctx.settled_health(live, fresh=True)
    expect_miss(await live.clone(uid, f"{TARGETS}:warmed"), MissCode.UNKNOWN_GRANT,
                "Clone of an unknown UID once the control plane answers")


async def source_stale_while_silent(ctx: Context) -> None:
    try:
        async with ctx.fiberd() as live:
            uid = ctx.uid()
            await ctx.settled_health(live, fresh=True)
            await ctx.stage.silence()
            await ctx.settled_health(live, fresh=False)
            expect_miss(await live.clone(uid, f"{TARGETS}:warmed"), MissCode.SOURCE_STALE,
                        "Clone of an unknown UID while the control plane is silent")
            await _unknown_once_restored(ctx, live, uid)
    finally:
        await ctx.stage.restore()


async def source_stale_before_first_sync(ctx: Context) -> None:
    await ctx.stage.silence()
    try:
        async with ctx.fiberd() as live:
            uid = ctx.uid()
            # A home polls more often than its stale TTL: one that marks a silent
            # control plane as synced does so within it.
            await holds(lambda: live.core.health()["state"] == "never", ctx.stale_ttl,
                        "source health stays never while the control plane has never answered")
            expect_miss(await live.clone(uid, f"{TARGETS}:warmed"), MissCode.SOURCE_STALE,
                        "Clone of an unknown UID before the control plane ever answered")
            await _unknown_once_restored(ctx, live, uid)
    finally:
        await ctx.stage.restore()


def _flips(history: tuple[bool, ...]) -> list[bool]:
    """The states a history passed through, repeats (republishes) folded."""
    return [state for i, state in enumerate(history) if i == 0 or history[i - 1] != state]


async def readiness_flips_once(ctx: Context) -> None:
    stage = ctx.stage
    start = len(stage.readiness().history)
    async with ctx.fiberd() as live:
        first, second = ctx.uid(), ctx.uid()
        await ctx.grant(live, first)
        await ctx.warm(live, first)
        await until(lambda: stage.readiness().current is True, ctx.settle,
                    "readiness published once the first template is warm")
        await ctx.grant(live, second)
        await ctx.warm(live, second)
        await stage.remove(first)
        await ctx.removed(live, first)
        await until(lambda: live.template_state(first) is None, ctx.settle,
                    "template of the removed grant stopped")
        if stage.readiness().current is not True:
            raise ClauseFailed("readiness went down while another grant was still warm")
        await stage.remove(second)
        await ctx.removed(live, second)
        await until(lambda: stage.readiness().current is False, ctx.settle,
                    "readiness withdrawn once no template is warm")
    seen = stage.readiness()  # fiberd has stopped: nothing more can be published
    # fiberd publishes "not ready" at start (over a dead predecessor's readiness): not a
    # flip when the plane already read not ready (before any publish, it reads none).
    before = seen.history[start - 1] if start else False
    flips = _flips((before, *seen.history[start:]))[1:]
    if flips != [True, False]:
        raise ClauseFailed(f"the control plane saw readiness {flips} for one rise and one "
                           "fall (expected [True, False])")
    if seen.current is not False:
        raise ClauseFailed(f"after the last grant went, readiness reads {seen.current}")


async def devices_provisioned(ctx: Context) -> None:
    devices = ctx.stage.devices()
    kinds = tuple(sorted({d.kind for d in devices}))
    channel = DeviceChannel.of(devices)
    async with ctx.fiberd() as live:
        granted, bare = ctx.uid(), ctx.uid()
        await ctx.grant(live, granted, devices=kinds)
        await ctx.grant(live, bare)
        for uid, want in ((granted, channel), (bare, DeviceChannel())):
            await ctx.warm(live, uid)
            shown = (live.held(uid) or {}).get("devices")
            if shown != want.to_json():
                raise ClauseFailed(f"grant {uid} naming {list(kinds) if want.devices else []} "
                                   f"holds devices {shown}, expected {want.to_json()}")
            env = await live.call(uid, f"{TARGETS}:environment", list(ALL_VISIBILITY_VARS))
            if env != want.env():
                raise ClauseFailed(f"fiber of {uid} sees {env}, expected exactly {want.env()}")


async def devices_released(ctx: Context) -> None:
    stage = ctx.stage
    devices = frozenset(stage.devices())
    async with ctx.fiberd() as live:
        uid = ctx.uid()
        await ctx.grant(live, uid, devices=tuple(sorted({d.kind for d in devices})))
        await ctx.warm(live, uid)
        if not devices <= stage.held_devices():
            raise ClauseFailed(f"devices of a warm grant not held: {sorted(map(str, devices))}")
        await stage.remove(uid)
        await ctx.removed(live, uid)
        await until(lambda: not devices & stage.held_devices(), ctx.settle,
                    "devices of the removed grant released")


async def scope_loss(ctx: Context) -> None:
    async with ctx.fiberd() as live:
        uid, fiber = await sleeping_fiber(ctx, live)
        epoch = live.core.status()["epoch"]
        assert isinstance(epoch, int)
        await ctx.stage.lose_scope()

        def acted() -> bool:
            return live.core.status()["epoch"] != epoch or live.held(uid) is None

        await until(acted, ctx.settle, "scope loss bumping the epoch or removing the grant")
        await stopped_by_signal(ctx, fiber, "scope was lost")
        if live.held(uid) is None:
            return  # the grants were removed: nothing of the old scope can start
        after = await live.clone(uid, f"{TARGETS}:sleep", 0)
        if isinstance(after, Miss):
            raise ClauseFailed(f"the grant was kept after scope loss, yet a Clone missed with "
                               f"{after.code}: {after.reason}")
        await after.wait()
        if after.fiber.epoch <= epoch:
            raise ClauseFailed("a fiber started after scope loss runs under the old epoch")


CLAUSES: tuple[Clause, ...] = (
    Clause("preadmission.warms", "a delivered grant is warm (and published) before the "
           "first Clone, which forks from the warmed template", preadmission_warms),
    Clause("removal.releases", "removing a grant stops its running fibers and its "
           "template", removal_releases),
    Clause("removal.denies", "a removed UID is denied (even with a token in the Clone) "
           "until its last token expires, then unknown", removal_denies_until_expiry),
    Clause("redelivery.lifts", "delivering a removed grant again lifts the denial",
           redelivery_lifts),
    Clause("misses.fresh", "an unknown UID misses unknown_grant while the source is "
           "fresh", unknown_grant_while_fresh),
    Clause("misses.stale", "an unknown UID misses source_stale while the control plane "
           "is silent, unknown_grant once it answers", source_stale_while_silent,
           frozenset({Capability.CONTROL_PLANE})),
    Clause("misses.never", "an unknown UID misses source_stale before the control plane "
           "first answered", source_stale_before_first_sync,
           frozenset({Capability.CONTROL_PLANE})),
    Clause("readiness.flips", "the control plane sees readiness flip once per change: "
           "up with the first warm template, down with the last", readiness_flips_once),
    Clause("devices.provisioned", "a fiber's environment shows exactly its grant's "
           "devices", devices_provisioned, frozenset({Capability.DEVICES})),
    Clause("devices.released", "a removed grant's devices are released",
           devices_released, frozenset({Capability.DEVICES, Capability.DEVICE_HOLDS})),
    Clause("scope.loss", "losing scope bumps the epoch or removes the grant, stopping "
           "its fibers", scope_loss, frozenset({Capability.SCOPE})),
)
