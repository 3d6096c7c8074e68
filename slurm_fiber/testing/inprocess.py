"""fiberd run in-process on the caller's event loop, as the ``fiberd`` command runs it.

``in_process(config, environ)`` enters ``daemon.started`` (the configured
home built, the core started) and runs ``daemon.serve`` as a task; it
yields an ``InProcess`` whose ``core`` is the live runtime. Leaving the
block sets ``stop`` and waits for serve's clean shutdown; why it stopped is
then in ``ended`` ("stop requested" when the block's end stopped it), for
the caller to judge. Raises what ``started`` raises (HomeRefused,
FiberdRefused) when fiberd refuses to start.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from slurm_fiber.config import FiberdConfig
from slurm_fiber.core.runtime.core import Core
from slurm_fiber.daemon import Fiberd, HomeBuilder, serve, started
from slurm_fiber.homes.select import build_home

STOP_REQUESTED = "stop requested"


@dataclass
class InProcess:
    """A fiberd serving on this loop: ``serving`` ends with why it stopped."""

    fiberd: Fiberd
    stop: asyncio.Event
    serving: asyncio.Future[str]
    ended: str | None = None

    @property
    def core(self) -> Core:
        return self.fiberd.running.core


@contextlib.asynccontextmanager
async def in_process(config: FiberdConfig, environ: Mapping[str, str], *,
                     build: HomeBuilder = build_home) -> AsyncIterator[InProcess]:
    """fiberd started from ``config`` with the home's ``environ``, served until the block
    ends, then stopped; ``ended`` holds why."""
    async with started(config, environ, build=build) as fiberd:
        stop = asyncio.Event()
        running = InProcess(fiberd, stop,
                            asyncio.ensure_future(serve(fiberd.running, stop)))
        try:
            yield running
        finally:
            stop.set()
            running.ended = await running.serving
