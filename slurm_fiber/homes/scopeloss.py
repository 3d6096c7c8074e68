"""ScopeLossQueue: scope-loss reasons handed to one callback, in order, once each.

A home detects a loss of scope (its Pod deleted, its claim deallocated, its
job gone) inside a poll round and calls ``lose``. Delivery happens on the
one task ``run`` owns, so a slow callback (an epoch bump that waits for
fibers) never stalls a poll round and outlives the round that found the
loss. Reasons detected before a callback exists wait in the queue and are
delivered in order once one is set. Each reason is delivered at most once
per queue lifetime. The queue does not log; ``lose`` reports whether a
reason is new so the home can.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

OnScopeLost = Callable[[str], Awaitable[None]]


class ScopeLossQueue:
    """A queue of scope-loss reasons. ``ScopeLossQueue()`` is ready to use.

    All methods are called on one event loop. Only ``run`` ever calls the
    callback.
    """

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._queue: deque[str] = deque()
        self._callback: OnScopeLost | None = None
        self._wake = asyncio.Event()
        self._running = False

    def lose(self, reason: str) -> bool:
        """Queue ``reason`` for delivery; True when new, False (dropped) when seen before.

        Never blocks and never calls the callback itself.
        """
        if reason in self._seen:
            return False
        self._seen.add(reason)
        self._queue.append(reason)
        self._wake.set()
        return True

    def on_scope_lost(self, fn: OnScopeLost | None) -> None:
        """Set the callback ``async fn(reason)`` and wake delivery; None is ignored.

        The callback handles its own errors: one that escapes ends ``run``
        with it, and the reasons still queued stay pending.
        """
        if fn is None:
            return
        self._callback = fn
        self._wake.set()

    def pending(self) -> int:
        """How many reasons wait for delivery (the one being delivered is not counted)."""
        return len(self._queue)

    async def run(self) -> None:
        """Deliver queued reasons, one at a time, until cancelled. Called once.

        Blocks: the caller gives it a task and waits for it. Cancelling it
        cancels a callback in progress.
        """
        if self._running:
            raise RuntimeError("ScopeLossQueue.run is called once")
        self._running = True
        while True:
            if self._callback is not None and self._queue:
                await self._callback(self._queue.popleft())
                continue
            self._wake.clear()
            await self._wake.wait()
