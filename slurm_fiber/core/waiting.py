"""Small awaitables the process layer shares: a pidfd's exit, the first of several.

``pidfd_wait`` wakes on the pidfd becoming readable (the process exited),
through the event loop, never by polling. ``first_done`` races a main
future against others (a clock sleep, an event) and cancels the losers.
"""

from __future__ import annotations

import asyncio
import select
from collections.abc import Awaitable


def pidfd_exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has exited (never blocks)."""
    return bool(select.select([pidfd], [], [], 0)[0])


async def pidfd_wait(pidfd: int) -> None:
    """Return once the process behind ``pidfd`` has exited. The caller owns the fd."""
    if pidfd_exited(pidfd):
        return
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    loop.add_reader(pidfd, _resolve, done)
    try:
        await done
    finally:
        loop.remove_reader(pidfd)


async def first_done(main: asyncio.Future[object], *others: Awaitable[object]) -> bool:
    """Wait for ``main`` or any of ``others``; True when ``main`` is done. Cancels the others."""
    tasks = [asyncio.ensure_future(o) for o in others]
    try:
        await asyncio.wait([main, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
    return main.done()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
