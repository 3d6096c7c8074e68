"""Runtime test kit: a real issuer, a grantdir, and fiberd run in-process on the test's loop.

``Site`` (slurm_fiber.testing's) holds a real EdDSA key and JWKS file, mints grant
tokens and drops them into (or removes them from) the grantdir of a standalone
fiberd. ``running_fiberd`` starts fiberd exactly as the ``fiberd`` command does
(``slurm_fiber.testing.inprocess``) and checks it stopped cleanly afterwards.
Every template and fiber carries ``SF_TEST_MARK`` so leak checks find only
this test's processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_fiber import testing
from slurm_fiber.client.connection import FiberdClient
from slurm_fiber.config import FiberdConfig, load_config
from slurm_fiber.core.api.service import CallTarget, Clone, ExecTarget, Peer, Stdio
from slurm_fiber.core.runtime.core import Core
from slurm_fiber.core.trust.grant import FiberSpec, Limits, TemplateSpec
from slurm_fiber.testing.inprocess import STOP_REQUESTED, InProcess, in_process

REPO = Path(__file__).resolve().parents[3]
AUDIENCE = "runtime-test"
PEER = Peer(os.getpid(), os.getuid(), os.getgid())


class Site(testing.Site):
    """An issuer and the directories of one standalone fiberd; its grants' templates
    preload the runtime targets and carry ``mark``."""

    def __init__(self, root: Path, mark: str, key: Any = None) -> None:
        super().__init__(root, issuer="site", audience=AUDIENCE, key=key)
        self.mark = mark

    def token(self, uid: str = "g1", *, ttl: float = 3600, preload: tuple[str, ...] = (),
              fibers: int | None = None, seconds: float | None = None,
              audience: str = AUDIENCE, devices: tuple[str, ...] = (),
              memory: int | None = None, pids: int | None = None,
              cpu: float | None = None) -> str:
        spec = FiberSpec(
            devices=devices,
            template=TemplateSpec(preload=("tests.core.runtime.targetkit", *preload),
                                  env={"SF_TEST_MARK": self.mark, "PYTHONPATH": str(REPO)}),
            limits=Limits(fibers=fibers, seconds=seconds, memory=memory, pids=pids, cpu=cpu))
        return self.mint(uid, spec, ttl=ttl, audience=audience)

    def drop(self, uid: str = "g1", token: str | None = None, **kw: Any) -> str:
        """Write a grant file atomically (by rename); returns its token."""
        return self.drop_token(uid, token or self.token(uid, **kw))

    def remove(self, uid: str = "g1") -> None:
        super().remove(uid)

    def config(self, **over: object) -> FiberdConfig:
        flags: dict[str, object] = {
            "home": "standalone", "state_dir": str(self.state),
            "trust": f"site={self.jwks}", "audience": AUDIENCE, "poll_interval": "0.05",
            "grace": "0.3", "cgroup_root": "none", "audit_fsync": "never",
            # A root fiberd names whom fibers run as; on this test host, root, said so.
            "fiber_user": "root" if os.geteuid() == 0 else None,
        }
        flags.update(over)
        return load_config(env={}, flags=flags)


@dataclass
class Live(InProcess):
    """A fiberd serving on this loop."""

    async def clone(self, grant: str | None = "g1", *, target: str | None = None,
                    args: tuple[object, ...] = (), argv: tuple[str, ...] = (),
                    token: str | None = None) -> Any:
        request = Clone(
            grant=None if token else grant, token=token,
            call=CallTarget(target, args) if target else None,
            exec=ExecTarget(argv) if argv else None)
        return await self.core.clone(request, PEER, Stdio())


@contextlib.asynccontextmanager
async def running_fiberd(site: Site, environ: dict[str, str] | None = None,
                         **over: object) -> AsyncIterator[Live]:
    """fiberd started from ``site.config(**over)`` with the home's ``environ``; stopped (and
    asserted clean) on exit."""
    async with in_process(site.config(**over), environ or {}) as running:
        yield Live(running.fiberd, running.stop, running.serving)
    assert running.ended == STOP_REQUESTED


async def until(predicate: Callable[[], bool], within: float = 15.0) -> None:
    """Poll ``predicate`` every 20 ms until true; fail after ``within`` seconds."""
    end = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.02)


async def warm(live: Live, uid: str = "g1") -> None:
    """Wait until ``uid``'s template is ready."""
    await until(lambda: live.core.status()["templates"].get(uid) == "ready")  # type: ignore[union-attr]


@dataclass
class ThreadFiberd:
    """A warm fiberd serving on its own loop in a background thread (for blocking clients).

    Shaped like the socket tests' ``Served``: ``path``, ``server``, ``service`` (the Core)
    and ``on_loop`` to read state on the daemon's loop.
    """

    path: Path
    live: Live
    loop: asyncio.AbstractEventLoop

    @property
    def server(self) -> Any:
        return self.live.fiberd.running.server

    @property
    def service(self) -> Core:
        return self.live.core

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        async def call() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(30)


@contextlib.contextmanager
def fiberd_in_thread(site: Site, **over: object) -> Iterator[ThreadFiberd]:
    """Drop a grant, start fiberd on a loop in a thread, wait until warm; stop it afterwards."""
    site.drop()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    context = running_fiberd(site, **over)

    async def up() -> Live:
        live = await context.__aenter__()
        await warm(live)
        return live

    try:
        live = asyncio.run_coroutine_threadsafe(up(), loop).result(60)
        yield ThreadFiberd(site.state / "fiberd.sock", live, loop)
        asyncio.run_coroutine_threadsafe(context.__aexit__(None, None, None), loop).result(60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextlib.contextmanager
def fsync_stalled(served: ThreadFiberd) -> Iterator[None]:
    """``served``'s audit fsync helper (``audit_fsync = always``) stopped for the block and
    continued after it: meanwhile a Clone's record is written but not made durable, so
    its Clone is not answered. One Clone of ``true`` starts the helper first."""
    with FiberdClient(served.path) as client:
        client.clone(exec={"argv": ["true"]}, wait=True)
        client.wait_exit(within=30)
    helper = served.service.trail._syncer._proc  # type: ignore[union-attr]
    os.kill(helper.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(helper.pid, signal.SIGCONT)
