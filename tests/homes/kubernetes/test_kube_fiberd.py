"""fiberd with the Kubernetes home against the fake API server: the core's side of each fault.

fiberd runs in-process exactly as ``fiberd --home kubernetes`` wires it, over
real HTTPS to the fake server, with real templates and fibers; grants arrive
through a Secret volume written the way the kubelet writes it.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.fibers.handles import FiberView
from slurm_fiber.testing.kubernetes.fake import PODS, RESOURCE_CLAIMS, FakeApiServer, resource_claim
from slurm_fiber.testing.kubernetes.fake.secretvolume import atomic_write
from tests.core.processkit import aio, marked_procs
from tests.core.runtime.fiberdkit import Live, Site, running_fiberd, until, warm

AUDIENCE = "k8s:grants:grant-pod-1"
CONDITION = "slurm-fiber.io/template-warm"


@pytest.fixture
def environ(pod_env: dict[str, str], service_account: Path) -> dict[str, str]:
    return {**pod_env, "SLURM_FIBER_KUBE_SERVICE_ACCOUNT_DIR": str(service_account)}


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return Site(tmp_path, uuid.uuid4().hex)


def deliver(volume: Path, site: Site, uid: str = "g1") -> None:
    volume.mkdir(mode=0o755, exist_ok=True)
    token = site.token(uid, audience=AUDIENCE, devices=("gpu",))
    for _ in atomic_write(volume, {f"{uid}.jwt": token.encode()}):
        pass


def options(site: Site, volume: Path) -> dict[str, object]:
    return {"home": "kubernetes", "grantdir": str(volume), "audience": None,
            "poll_interval": "0.2", "stale_ttl": "1", "fence_ttl": "2"}


@contextlib.asynccontextmanager
async def warm_fiberd(site: Site, environ: dict[str, str],
                      tmp_path: Path) -> AsyncIterator[Live]:
    """fiberd with the Kubernetes home, its grant delivered through a Secret volume under
    ``tmp_path``, once the grant's template is warm."""
    volume = tmp_path / "secret"
    deliver(volume, site)
    async with running_fiberd(site, environ, **options(site, volume)) as live:
        await warm(live)
        yield live


def condition(fake: FakeApiServer) -> str | None:
    pod = fake.store.get(PODS, "grants", "grant-pod-1")
    found = [c["status"] for c in pod["status"].get("conditions", []) if c["type"] == CONDITION]
    return found[0] if found else None


@aio
async def test_a_secret_grant_warms_publishes_readiness_and_gets_the_claims_gpus(
        site: Site, fake: FakeApiServer, environ: dict[str, str], tmp_path: Path) -> None:
    async with warm_fiberd(site, environ, tmp_path) as live:
        await until(lambda: condition(fake) == "True")
        fiber = await live.clone(target="tests.core.runtime.targetkit:getenv",
                                 args=("CUDA_VISIBLE_DEVICES",))
        assert (await fiber.wait()).result == "0,1"
        assert live.core.status()["scope"]["kubernetes.pod"] == "grant-pod-1"
    assert condition(fake) == "False"
    assert not marked_procs(site.mark)


@aio
async def test_api_server_down_turns_misses_stale_then_fences_and_recovers(
        site: Site, fake: FakeApiServer, environ: dict[str, str], tmp_path: Path) -> None:
    async with warm_fiberd(site, environ, tmp_path) as live:
        unknown = await live.clone("nobody")
        assert isinstance(unknown, Miss) and unknown.code is MissCode.UNKNOWN_GRANT
        running = await live.clone(target="tests.core.runtime.targetkit:sleep", args=(60,))
        fake.stop()
        await until(lambda: live.core.health()["state"] == "stale")
        stale = await live.clone("nobody")
        assert isinstance(stale, Miss) and stale.code is MissCode.SOURCE_STALE
        end = await running.wait()  # the fence ends fence_ttl after the last sync
        assert end.signal is not None
        assert end.reason == {"code": "fence", "message": "fenced: the control plane was "
                              "silent for over 2 s, ended on SIGTERM"}
        fenced = await live.clone(argv=("true",))
        assert isinstance(fenced, Miss) and fenced.code is MissCode.FENCED
        fake.start()
        await until(lambda: live.core.health()["state"] == "fresh")
        again = await live.clone(argv=("true",))
        assert isinstance(again, FiberView) and (await again.wait()).status == 0
    released = [json.loads(line) for line in (site.state / "audit.jsonl").read_text().splitlines()
                if '"release"' in line]
    assert [r["cause"] for r in released] == ["fence"]


@aio
async def test_pod_deleted_stops_fibers_and_removes_the_grant(
        site: Site, fake: FakeApiServer, environ: dict[str, str], tmp_path: Path) -> None:
    async with warm_fiberd(site, environ, tmp_path) as live:
        fiber = await live.clone(target="tests.core.runtime.targetkit:sleep", args=(60,))
        fake.store.delete(PODS, "grants", "grant-pod-1")
        assert (await fiber.wait()).signal is not None
        await until(lambda: live.core.status()["grants"] == 0)
        miss = await live.clone(argv=("true",))
        assert isinstance(miss, Miss) and miss.code is MissCode.DENIED
    assert not marked_procs(site.mark)


@aio
async def test_claim_deallocated_bumps_the_epoch(
        site: Site, fake: FakeApiServer, environ: dict[str, str], tmp_path: Path,
        claim_name: str) -> None:
    async with warm_fiberd(site, environ, tmp_path) as live:
        fiber = await live.clone(target="tests.core.runtime.targetkit:sleep", args=(60,))
        uid = fake.store.get(RESOURCE_CLAIMS, "grants", claim_name)["metadata"]["uid"]
        fake.store.put(RESOURCE_CLAIMS, resource_claim(claim_name, "grants", uid=uid))
        assert (await fiber.wait()).signal is not None
        await until(lambda: live.core.status()["epoch"] == 1)
        after = await live.clone(argv=("true",))
        assert isinstance(after, FiberView) and after.fiber.epoch == 1


@aio
async def test_a_refused_token_stops_fibers_and_admits_no_clone(
        site: Site, fake: FakeApiServer, environ: dict[str, str], tmp_path: Path) -> None:
    async with warm_fiberd(site, environ, tmp_path) as live:
        fiber = await live.clone(target="tests.core.runtime.targetkit:sleep", args=(60,))
        del fake.tokens[fake.token]  # every round from here on is answered 401
        assert (await fiber.wait()).signal is not None
        await until(lambda: live.core.status()["grants"] == 0)
        miss = await live.clone(argv=("true",))
        assert isinstance(miss, Miss) and miss.code is MissCode.DENIED
    assert not marked_procs(site.mark)
