"""A windowed batch run as a task window: its events streamed as the template reports them.

With fiberd's ``task_window = "template"`` (off by default), a windowed ``clone_batch``
(protocol v5) whose items are exec or call items is handed to the runtime's ``open_window``
(core/runtime/task_window.py) instead of being started item by item. The client sees
the same protocol: one ``started`` event first (the refused items and the first starts),
then, per report of the template, the exit events of fibers it already knows, a
``started`` event for the new starts and the exits of those (an entry always before
its fiber's exit); every item answered exactly once; the last event final. What
differs (docs/socket-protocol.md): a ``cancel`` has the template start nothing more
and is answered ``cancelled`` with the keys not yet started; a client that leaves has
the window closed and its fibers killed (not hung up); the fiber records are the
window's (``window``, no deadline per fiber). As on fiberd's path, with ``early`` a
call fiber's ``result`` event goes out as soon as its record is complete, after its
``started`` entry and before its exit event (an exit that comes first carries it and
no ``result`` event follows).

Guarantee: an event reaches the client only after the audit records of what it tells
are durable (the runtime's ``batches``).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from slurm_fiber.core.api.conversation import Action
from slurm_fiber.core.api.service import Clone, FiberExit, Stdio
from slurm_fiber.core.book.misses import Miss
from slurm_fiber.protocol.replies import BatchStarted, Cancelled
from slurm_fiber.protocol.validate import ApiError, ErrorCode, ok_reply

Json = dict[str, object]


class WindowRun(Protocol):
    """What ``open_window`` returns (core/runtime/task_window.py's ``TaskWindowRun``)."""

    answered: set[str]
    keys: list[str]

    def batches(self) -> Any: ...

    def cancel(self) -> list[str]: ...

    async def close(self, cause: str) -> None: ...

    def written(self, fiber_id: str) -> asyncio.Future[None] | None: ...

    def result_event(self, fiber_id: str) -> Json | None: ...


class Connection(Protocol):
    """The server's connection, as this module uses it."""

    async def send(self, *messages: Json) -> None: ...

    def hear(self, frame: Any, nfds: int | None = None, broken: bool = False) -> Action: ...

    def next_frame(self) -> asyncio.Task[Any]: ...

    pending_read: asyncio.Task[Any] | None


async def stream_window(conn: Connection, rid: int | str | None, run: WindowRun | Miss,
                        refused: list[Json], gone: type[Exception],
                        early: bool = False) -> None:
    """Stream a task window's events (module doc); ``refused``: the refused items'
    entries, sent in the first ``started`` event; ``early``: a call fiber's ``result``
    event before its exit (protocol v4). A miss answers every item."""
    if isinstance(run, Miss):
        await conn.send(ok_reply(rid, BatchStarted(refused).to_json(), "started",
                                 final=True))
        return
    batches = run.batches()
    first = True
    known: set[object] = set()  # fiber ids whose started entry went out
    results: dict[str, asyncio.Future[None]] = {}  # early results awaited, by fiber id
    step: asyncio.Future[Any] | None = None
    ended = False  # the last batch was taken
    try:
        while True:
            step = asyncio.ensure_future(anext(batches))
            while not step.done():
                reading = conn.next_frame()
                await asyncio.wait({step, reading, *results.values()},
                                   return_when=asyncio.FIRST_COMPLETED)
                await _send_results(conn, rid, run, results)
                if reading.done():
                    conn.pending_read = None
                    if await _control(conn, rid, run, reading):
                        raise gone("client left while its task window ran")
            try:
                entries, exits, last = step.result()
            except StopAsyncIteration:
                ended = True
                return
            ended = last
            for fiber_exit in exits:  # its exit event carries its result: no later one
                results.pop(fiber_exit.fiber_id, None)
            events = _events(rid, entries, exits, known, refused if first else [], first)
            first = False
            if last and not events:
                events = [ok_reply(rid, BatchStarted([]).to_json(), "started", final=False)]
            if events:
                events[-1]["final"] = last
                await conn.send(*events)
            if last:
                return
            if early:
                _await_results(run, entries, exits, results)
    finally:
        if step is not None and not ended:  # the client left (or its stream failed)
            await _left(run, step, batches)
        await batches.aclose()


def _await_results(run: WindowRun, entries: list[Json], exits: list[FiberExit],
                   results: dict[str, asyncio.Future[None]]) -> None:
    """Watch the records of the call fibers ``entries`` announced that have not ended."""
    ended = {e.fiber_id for e in exits}
    for entry in entries:
        fiber = entry.get("fiber")
        if isinstance(fiber, dict) and fiber.get("mode") == "call":
            fiber_id = str(fiber.get("id"))
            written = run.written(fiber_id)
            if written is not None and fiber_id not in ended:
                results[fiber_id] = written


async def _send_results(conn: Connection, rid: int | str | None, run: WindowRun,
                        results: dict[str, asyncio.Future[None]]) -> None:
    """Send the ``result`` event of each call fiber whose record is complete now."""
    events = []
    for fiber_id in [i for i, written in results.items() if written.done()]:
        del results[fiber_id]
        if (event := run.result_event(fiber_id)) is not None:
            events.append(ok_reply(rid, event, "result", final=False))
    if events:
        await conn.send(*events)


def _events(rid: int | str | None, entries: list[Json], exits: list[FiberExit],
            known: set[object], refused: list[Json], first: bool) -> list[Json]:
    """One batch's events: exits of fibers already announced, the ``started`` event, then
    the exits of fibers it announces (an entry before its exit)."""
    for entry in entries:
        fiber = entry.get("fiber")
        if isinstance(fiber, dict):
            known.add(fiber.get("id"))
    before = [e for e in exits if e.fiber_id in known and e.fiber_id not in
              {f.get("id") for f in (x.get("fiber") for x in entries) if isinstance(f, dict)}]
    after = [e for e in exits if e not in before]
    events = [ok_reply(rid, e.to_json(), "exit", final=False) for e in before]
    if entries or refused or first:
        events.append(ok_reply(rid, BatchStarted([*refused, *entries]).to_json(), "started",
                               final=False))
    events += [ok_reply(rid, e.to_json(), "exit", final=False) for e in after]
    return events


async def _left(run: WindowRun, step: asyncio.Future[Any], batches: Any) -> None:
    """The client left (found by a read or a write): close the window (its fibers
    killed) and take what the template still reports (``step``, the batch in hand or
    coming, then the rest), to its last report, so that every fiber started has its
    records (audited by ``batches``, told to nobody). Bounded by the close's own bound."""
    closing = asyncio.ensure_future(run.close("cancelled"))
    try:
        while True:
            try:
                _, _, last = await step
            except Exception:  # the end, or what the stream itself raised already
                return
            if last:
                return
            step = asyncio.ensure_future(anext(batches))
    finally:
        await closing


async def _control(conn: Connection, rid: int | str | None, run: WindowRun,
                   reading: asyncio.Task[Any]) -> bool:
    """A frame during the stream: ``cancel`` answered ``cancelled``; anything else is
    refused busy; True when the client left (end of file, a broken frame)."""
    try:
        frame, broken = reading.result(), False
    except Exception:
        frame, broken = None, True
    action = conn.hear(frame, 0, broken)  # the conversation's table: cancel, busy, hang-up
    if action is Action.HANG_UP_FIBERS:
        return True
    frame.close_fds()
    if action is Action.CANCEL:
        await conn.send(ok_reply(rid, Cancelled(run.cancel()).to_json(), "cancelled",
                                 final=False))
        return False
    err = ApiError(ErrorCode.BUSY, "this connection is waiting for a fiber; use another one")
    await conn.send({"id": None, "ok": False, "error": err.to_json()})
    return False


def window_requests(requests: list[Clone], stdios: list[Stdio]) -> bool:
    """Whether a windowed batch's valid items may run as a task window (each an exec or
    a call)."""
    return bool(requests) and all((r.exec is None) != (r.call is None) for r in requests) \
        and len(requests) == len(stdios)
