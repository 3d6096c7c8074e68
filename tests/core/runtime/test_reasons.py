"""Every fiber exit fiberd caused says why (issue 20): a real fiberd, real fibers.

Each cause a running fiberd has (limits.seconds, the lease's end, the grant's removal,
an epoch bump, a stop request, shutdown) ends a fiber whose exit event and record carry
``reason`` {"code", "message"}, the message one line a person can act on.
"""

from __future__ import annotations

from slurm_fiber.core.fibers.handles import FiberView
from tests.core.processkit import aio, marked_procs
from tests.core.runtime.fiberdkit import PEER, Live, Site, running_fiberd, until, warm
from tests.core.runtime.targetkit import STUBBORN_NOW

STUBBORN = "tests.core.runtime.targetkit:stubborn"  # ignores SIGTERM: only SIGKILL ends it


async def started(live: Live, target: str = STUBBORN) -> FiberView:
    """A fiber of ``target`` running; a stubborn one once it ignores SIGTERM (a stop that
    came sooner would end it on SIGTERM, not after the grace)."""
    fiber = await live.clone(target=target, args=(60,))
    assert isinstance(fiber, FiberView), fiber
    out = fiber.fiber.stdout_path
    if target == STUBBORN:
        assert out is not None
        await until(lambda: out.exists() and STUBBORN_NOW in out.read_text())
    return fiber


async def reason_of(fiber: FiberView) -> dict[str, object]:
    end = (await fiber.wait()).to_json()
    reason = end["reason"]
    assert isinstance(reason, dict), end
    return reason


@aio
async def test_limits_seconds_is_a_deadline_killed_after_the_grace(site: Site) -> None:
    site.drop(seconds=1)
    async with running_fiberd(site) as live:
        await warm(live)
        fiber = await started(live)
        assert await reason_of(fiber) == {
            "code": "deadline",
            "message": "deadline 1 s (limits.seconds) reached, killed after 0.3 s grace"}
        assert fiber.to_json()["exit"]["reason"]["code"] == "deadline"  # type: ignore[index]
    assert not marked_procs(site.mark)


@aio
async def test_the_leases_end(site: Site) -> None:
    site.drop(ttl=3)
    async with running_fiberd(site) as live:
        await warm(live)
        reason = await reason_of(await started(live))
        assert reason["code"] == "lease_end"
        assert reason["message"] == ("the lease of grant 'g1' ended (no renewed token was "
                                     "delivered), killed after 0.3 s grace")


@aio
async def test_removal_epoch_bump_stop_request_and_shutdown(site: Site) -> None:
    site.drop()
    async with running_fiberd(site) as live:
        await warm(live)
        fiber = await started(live)
        await live.core.bump_epoch("test: fences revoked")
        assert await reason_of(fiber) == {
            "code": "epoch",
            "message": "epoch 0 was revoked (test: fences revoked), killed after 0.3 s grace"}

        polite = await started(live, "tests.core.runtime.targetkit:sleep")
        record = await live.core.stop_fiber(polite.id, 5.0, PEER)
        assert record["exit"]["reason"] == {  # type: ignore[index]
            "code": "stopped",
            "message": f"stopped on request (uid {PEER.uid}, pid {PEER.pid}), ended on SIGTERM"}

        fiber = await started(live)
        site.remove()
        assert await reason_of(fiber) == {
            "code": "removed", "message": "grant 'g1' was removed, killed after 0.3 s grace"}

        site.drop(token=site.token())
        await warm(live)
        last = await started(live)
        live.stop.set()  # fiberd shuts down with the fiber running
        reason = await reason_of(last)
        assert reason["code"] == "fiberd_shutdown"
        assert reason["message"].startswith("fiberd is shutting down")  # type: ignore[union-attr]
    assert not marked_procs(site.mark)
