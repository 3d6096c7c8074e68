"""A connection's Clone streams: a Clone or batch started, then its fibers' exits streamed.

``Streams`` belongs to one connection and answers its ``clone`` and ``clone_batch``
requests (docs/socket-protocol.md): the fibers are started through the Service and
answered in one ``started`` event (each batch item's outcome in order: fiber, miss or
error, a refused item counted and audited); with ``wait``, each fiber's ``exit`` event
follows as it ends, the last one final, and with ``early`` a call fiber's ``result``
event before it. A windowed batch starts only ``window`` items at first and the rest as
fibers end (``window.BatchWindow``), each answered in a later ``started`` event, or is
handed whole to the runtime's task window (``window_stream``); another user's windows
hold at most ``max_window_fds_per_uid`` descriptors for items not started (``busy``
past it). While a stream runs, a ``cancel`` of its windowed batch is answered with the
``cancelled`` event and any other frame with ``busy``. A client that leaves mid-stream
has its fibers still running hung up (SIGHUP) when the Clone asked for ``hangup``, and
the wait is abandoned (a window's items not started never start). The connection
keeps the frame I/O, the deadlines and the conversation table these streams feed.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from functools import partial
from typing import TYPE_CHECKING, Any

from slurm_fiber.core.api.answers import (
    PeerGone,
    Refusal,
    api_error,
    miss_reply,
    out_of_fds,
)
from slurm_fiber.core.api.conversation import Action, Event, State, Violation
from slurm_fiber.core.api.service import FiberExit, FiberHandle, Forked, Stdio
from slurm_fiber.core.api.window import BatchWindow, Outcome, Pending, stdio_fds
from slurm_fiber.core.api.window_stream import stream_window, window_requests
from slurm_fiber.core.book.misses import Miss
from slurm_fiber.core.waiting import set_done
from slurm_fiber.protocol import requests as rq
from slurm_fiber.protocol.framing import Frame, FramingError, close_all
from slurm_fiber.protocol.replies import BatchStarted, Cancelled
from slurm_fiber.protocol.validate import (
    ApiError,
    BatchItem,
    ErrorCode,
    ok_reply,
    request_id,
)

if TYPE_CHECKING:
    from slurm_fiber.core.api.server import _Connection

log = logging.getLogger(__name__)


class Streams:
    """The Clone, batch, window and exit streams of one connection (module doc)."""

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn
        self.server = conn.server

    async def clone(self, rid: int | str | None, op: rq.Clone, frame: Frame) -> None:
        server = self.server
        assert self.conn.peer is not None
        started_at = server.clock.mono()
        stdio = Stdio(**dict(zip(op.stdio, frame.fds, strict=True)))
        try:
            outcome = await server.service.clone(op, self.conn.peer, stdio)
        finally:
            frame.close_fds()
        elapsed = server.clock.mono() - started_at
        if isinstance(outcome, Miss):
            server.metrics.clone_missed(outcome.code, elapsed)
            await self.conn.send(miss_reply(rid, outcome))
            return
        record = outcome.to_json()
        server.metrics.clone_started(elapsed, str(record.get("uid", "")))
        await self.send_started(ok_reply(rid, {"fiber": record}, "started", final=not op.wait),
                                [outcome], op.hangup)
        if op.wait:
            await self.stream_exits(rid, [outcome], op.hangup, op.early)

    async def clone_batch(self, rid: int | str | None, op: rq.CloneBatch, frame: Frame) -> None:
        """Start the batch's valid items through the Service; answer one ``started`` event
        with every item's outcome (fiber, miss or error) in order, then, with ``wait``, each
        started fiber's ``exit`` event (the last one final). With a ``window`` (v5), only
        that many start at first; the rest start as those end (``BatchWindow``), each
        answered in a later ``started`` event."""
        server = self.server
        assert self.conn.peer is not None
        self.conn.windowed = op.window is not None
        started_at = server.clock.mono()
        valid: list[BatchItem] = []
        requests: list[rq.Clone] = []
        stdios: list[Stdio] = []
        fds = iter(frame.fds)
        for item in op.items:
            passed = {name: next(fds) for name in item.stdio}  # a refused item's too
            clone = item.clone
            if clone is None:
                continue
            valid.append(item)
            requests.append(clone)
            stdios.append(Stdio(**passed))
        if op.window is not None:
            await self.windowed_batch(rid, op, frame, valid, requests, stdios)
            return
        try:
            outcomes = (list(await server.service.clone_batch(requests, self.conn.peer, stdios))
                        if valid else [])
        finally:
            frame.close_fds()
        if len(outcomes) != len(valid):
            raise RuntimeError(f"the runtime answered {len(outcomes)} of {len(valid)} items")
        elapsed = server.clock.mono() - started_at
        by_item = dict(zip((id(i) for i in valid), outcomes, strict=True))
        entries: list[dict[str, object]] = []
        fibers: list[FiberHandle] = []
        for item in op.items:
            outcome = by_item.get(id(item))
            if item.error is not None:
                entries.append(self.refused_item(rid, item.key, api_error(item.error)))
                continue
            assert outcome is not None
            entries.append(self.item_entry(rid, item.key, outcome, elapsed))
            if not isinstance(outcome, Miss | Exception):
                fibers.append(outcome)
        streams = op.wait and bool(fibers)
        await self.send_started(ok_reply(rid, BatchStarted(entries).to_json(), "started",
                                         final=not streams), fibers, op.hangup)
        if streams:
            await self.stream_exits(rid, fibers, op.hangup, op.early)

    async def windowed_batch(self, rid: int | str | None, op: rq.CloneBatch, frame: Frame,
                             valid: list[BatchItem], requests: list[rq.Clone],
                             stdios: list[Stdio]) -> None:
        """``clone_batch`` with a ``window``: the refused items and the first ``window``
        starts answered in the first ``started`` event, later starts in later ones, as
        ``stream_exits`` refills the window."""
        server, count, peer = self.server, len(op.items), self.conn.peer
        assert peer is not None
        opener = getattr(server.service, "open_window", None)  # the runtime's task windows
        if opener is not None and window_requests(requests, stdios):
            run = await opener(requests, peer, stdios, [str(item.key) for item in valid],
                               op.window or 1)
            if run is not None:  # the runtime took the batch as a task window
                if not isinstance(run, Miss):
                    frame.fds.clear()  # handed to the template and closed
                frame.close_fds()
                refused = [self.refused_item(rid, item.key, api_error(item.error))
                           for item in op.items if item.error is not None]
                if isinstance(run, Miss):
                    refused += [{"key": item.key, "ok": False, "miss": run.to_json()}
                                for item in valid]
                if not isinstance(run, Miss):  # the stream begins: it reads frames from here
                    self.conn.talk.on(Event.STARTED_WINDOW)
                await stream_window(self.conn, rid, run, refused, PeerGone)
                return
        kept = {fd for stdio in stdios for fd in stdio_fds(stdio)}
        server.hold_window_fds(peer, len(kept))  # raises ApiError (busy) past the cap
        close_all(fd for fd in frame.fds if fd not in kept)  # the refused items'
        frame.fds.clear()  # the others' are the window's now, closed once answered
        entries = [self.refused_item(rid, item.key, api_error(item.error))
                   for item in op.items if item.error is not None]

        took: dict[str, float] = {}  # each start's seconds, by key, for its entry

        async def start(item: Pending, forked: Forked) -> Outcome:
            begun = server.clock.mono()
            outcome = (await server.service.clone_batch([item.request], peer, [item.stdio],
                                                        batch=count, forked=forked))[0]
            took[item.key] = server.clock.mono() - begun
            return outcome

        window = BatchWindow(
            [Pending(n, str(item.key), request, stdio)
             for n, (item, request, stdio) in enumerate(zip(valid, requests, stdios,
                                                            strict=True))],
            op.window or 1, start,
            lambda key, outcome: self.item_entry(rid, key, outcome, took.pop(key, 0.0)),
            partial(server.release_window_fds, peer))
        try:
            fibers, started = window.land(await window.launch_first(), 0)
            entries += started
            more = bool(fibers) or window.pending
            await self.send_started(ok_reply(rid, BatchStarted(entries).to_json(), "started",
                                             final=not more),
                                    [*fibers, *window.started_unanswered()], op.hangup)
            if more:
                await self.stream_exits(rid, fibers, op.hangup, op.early, window)
        finally:
            window.close()

    async def send_started(self, message: dict[str, object], fibers: list[FiberHandle],
                           hangup: bool) -> None:
        """Send a clone's first ``started`` event; a client gone by then has ``fibers``
        hung up when the stream would have (the table's hang-up in a stream)."""
        try:
            await self.conn.send(message)
        except PeerGone:
            if self.conn.talk.state is not State.CLOSED and self.conn.talk.on(
                    Event.HANG_UP) is Action.HANG_UP_FIBERS and hangup:
                for fiber in fibers:
                    self.hang_up(fiber)
            raise

    def refused_item(self, rid: int | str | None, key: str | None,
                     error: ApiError) -> dict[str, object]:
        """The ``started`` entry of an item refused alone (counted and audited)."""
        self.server.refusal(Refusal(error.code.value, error.reason, self.conn.peer,
                                    "clone_batch", rid))
        return {"key": key, "ok": False, "error": error.to_json()}

    def item_entry(self, rid: int | str | None, key: str | None, outcome: Outcome,
                   elapsed: float) -> dict[str, object]:
        """The ``started`` entry of an item the Service answered (counted; an item the
        runtime failed on is answered ``internal``, audited as a refusal)."""
        metrics = self.server.metrics
        if isinstance(outcome, Miss):
            metrics.clone_missed(outcome.code, elapsed)
            return {"key": key, "ok": False, "miss": outcome.to_json()}
        if isinstance(outcome, Exception) and out_of_fds(outcome):
            reason = f"fiberd is out of file descriptors ({outcome}); retry later"
            self.server.fd_log.warn(f"a clone_batch item from {self.conn.peer} failed: {reason}")
            return self.refused_item(rid, key, ApiError(ErrorCode.BUSY, reason))
        if isinstance(outcome, Exception):
            error = ApiError(ErrorCode.INTERNAL, f"fiberd failed on this item: "
                             f"{type(outcome).__name__}: {outcome}")
            return self.refused_item(rid, key, error)
        record = outcome.to_json()
        metrics.clone_started(elapsed, str(record.get("uid", "")))
        return {"key": key, "ok": True, "fiber": record}

    async def cancel(self, rid: int | str | None, _op: rq.Cancel, _frame: Frame) -> None:
        """Never called: the conversation takes every cancel (``hear``): ignored between
        requests, answered in a windowed batch's stream, refused busy in another."""
        raise Violation(f"cancel {rid!r} dispatched as a request")

    async def stream_exits(self, rid: int | str | None, fibers: list[FiberHandle],
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
            if self.conn.talk.on(event) is Action.HANG_UP_FIBERS and hangup:
                for fiber in [*waiting.values(),
                              *(window.started_unanswered() if window else ())]:
                    self.hang_up(fiber)
            return PeerGone("client left while its fibers ran")

        for fiber in fibers:
            watch(fiber)
        if window is not None:
            window.woken = lambda: set_done(woken[0])
            window.launch(len(waiting))
        try:
            while waiting or (window is not None and window.pending):
                reading = self.conn.next_frame()
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
                        await self.conn.send(*events)
                    except PeerGone:  # found by the write, not by a read: the same hang-up
                        if not events[-1]["final"]:
                            raise gone(Event.HANG_UP) from None
                        raise
                if reading not in done:
                    continue
                self.conn.pending_read = None
                try:
                    stray = reading.result()
                except FramingError:
                    raise gone(Event.BROKEN_FRAME) from None
                if stray is None:
                    raise gone(Event.HANG_UP)
                await self.stream_control(rid, stray, window)
        finally:
            for task in results.values():
                task.cancel()

    async def stream_control(self, rid: int | str | None, frame: Frame,
                             window: BatchWindow | None) -> None:
        """A frame that came while a stream runs: a ``cancel`` of the streaming windowed
        batch is answered with its ``cancelled`` event; anything else with busy."""
        action = self.conn.hear(frame, 0)
        frame.close_fds()
        if action is Action.CANCEL and window is not None:
            keys = window.cancel()
            await self.conn.send(ok_reply(rid, Cancelled(keys).to_json(), "cancelled", final=False))
            return
        await self.conn.refuse(request_id(frame.body), None, ApiError(
            ErrorCode.BUSY, "this connection is waiting for a fiber; use another one"))

    def hang_up(self, fiber: FiberHandle) -> None:
        assert self.conn.peer is not None
        try:
            self.server.service.signal_fiber(fiber.id, signal.SIGHUP, self.conn.peer)
        except Exception as e:  # the fiber may be gone already; nothing to do then
            log.info("hang-up of fiber %s: %s", fiber.id, e)
