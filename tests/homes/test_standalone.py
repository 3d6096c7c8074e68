"""The standalone home: grantdir deliveries, readiness file and sd_notify, devices, health."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.devices import Device
from slurm_fiber.core.trust.grant import FiberSpec, VerifiedToken
from slurm_fiber.homes import EventKind, GrantDirRefused, Home
from slurm_fiber.homes.readyfile import writer
from slurm_fiber.homes.sdnotify import NotifyError, notify_address, sd_notify
from slurm_fiber.homes.standalone import StandaloneHome
from tests.homes.homekit import confirmed, token

GPU0 = Device("gpu", 0, "/dev/nvidia0", "GPU-aaaa")
GPU1 = Device("gpu", 1, "/dev/nvidia1")
FPGA0 = Device("fpga", 0, "/dev/xclmgmt0")


def grant(*kinds: str) -> VerifiedToken:
    return VerifiedToken("g1", "iss", "j1", ("host",), 2e9, 1.8e9, None,
                         FiberSpec(devices=kinds), b"raw")


def home_in(tmp_path: Path, clock: FakeClock, **kw: object) -> StandaloneHome:
    grants = tmp_path / "grants"
    grants.mkdir(mode=0o755, exist_ok=True)
    return StandaloneHome(str(grants), clock, poll_interval=2.0, **kw)  # type: ignore[arg-type]


class Listener:
    """A notify socket the test binds, as systemd would, collecting datagrams."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(notify_address(address))
        self.sock.setblocking(False)
        self.address = address

    def received(self) -> list[str]:
        out = []
        while True:
            try:
                out.append(self.sock.recv(4096).decode())
            except BlockingIOError:
                return out


@pytest.fixture(params=["path", "abstract"])
def listener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Listener]:
    if request.param == "path":
        address = str(tmp_path / "notify.sock")
    else:
        address = f"@slurm-fiber-test-{os.getpid()}-{id(request)}"
    lst = Listener(address)
    yield lst
    lst.sock.close()


def test_it_is_a_home_with_no_scope(tmp_path: Path, clock: FakeClock) -> None:
    home = home_in(tmp_path, clock)
    assert isinstance(home, Home)
    assert home.name() == "standalone"
    assert home.scope() == []


def test_health_is_always_fresh_and_fences_never_end_by_silence(
    tmp_path: Path, clock: FakeClock
) -> None:
    home = home_in(tmp_path, clock, stale_after=5.0)
    health = home.health()
    assert health is home.health()
    clock.advance(10_000)
    reading = health.read()
    assert reading.fresh and not reading.control_plane
    assert health.fence_end(30.0) is None


def test_grant_files_are_delivered_added_and_removed(tmp_path: Path, clock: FakeClock) -> None:
    home = home_in(tmp_path, clock)
    grants = tmp_path / "grants"
    (grants / "a.jwt").write_bytes(token("alpha"))

    async def main() -> None:
        events = await home.grants()
        first = await anext(events)
        assert first.kind is EventKind.GRANT_ADDED and first.token == token("alpha")
        confirmed(first)  # as drive does once the core verified it
        (grants / "b.jwt").write_bytes(token("beta"))
        (grants / "a.jwt").unlink()
        pending = asyncio.ensure_future(anext(events))
        await clock.settle()
        assert not pending.done()  # nothing until the next poll
        await clock.advance_and_settle(2.0)
        added = await pending
        assert added.token == token("beta") and confirmed(added) == "beta"
        removed = await anext(events)
        assert (removed.kind, removed.uid) == (EventKind.GRANT_REMOVED, "alpha")
        await events.aclose()

    asyncio.run(main())


def test_a_group_writable_grantdir_is_refused_before_delivery(
    tmp_path: Path, clock: FakeClock
) -> None:
    home = home_in(tmp_path, clock)
    os.chmod(tmp_path / "grants", 0o775)
    with pytest.raises(GrantDirRefused) as refused:
        asyncio.run(home.grants())
    assert refused.value.code == "grantdir_writable"


def test_devices_are_the_static_set_narrowed_to_the_grant_kinds(
    tmp_path: Path, clock: FakeClock
) -> None:
    home = home_in(tmp_path, clock, devices=[FPGA0, GPU1, GPU0])

    async def main() -> None:
        gpus, release = await home.devices(grant("gpu"))
        assert gpus.devices == (GPU0, GPU1)
        assert gpus.env()["CUDA_VISIBLE_DEVICES"] == "0,1"
        release()
        release()  # idempotent, and static devices stay for the next grant
        both, _ = await home.devices(grant("gpu", "fpga"))
        assert both.devices == (FPGA0, GPU0, GPU1)
        none, _ = await home.devices(grant())
        assert none.devices == ()
        assert none.env()["CUDA_VISIBLE_DEVICES"] == ""

    asyncio.run(main())


