"""A windowed batch run as a task window: its events streamed as the template reports them.

With fiberd's ``task_window = "template"`` (off by default), a windowed ``clone_batch``
(protocol v5) whose items are all exec is handed to the runtime's ``open_window``
(core/runtime/task_window.py) instead of being started item by item. The client sees
the same protocol: one ``started`` event first (the refused items and the first starts),
then, per report of the template, the exit events of fibers it already knows, a
``started`` event for the new starts and the exits of those (an entry always before
its fiber's exit); every item answered exactly once; the last event final. What
differs (docs/socket-protocol.md): a ``cancel`` has the template start nothing more
and is answered ``cancelled`` with the keys not yet started; a client that leaves has
the window closed and its fibers killed (not hung up); the fiber records are the
window's (``window``, no deadline per fiber).

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


class Connection(Protocol):
    """The server's connection, as this module uses it."""

    async def send(self, *messages: Json) -> None: ...

    def hear(self, frame: Any, nfds: int | None = None, broken: bool = False) -> Action: ...

    def next_frame(self) -> asyncio.Task[Any]: ...

    pending_read: asyncio.Task[Any] | None


async def stream_window(conn: Connection, rid: int | str | None, run: WindowRun | Miss,
                        refused: list[Json], gone: type[Exception]) -> None:
    """Stream a task window's events (module doc); ``refused``: the refused items'
    entries, sent in the first ``started`` event. A miss answers every item."""
    if isinstance(run, Miss):
        await conn.send(ok_reply(rid, BatchStarted(refused).to_json(), "started",
                                 final=True))
        return
    batches = run.batches()
    first = True
    known: set[object] = set()  # fiber ids whose started entry went out
    try:
        while True:
            step = asyncio.ensure_future(anext(batches))
            while not step.done():
                reading = conn.next_frame()
                await asyncio.wait({step, reading}, return_when=asyncio.FIRST_COMPLETED)
                if reading.done():
                    conn.pending_read = None
                    await _control(conn, rid, run, reading, gone)
            try:
                entries, exits, last = step.result()
            except StopAsyncIteration:
                return
            events = _events(rid, entries, exits, known, refused if first else [], first)
            first = False
            if last and not events:
                events = [ok_reply(rid, BatchStarted([]).to_json(), "started", final=False)]
            if events:
                events[-1]["final"] = last
                await conn.send(*events)
            if last:
                return
    finally:
        await batches.aclose()


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


async def _control(conn: Connection, rid: int | str | None, run: WindowRun,
                   reading: asyncio.Task[Any], gone: type[Exception]) -> None:
    """A frame during the stream: ``cancel`` answered ``cancelled``; end of file closes
    the window (its fibers killed); anything else is refused busy."""
    try:
        frame, broken = reading.result(), False
    except Exception:
        frame, broken = None, True
    action = conn.hear(frame, 0, broken)  # the conversation's table: cancel, busy, hang-up
    if action is Action.HANG_UP_FIBERS:
        await run.close("cancelled")
        raise gone("client left while its task window ran")
    frame.close_fds()
    if action is Action.CANCEL:
        await conn.send(ok_reply(rid, Cancelled(run.cancel()).to_json(), "cancelled",
                                 final=False))
        return
    err = ApiError(ErrorCode.BUSY, "this connection is waiting for a fiber; use another one")
    await conn.send({"id": None, "ok": False, "error": err.to_json()})


def window_requests(requests: list[Clone], stdios: list[Stdio]) -> bool:
    """Whether a windowed batch's valid items may run as a task window (all exec)."""
    return bool(requests) and all(r.exec is not None and r.call is None for r in requests) \
        and len(requests) == len(stdios)
