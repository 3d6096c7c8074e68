"""Issue 16's replaced-Pod sequence, on the fake and on a real kube-apiserver (when built).

fiberd runs in a grant Pod with a token bound to the Pod, talking to its API
server through a loopback relay (``Cutoff``). The relay is cut (the node is
partitioned), the Pod is force-deleted and recreated under its name while
fiberd cannot see it, and the cut lasts longer than the API server's 10 s
token cache, so fiberd's first answer after the partition is a 401: it
never sees the new UID. While cut off, Clones still start (the fence holds:
fence_ttl 60 s, as in the issue's run). After the first 401 the home must
fail closed: within a few poll intervals the grant is removed and no Clone
starts. The real lane is skipped, with the reason, when no kube-apiserver
was built on this machine (``deploy/kubernetes/real-apiserver/build``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.fibers.handles import FiberView
from slurm_fiber.homes.kubernetes.incluster import (
    ENV_NODE_NAME,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
    ENV_POD_UID,
    ENV_SERVER,
    ENV_SERVICE_ACCOUNT,
    ENV_SERVICE_ACCOUNT_DIR,
)
from slurm_fiber.testing.kubernetes.fake import PODS, FakeApiServer, grant_pod
from slurm_fiber.testing.kubernetes.fake.secretvolume import atomic_write
from slurm_fiber.testing.kubernetes.fake.server import TOKEN_CACHE_TTL
from tests.core.processkit import aio, marked_procs
from tests.core.runtime.fiberdkit import Site, running_fiberd, until, warm
from tests.homes.kubernetes.cutoffkit import Cutoff
from tests.homes.kubernetes.lanekit import Lane, real_lane

NAMESPACE = "grants"
POD = "grant-pod-1"
AUDIENCE = f"k8s:{NAMESPACE}:{POD}"
INTERVAL = 0.05
FEW = 4  # poll intervals after the first 401 from which no Clone may start


class FakeLane:
    """The fake API server on the system clock, as the Lane the test drives."""

    name = "fake"

    def __init__(self) -> None:
        self.fake = FakeApiServer().start()
        self.port = self.fake.port
        self.ca_pem = self.fake.ca_pem
        self.fake.store.put(PODS, grant_pod(POD, NAMESPACE, uid=str(uuid.uuid4()),
                                            service_account="slurm-fiber"))

    def pod_uid(self) -> str:
        return str(self.fake.store.get(PODS, NAMESPACE, POD)["metadata"]["uid"])

    def bound_token(self) -> str:
        return self.fake.bound_token(NAMESPACE, POD)

    def replace_pod(self) -> None:
        self.fake.store.remove(PODS, NAMESPACE, POD)
        self.fake.store.put(PODS, grant_pod(POD, NAMESPACE, uid=str(uuid.uuid4()),
                                            service_account="slurm-fiber"))

    def close(self) -> None:
        self.fake.close()


@pytest.fixture(params=["fake", "real"])
def lane(request: pytest.FixtureRequest) -> Iterator[Lane]:
    made: Lane = FakeLane() if request.param == "fake" else real_lane(POD)
    try:
        yield made
    finally:
        made.close()


# The status as ApiFailure words it ("read pod ...: 401 Unauthorized: ..."), not any "401":
# a round that cannot reach the relay names its port, and 127.0.0.1:44013 has one too.
STATUS_401 = re.compile(r": 401\b")


class First401(logging.Handler):
    """Notes when the home first logs a round refused with 401 (time.monotonic)."""

    def __init__(self) -> None:
        super().__init__()
        self.at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.at is None and STATUS_401.search(record.getMessage()):
            self.at = time.monotonic()


@pytest.fixture
def first_401() -> Iterator[First401]:
    handler = First401()
    logger = logging.getLogger("slurm_fiber.homes.kubernetes")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


async def cloning(live: object, every: float) -> AsyncIterator[tuple[float, bool]]:
    """Start a Clone every ``every`` seconds; yield (when it was asked, whether it started)."""
    while True:
        asked = time.monotonic()
        got = await live.clone(argv=("true",))  # type: ignore[attr-defined]
        if isinstance(got, FiberView):
            await got.wait()
        yield asked, isinstance(got, FiberView)
        await asyncio.sleep(every)


@aio
async def test_a_pod_replaced_while_cut_off_ends_in_401s_and_no_clone_starts(
        lane: Lane, first_401: First401, tmp_path: Path) -> None:
    site = Site(tmp_path, uuid.uuid4().hex)
    relay = Cutoff(lane.port).mend()
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(lane.bound_token())
    (account / "ca.crt").write_bytes(lane.ca_pem)
    (account / "namespace").write_text(NAMESPACE)
    environ = {ENV_SERVER: relay.url, ENV_SERVICE_ACCOUNT_DIR: str(account),
               ENV_POD_NAME: POD, ENV_POD_NAMESPACE: NAMESPACE, ENV_POD_UID: lane.pod_uid(),
               ENV_NODE_NAME: "node-1", ENV_SERVICE_ACCOUNT: "slurm-fiber"}
    volume = tmp_path / "secret"
    volume.mkdir(mode=0o755)
    try:
        async with running_fiberd(site, environ, home="kubernetes", grantdir=str(volume),
                                  audience=None, poll_interval=str(INTERVAL), stale_ttl="30",
                                  fence_ttl="60") as live:
            # The grant arrives once the API has answered (a first round on a cold
            # apiserver can overrun 50 ms, and a grant admitted before any answer
            # is refused: its Pod's devices are unknown).
            await until(lambda: live.core.health()["state"] == "fresh")
            for _ in atomic_write(volume, {"g1.jwt": site.token("g1", audience=AUDIENCE).encode()}):
                pass
            await warm(live)
            relay.cut()  # the node is partitioned from the API server
            lane.replace_pod()  # ... while its Pod is force-deleted and recreated elsewhere
            cut_until = time.monotonic() + TOKEN_CACHE_TTL + 2
            started_while_cut = 0
            async for _asked, started in cloning(live, 0.5):
                started_while_cut += started
                if time.monotonic() >= cut_until:
                    break
            assert started_while_cut > 0, "cut off, the fence still holds: Clones start"
            assert first_401.at is None
            relay.mend()
            outcomes: list[tuple[float, bool]] = []
            async for asked, started in cloning(live, INTERVAL):
                outcomes.append((asked, started))
                if first_401.at is not None and asked > first_401.at + 20 * INTERVAL:
                    break
                assert asked < cut_until + 30, "no 401 after the partition ended"
            assert first_401.at is not None
            late = [started for asked, started in outcomes if asked > first_401.at + FEW * INTERVAL]
            assert late and not any(late), f"a Clone started {FEW} intervals after the first 401"
            miss = await live.clone(argv=("true",))
            assert isinstance(miss, Miss) and miss.code is MissCode.DENIED
            assert live.core.status()["grants"] == 0
    finally:
        relay.close()
    assert not marked_procs(site.mark)