def test_readiness_file_is_replaced_atomically_on_each_flip(
    tmp_path: Path, clock: FakeClock
) -> None:
    ready = tmp_path / "ready.json"
    home = home_in(tmp_path, clock, ready_file=str(ready))

    async def main() -> None:
        await home.publish_ready("a", False)
        assert json.loads(ready.read_text()) == {"ready": False, "warm": [],
                                                 "time": clock.wall(), **writer()}
        clock.advance(3)
        await home.publish_ready("a", True)
        assert json.loads(ready.read_text()) == {"ready": True, "warm": ["a"],
                                                 "time": clock.wall(), **writer()}
        await home.publish_ready("a", False)
        assert json.loads(ready.read_text())["ready"] is False
        assert home.ready() is False

    asyncio.run(main())
    assert sorted(os.listdir(tmp_path)) == ["grants", "ready.json"]  # no temporary left


def test_systemd_gets_ready_once_per_flip(
    tmp_path: Path, clock: FakeClock, listener: Listener
) -> None:
    home = home_in(tmp_path, clock, notify_socket=listener.address)

    async def main() -> None:
        await home.publish_ready("a", False)
        await home.publish_ready("a", True)
        await home.publish_ready("b", True)  # no flip: still ready
        await home.publish_ready("a", False)  # no flip: b is warm
        await home.publish_ready("b", False)
        await home.publish_ready("b", True)

    asyncio.run(main())
    got = listener.received()
    assert [m.startswith("READY=1\n") for m in got] == [False, True, False, True]
    assert got[0] == "STATUS=not ready: no grant template is warm"
    assert got[1] == "READY=1\nSTATUS=ready: 1 warm grant template(s): a"


async def until(done: Callable[[], bool]) -> None:
    """Wait for work handed to a thread (the file write) to land; fails after 5 s."""
    for _ in range(500):
        if done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


def test_a_failed_publish_is_sent_again_by_run_each_change_logged_once(
    tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    later = tmp_path / "later"
    ready = later / "ready.json"
    home = home_in(tmp_path, clock, ready_file=str(ready))
    caplog.set_level(logging.INFO, "slurm_fiber.homes.standalone")

    async def poll(times: int) -> None:
        for _ in range(times):
            await clock.advance_and_settle(2.0)
            await asyncio.sleep(0.05)  # let the write's thread answer
            await clock.settle()

    async def main() -> None:
        with pytest.raises(FileNotFoundError):  # the caller is told, run stays quiet
            await home.publish_ready("a", True)
        runner = asyncio.create_task(home.run())
        await poll(2)
        later.write_text("a file where a directory should be")
        await poll(2)
        later.unlink()
        later.mkdir()
        await clock.advance_and_settle(2.0)
        await until(ready.exists)
        assert json.loads(ready.read_text())["warm"] == ["a"]
        await poll(2)
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner

    asyncio.run(main())
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert messages[0].startswith("readiness not published: ")
    assert "Not a directory" in messages[0]
    assert messages[1] == "readiness published again"


def test_sd_notify_refuses_bad_addresses_and_dead_sockets(tmp_path: Path) -> None:
    with pytest.raises(NotifyError, match="neither an absolute path"):
        sd_notify("READY=1", "vsock:2:1234")
    with pytest.raises(NotifyError, match="cannot notify"):
        sd_notify("READY=1", str(tmp_path / "nobody-listens"))


def test_cgroup_root_none_or_missing_comes_with_a_reason(tmp_path: Path, clock: FakeClock) -> None:
    off = home_in(tmp_path, clock, cgroup=None)
    assert off.cgroup_root() is None and "uncarved" in off.cgroup_reason()
    missing = home_in(tmp_path, clock, cgroup=str(tmp_path / "no-such-cgroup"))
    assert missing.cgroup_root() is None
    assert "does not exist" in missing.cgroup_reason()
    plain = home_in(tmp_path, clock, cgroup=str(tmp_path))
    assert plain.cgroup_root() is None and "not a cgroup v2" in plain.cgroup_reason()
    assert plain.close() == []
