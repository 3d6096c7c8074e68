"""A Clone's stream once started: its first ``started`` event, then its fibers' exits.

``send_started`` sends a Clone's or batch's first ``started`` event; ``stream_exits``
then sends each fiber's ``exit`` event as it ends (the last event final), with ``early``
a call fiber's ``result`` event before it, and with a ``window.BatchWindow`` starts the
batch's next items as fibers end, each answered in a later ``started`` event. While it
runs, ``stream_control`` answers a frame the client sends: a ``cancel`` of the
streaming windowed batch with the ``cancelled`` event, anything else with ``busy``
(audited). A client that leaves (found by a read or by a write) has each of its fibers
still running hung up (SIGHUP, ``hang_up``) when the Clone asked for ``hangup``, as the
conversation table says (conversation.py), and the wait is abandoned: a window's items
not started never start. Every event goes through the connection's ``send``, so the
connection's conversation and deadlines see it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from functools import partial
from typing import TYPE_CHECKING, Any

from slurm_fiber.core.api.answers import PeerGone
from slurm_fiber.core.api.conversation import Action, Event, State
from slurm_fiber.core.api.service import FiberExit, FiberHandle
from slurm_fiber.core.api.window import BatchWindow
from slurm_fiber.core.waiting import set_done
from slurm_fiber.protocol.framing import Frame, FramingError
from slurm_fiber.protocol.replies import BatchStarted, Cancelled
from slurm_fiber.protocol.validate import ApiError, ErrorCode, ok_reply, request_id

if TYPE_CHECKING:
    from slurm_fiber.core.api.server import _Connection

log = logging.getLogger(__name__)


async def send_started(conn: _Connection, message: dict[str, object], fibers: list[FiberHandle],
                       hangup: bool) -> None:
    """Send a clone's first ``started`` event; a client gone by then has ``fibers``
    hung up when the stream would have (the table's hang-up in a stream)."""
    try:
        await conn.send(message)
    except PeerGone:
        if conn.talk.state is not State.CLOSED and conn.talk.on(
                Event.HANG_UP) is Action.HANG_UP_FIBERS and hangup:
            for fiber in fibers:
                hang_up(conn, fiber)
        raise


async def stream_exits(conn: _Connection, rid: int | str | None, fibers: list[FiberHandle],
                       hangup: bool, early: bool = False,
                       window: BatchWindow | None = None) -> None:
    """Send each fiber's exit event as it ends (the last event final); with ``early``,
    before it, a call fiber's ``result`` event as soon as it has written its result;
    with a ``window``, start its next items as fibers end (``BatchWindow``), each
    answered in a ``started`` event as it lands, and answer a ``cancel`` frame with
    the ``cancelled`` event; meanwhile answer other frames with busy.

    A client that disconnects first gets each fiber still running a SIGHUP
    when ``hangup`` (as a terminal hang-up would), and the wait is abandoned
    (a window's items not started never start).
    """
    waiting: dict[str, FiberHandle] = {}  # running, by id
    # Exits come by callback (``on_exit``), each in the loop step its end completes,
    # and wake this stream through one future: no task per fiber between its end and
    # its event (a task, a shield and the wait's own step cost two loop steps more).
    ended: list[tuple[FiberHandle, FiberExit]] = []
    woken: list[asyncio.Future[None]] = [asyncio.get_running_loop().create_future()]
    results: dict[str, asyncio.Future[Any]] = {}  # early results, by fiber id
    starting: dict[asyncio.Future[Any], Any] = window.starting if window else {}

    def exited(fiber: FiberHandle, end: FiberExit) -> None:
        ended.append((fiber, end))
        set_done(woken[0])
        if window is not None:  # the next starts go out now, not once this stream wakes
            window.ended()
            window.launch(len(waiting) - len(ended))

    def watch(fiber: FiberHandle) -> None:
        waiting[fiber.id] = fiber
        fiber.on_exit(partial(exited, fiber))
        if early:
            results[fiber.id] = asyncio.ensure_future(fiber.call_result())

    def gone(event: Event) -> PeerGone:
        """The client left (``event``): what the table says, then the error to raise."""
        if conn.talk.on(event) is Action.HANG_UP_FIBERS and hangup:
            for fiber in [*waiting.values(),
                          *(window.started_unanswered() if window else ())]:
                hang_up(conn, fiber)
        return PeerGone("client left while its fibers ran")

    for fiber in fibers:
        watch(fiber)
    if window is not None:
        window.woken = lambda: set_done(woken[0])
        window.launch(len(waiting))
    try:
        while waiting or (window is not None and window.pending):
            reading = conn.next_frame()
            done, _ = await asyncio.wait({woken[0], *results.values(), *starting, reading},
                                         return_when=asyncio.FIRST_COMPLETED)
            if woken[0].done():
                woken[0] = asyncio.get_running_loop().create_future()
            events = []
            for fiber_id, written in [(i, t) for i, t in results.items() if t in done]:
                del results[fiber_id]  # sent before its exit event, which ends it
                if (event := written.result()) is not None:
                    events.append(ok_reply(rid, event, "result", final=False))
            news, ended[:] = list(ended), []
            for fiber, end in news:
                del waiting[fiber.id]
                if fiber.id in results:  # its exit event carries the result: no later one
                    results.pop(fiber.id).cancel()
                events.append(ok_reply(rid, end.to_json(), "exit", final=False))
            if window is not None:  # (``exited`` told it of the ends already)
                landed, entries = window.land(done, len(waiting))
                for fiber in landed:
                    watch(fiber)
                window.launch(len(waiting))  # the next starts go out before the events
                if entries:
                    events.append(ok_reply(rid, BatchStarted(entries).to_json(), "started",
                                           final=False))
            if events:
                events[-1]["final"] = not (waiting or (window is not None and window.pending))
                try:
                    await conn.send(*events)
                except PeerGone:  # found by the write, not by a read: the same hang-up
                    if not events[-1]["final"]:
                        raise gone(Event.HANG_UP) from None
                    raise
            if reading not in done:
                continue
            conn.pending_read = None
            try:
                stray = reading.result()
            except FramingError:
                raise gone(Event.BROKEN_FRAME) from None
            if stray is None:
                raise gone(Event.HANG_UP)
            await stream_control(conn, rid, stray, window)
    finally:
        for task in results.values():
            task.cancel()


async def stream_control(conn: _Connection, rid: int | str | None, frame: Frame,
                         window: BatchWindow | None) -> None:
    """A frame that came while a stream runs: a ``cancel`` of the streaming windowed
    batch is answered with its ``cancelled`` event; anything else with busy."""
    action = conn.hear(frame, 0)
    frame.close_fds()
    if action is Action.CANCEL and window is not None:
        keys = window.cancel()
        await conn.send(ok_reply(rid, Cancelled(keys).to_json(), "cancelled", final=False))
        return
    await conn.refuse(request_id(frame.body), None, ApiError(
        ErrorCode.BUSY, "this connection is waiting for a fiber; use another one"))


def hang_up(conn: _Connection, fiber: FiberHandle) -> None:
    """SIGHUP ``fiber`` for its client, who left (a fiber already gone is logged, no more)."""
    assert conn.peer is not None
    try:
        conn.server.service.signal_fiber(fiber.id, signal.SIGHUP, conn.peer)
    except Exception as e:  # the fiber may be gone already; nothing to do then
        log.info("hang-up of fiber %s: %s", fiber.id, e)
