"""A windowed batch's queue: which of its items start next, and when (protocol v5).

A ``clone_batch`` with ``window`` N keeps at most N of its fibers running or
starting: the server launches the first items at once and, each time one of
the batch's fibers ends, the next ones, in the request's order, each start
its own task (so fiberd can order the next spawn while the template is still
busy with the one before, and the exits of the other fibers are sent as they
come). So a client sends 64 tasks in one request and fiberd keeps N of them
running with no round trip between one task's end and the next one's start. A
fiber that ends while its start is still under way (its record waiting for the
audit fsync) frees its place at once: N bounds the fibers running, and the
fsyncs of the next starts overlap the ones before.

Guarantees: every item is answered exactly once (an entry of a ``started``
event: its fiber, miss or error) unless the batch is cancelled first, in
which case ``cancel`` names the items that will never start; an item's
descriptors are closed as soon as it is answered or cancelled (a pipe passed
for a later item never keeps an earlier one's reader waiting), and ``close``
closes what is left. A retryable miss (``capacity``, say) of an item while
other fibers of the batch run or start is not answered: the item goes back
to the head of the queue and is tried again once one of them has ended (the
miss is audited each time, as any); with none running or starting, the miss
is its answer. Not thread-safe: used by one connection on the server's loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from slurm_fiber.core.api.service import FiberExit, FiberHandle, Forked, Stdio
from slurm_fiber.core.book.misses import Miss
from slurm_fiber.core.waiting import set_done
from slurm_fiber.protocol.framing import close_all
from slurm_fiber.protocol.requests import Clone

Outcome = FiberHandle | Miss | Exception
Json = dict[str, object]


@dataclass(frozen=True)
class Pending:
    """One valid item not answered yet: its key, its clone and the descriptors it carries
    (``stdio``: owned by the window until the item is answered or cancelled)."""

    index: int  # its place in the request
    key: str
    request: Clone
    stdio: Stdio

    @property
    def fds(self) -> tuple[int, ...]:
        return stdio_fds(self.stdio)


def stdio_fds(stdio: Stdio) -> tuple[int, ...]:
    """The descriptors a ``Stdio`` holds."""
    return tuple(fd for fd in (stdio.stdin, stdio.stdout, stdio.stderr) if fd is not None)


class BatchWindow:
    """The items of one windowed batch not answered yet. ``start`` starts one item's fiber
    (the Service's clone for a batch of one, with the request's item count for its audit
    record, telling its ``Forked`` callback of the fiber once it runs); ``entry`` turns an
    outcome into the item's entry of a ``started`` event (and counts it). ``starting``
    holds the starts in flight (tasks, to wait on); ``woken`` is called when one of their
    fibers ends before its start lands (``launch`` may then start another)."""

    def __init__(self, items: Sequence[Pending], size: int,
                 start: Callable[[Pending, Forked], Coroutine[Any, Any, Outcome]],
                 entry: Callable[[str, Outcome], Json],
                 released: Callable[[int], None] = lambda _n: None) -> None:
        self.queue = deque(items)
        self._released = released  # told how many descriptors each close gave up
        self.size = size
        self.starting: dict[asyncio.Future[Outcome], Pending] = {}
        self.woken: Callable[[], None] = lambda: None
        self.held = False  # the queue's head missed retryably: it waits for a fiber's end
        self._start = start
        self._entry = entry
        self._unlanded: set[int] = set()  # the indexes of the items in ``starting``
        self._ended: set[int] = set()  # those whose fiber has already ended

    @property
    def pending(self) -> bool:
        """Whether items wait to start or are starting."""
        return bool(self.queue or self.starting)

    def launch(self, running: int) -> None:
        """Start queued items, each as its own task, until ``size`` of the batch's fibers
        run (``running`` do now) or start (a start whose fiber has ended takes no place);
        none while the head is held and others run or start. Does not block."""
        if self.held and running + len(self.starting):
            return
        self.held = False
        busy = running + len(self.starting) - len(self._ended)
        while self.queue and busy < self.size:
            item = self.queue.popleft()
            self._unlanded.add(item.index)
            self.starting[asyncio.ensure_future(self._start(
                item, partial(self._forked, item.index)))] = item
            busy += 1

    async def launch_first(self) -> set[asyncio.Future[Outcome]]:
        """Launch the first items and return once each of those starts has finished (more
        are launched meanwhile as fibers end before their start lands): the finished
        starts, to ``land``."""
        self.launch(0)
        first = set(self.starting)
        loop = asyncio.get_running_loop()
        while unfinished := {task for task in first if not task.done()}:
            woken = loop.create_future()
            self.woken = partial(set_done, woken)
            await asyncio.wait({*unfinished, woken}, return_when=asyncio.FIRST_COMPLETED)
            self.launch(0)
        self.woken = lambda: None
        return {task for task in self.starting if task.done()}

    def _forked(self, index: int, fiber: FiberHandle) -> None:
        fiber.on_exit(partial(self._ended_starting, index))

    def _ended_starting(self, index: int, _end: FiberExit) -> None:
        """A fiber ended while its start is in flight: its place is free, and a held item
        may be tried again (as on ``ended``)."""
        if index in self._unlanded:
            self._ended.add(index)
            self.ended()
            self.woken()

    def ended(self) -> None:
        """One of the batch's fibers has ended: a held item may be tried again."""
        self.held = False

    def landed(self, task: asyncio.Future[Outcome],
               running: int) -> tuple[FiberHandle | None, Json | None]:
        """A finished start (``task``, one of ``starting``): its fiber to wait for, if one
        started, and its item's entry; (None, None) for a retryable miss while others of
        the batch run (``running``) or start: the item is held at the head of the queue.
        Raises what the start raised (not a Miss or a failed fork: those are outcomes)."""
        item = self.starting.pop(task)
        self._unlanded.discard(item.index)
        self._ended.discard(item.index)
        try:
            outcome = task.result()
        except BaseException:
            self._close(item)
            raise
        if isinstance(outcome, Miss) and outcome.retryable and running + len(self.starting):
            at = next((n for n, q in enumerate(self.queue) if q.index > item.index),
                      len(self.queue))
            self.queue.insert(at, item)  # in the request's order, before those not tried
            self.held = True
            return None, None
        self._close(item)
        fiber = None if isinstance(outcome, Miss | Exception) else outcome
        return fiber, self._entry(item.key, outcome)

    def land(self, done: set[asyncio.Future[Any]],
             running: int) -> tuple[list[FiberHandle], list[Json]]:
        """``landed`` for each start among ``done``, in launch order (``running``: the
        batch's fibers running before them): the fibers to wait for and the entries to
        send."""
        fibers: list[FiberHandle] = []
        entries: list[Json] = []
        for task in [t for t in self.starting if t in done]:
            fiber, entry = self.landed(task, running + len(fibers))
            fibers += [fiber] if fiber is not None else []
            entries += [entry] if entry is not None else []
        return fibers, entries

    def started_unanswered(self) -> list[FiberHandle]:
        """The fibers of starts that have finished but not landed yet (a client that
        leaves now has them hung up with the rest; starts still in flight are cancelled
        by ``close``, which kills what they started)."""
        return [outcome for task in self.starting
                if task.done() and not task.cancelled() and task.exception() is None
                and not isinstance(outcome := task.result(), Miss | Exception)]

    def cancel(self) -> list[str]:
        """Start none of the queued items; their keys, in order (their descriptors are
        closed). Starts in flight still land and are answered."""
        keys = [item.key for item in self.queue]
        while self.queue:
            self._close(self.queue.popleft())
        return keys

    def close(self) -> None:
        """Drop what is left (idempotent): queued items' descriptors are closed, starts in
        flight are cancelled and theirs closed once they have stopped."""
        self.cancel()
        for task, item in self.starting.items():
            task.cancel()
            task.add_done_callback(partial(self._close_when_done, item))
        self.starting.clear()
        self._unlanded.clear()
        self._ended.clear()

    def _close(self, item: Pending) -> None:
        close_all(item.fds)
        self._released(len(item.fds))

    def _close_when_done(self, item: Pending, _task: asyncio.Future[Outcome]) -> None:
        self._close(item)
