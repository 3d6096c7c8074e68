"""A fiberd started for one clause, exactly as the ``fiberd`` command starts it, in-process.

``launched`` runs ``daemon.started`` (with the stage's configuration,
environment and home builder) and ``daemon.serve`` on the caller's event
loop, and stops it with the same clean shutdown a SIGTERM gives. ``Live``
is what a clause holds while it runs: the real core, the audience the home
named, and Clone helpers that go through the core's own Service entry.
``until`` is the one bounded wait clauses use; it polls, it never sleeps a
fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from slurm_fiber.conform.stage import Launch
from slurm_fiber.core.api.service import CallTarget, Clone, Peer, Stdio
from slurm_fiber.core.book.misses import Miss
from slurm_fiber.core.fibers.handles import FiberView
from slurm_fiber.core.runtime.core import Core
from slurm_fiber.daemon import Fiberd, FiberdRefused
from slurm_fiber.homes.select import HomeRefused
from slurm_fiber.testing.inprocess import STOP_REQUESTED, in_process

POLL = 0.02  # seconds between looks while waiting for a condition


class ClauseFailed(Exception):
    """A clause's check did not hold: one line saying what was expected and what was seen."""


async def until(predicate: Callable[[], bool], within: float, what: str) -> None:
    """Poll ``predicate`` until true; ClauseFailed naming ``what`` after ``within`` seconds."""
    end = time.monotonic() + within
    while not predicate():
        if time.monotonic() >= end:
            raise ClauseFailed(f"{what}: not seen within {within:g} s")
        await asyncio.sleep(POLL)


@dataclass
class Live:
    """A serving fiberd. Use it only inside ``launched``."""

    fiberd: Fiberd

    @property
    def core(self) -> Core:
        return self.fiberd.running.core

    @property
    def audience(self) -> str:
        """The audience the home named: every token minted for this fiberd carries it."""
        return self.fiberd.built.audience

    def template_state(self, uid: str) -> str | None:
        """The grant's template state ("warming", "ready", ...), None when it has none."""
        templates = self.core.status()["templates"]
        assert isinstance(templates, dict)
        return templates.get(uid)

    def held(self, uid: str) -> dict[str, object] | None:
        """The grant as ``list_grants`` shows it, None when fiberd does not hold it."""
        return next((dict(g) for g in self.core.list_grants() if g["uid"] == uid), None)

    async def clone(self, uid: str | None, target: str, *args: object,
                    token: str | None = None) -> FiberView | Miss:
        """A call-mode Clone for ``uid`` (or carrying ``token``), as a local client asks it."""
        request = Clone(call=CallTarget(target, args), grant=None if token else uid,
                        token=token)
        return await self.core.clone(request, Peer(os.getpid(), os.getuid(), os.getgid()),
                                     Stdio())

    async def call(self, uid: str, target: str, *args: object) -> object:
        """Clone, wait for the fiber, and return its result; ClauseFailed on a miss or error."""
        fiber = await self.clone(uid, target, *args)
        if isinstance(fiber, Miss):
            raise ClauseFailed(f"Clone of {uid} missed with {fiber.code}: {fiber.reason}")
        end = await fiber.wait()
        if end.error is not None or end.exit_code != 0:
            raise ClauseFailed(f"fiber of {uid} failed: {end.error or 'no error'}; "
                               f"exit {end.to_json()}")
        return end.result


@contextlib.asynccontextmanager
async def launched(launch: Launch) -> AsyncIterator[Live]:
    """fiberd serving on this loop until the block ends, then stopped cleanly.

    Raises ClauseFailed when fiberd refuses to start or stops for another
    reason than the harness's request.
    """
    config = launch.config
    if os.geteuid() == 0 and config.fiber_user is None:
        # The harness runs fiberd as whoever runs it, its templates too: as root, it says
        # so (a site's root fiberd names an unprivileged fiber_user, core/identity.py).
        config = replace(config, fiber_user="root")
    try:
        async with in_process(config, launch.environ, build=launch.build) as running:
            yield Live(running.fiberd)
        if running.ended != STOP_REQUESTED:
            raise ClauseFailed(f"fiberd stopped on its own: {running.ended}")
    except (HomeRefused, FiberdRefused) as err:
        raise ClauseFailed(f"fiberd refused to start: {err}") from None
