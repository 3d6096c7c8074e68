"""The example home: grants from a polled directory, readiness appended to a log file.

A small ``Home`` with the ports it needs: grants (``GrantSource``) arrive
through the shared grantdir delivery (``GrantDir.deliveries``); liveness
(``Liveness``): no control plane (its health is stale only while the grantdir
is missing) and no scope; readiness (``Readiness``). It provides no devices
and no cgroup root, so fiberd's defaults stand in: no device for any grant,
no cgroup carved (fiberd runs uncarved and says so). Each readiness flip
appends one JSON line ``{"ready": bool, "warm": [uid, ...]}`` to
``STATE_DIR/readiness.jsonl``, so whoever watches it sees every flip.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

from slurm_fiber.config import FiberdConfig
from slurm_fiber.core.book.health import SourceHealth
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.seam import GrantEvent, GrantSource, Home, Liveness, Readiness
from slurm_fiber.core.trust.grant import ScopeClaim
from slurm_fiber.homes.grantdir import GrantDir
from slurm_fiber.homes.problem import ProblemSink
from slurm_fiber.homes.readygate import ReadyGate

READINESS_LOG = "readiness.jsonl"


def _append(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class ExampleHome(Home, GrantSource, Liveness, Readiness):
    """A ``Home`` fed by ``grantdir``, publishing readiness to ``log``. One event loop."""

    def __init__(self, grantdir: str, log: Path, clock: Clock, *, poll_interval: float,
                 stale_after: float, on_problem: ProblemSink) -> None:
        self._clock = clock
        self._interval = poll_interval
        self._health = SourceHealth(clock, stale_after, control_plane=False)
        self._grantdir = GrantDir(grantdir, clock, poll_interval, on_problem=on_problem,
                                  health=self._health)
        self._log = log
        self._gate = ReadyGate(self._publish)

    @classmethod
    def from_config(cls, config: FiberdConfig, clock: Clock,
                    on_problem: ProblemSink) -> ExampleHome:
        return cls(config.grantdir, Path(config.state_dir) / READINESS_LOG, clock,
                   poll_interval=config.poll_interval, stale_after=config.stale_ttl,
                   on_problem=on_problem)

    def name(self) -> str:
        return "example"

    async def grants(self) -> AsyncIterator[GrantEvent]:
        return self._grantdir.deliveries()

    def health(self) -> SourceHealth:
        return self._health

    async def publish_ready(self, grant_uid: str, ready: bool) -> None:
        await self._gate.publish_ready(grant_uid, ready)

    def scope(self) -> list[ScopeClaim]:
        return []

    async def run(self) -> None:
        """Publish readiness again every poll interval until it is written."""
        while True:
            await self._clock.sleep(self._interval)
            await self._gate.republish()

    async def _publish(self, warm: list[str]) -> None:
        line = json.dumps({"ready": bool(warm), "warm": warm}) + "\n"
        await asyncio.to_thread(_append, self._log, line)
