"""A windowed batch's queue: which of its items start next, and when (protocol v5).

A ``clone_batch`` with ``window`` N keeps at most N of its fibers running:
the server starts the first items at once and, each time one of the batch's
fibers ends, the next ones (``refill``), in the request's order. So a client
sends 64 tasks in one request and fiberd keeps N of them running with no
round trip between one task's end and the next one's start.

Guarantees: every item is answered exactly once (an entry of a ``started``
event: its fiber, miss or error) unless the batch is cancelled first, in
which case ``cancel`` names the items that will never start; an item's
descriptors are closed as soon as it is answered or cancelled (a pipe passed
for a later item never keeps an earlier one's reader waiting), and ``close``
closes what is left. A retryable miss (``capacity``, say) of an item while
other fibers of the batch run is not answered: the item waits at the head of
the queue and is tried again when one of them ends (the miss is audited each
time, as any); with none running, the miss is its answer. Not thread-safe:
used by one connection on the server's loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence

from slurm_fiber.core.api.framing import close_all
from slurm_fiber.core.api.service import CloneRequest, FiberHandle, Stdio
from slurm_fiber.core.misses import Miss
from slurm_fiber.record import record

Outcome = FiberHandle | Miss | Exception
Json = dict[str, object]


@record(frozen=True)
class Pending:
    """One valid item not started yet: its key, its clone and the descriptors it carries
    (owned by the window until the item is answered or cancelled)."""

    key: str
    request: CloneRequest
    stdio: Stdio
    fds: tuple[int, ...]


class BatchWindow:
    """The items of one windowed batch not started yet. ``start`` starts one item's fiber
    (the Service's clone for a batch of one, with the request's item count for its audit
    record); ``entry`` turns an outcome into the item's entry of a ``started`` event (and
    counts it)."""

    def __init__(self, items: Sequence[Pending], size: int,
                 start: Callable[[Pending], Awaitable[Outcome]],
                 entry: Callable[[str, Outcome], Json]) -> None:
        self.queue = deque(items)
        self.size = size
        self._start = start
        self._entry = entry

    @property
    def pending(self) -> bool:
        """Whether items wait to start (they will, as running fibers end)."""
        return bool(self.queue)

    async def refill(self, running: int) -> tuple[list[FiberHandle], list[Json]]:
        """Start items until ``size`` of the batch's fibers run (``running`` do now) or the
        queue is empty; the fibers started and every item's entry answered now. Blocks on
        the Service's clone of each."""
        started: list[FiberHandle] = []
        entries: list[Json] = []
        while self.queue and running + len(started) < self.size:
            item = self.queue[0]
            outcome = await self._start(item)
            busy = running + len(started) > 0
            if isinstance(outcome, Miss) and outcome.retryable and busy:
                break  # tried again when one of the running fibers ends
            self.queue.popleft()
            close_all(item.fds)
            if not isinstance(outcome, Miss | Exception):
                started.append(outcome)
            entries.append(self._entry(item.key, outcome))
        return started, entries

    def cancel(self) -> list[str]:
        """Start none of the items left; their keys, in order. Their descriptors are closed."""
        keys = [item.key for item in self.queue]
        self.close()
        return keys

    def close(self) -> None:
        """Drop what is left unstarted, closing its descriptors (idempotent)."""
        while self.queue:
            close_all(self.queue.popleft().fds)

