"""A connection's Clone and batch requests: the fibers started, then their stream.

``Streams`` belongs to one connection and answers its ``clone`` and ``clone_batch``
requests (docs/socket-protocol.md): the fibers are started through the Service and
answered in one ``started`` event (each batch item's outcome in order: fiber, miss or
error, a refused item counted and audited); with ``wait``, their exit events follow
(exits.py). A windowed batch starts only ``window`` items at first and the rest as
fibers end (``window.BatchWindow``), or is handed whole to the runtime's task window
(window_stream.py); another user's windows hold at most ``max_window_fds_per_uid``
descriptors for items not started (``busy`` past it). The connection keeps the frame
I/O, the deadlines and the conversation table these requests feed.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

from slurm_fiber.core.api.answers import (
    PeerGone,
    Refusal,
    api_error,
    miss_reply,
    out_of_fds,
)
from slurm_fiber.core.api.conversation import Event, Violation
from slurm_fiber.core.api.exits import send_started, stream_exits
from slurm_fiber.core.api.service import FiberHandle, Forked, Stdio
from slurm_fiber.core.api.window import BatchWindow, Outcome, Pending, stdio_fds
from slurm_fiber.core.api.window_stream import stream_window, window_requests
from slurm_fiber.core.book.misses import Miss
from slurm_fiber.protocol import requests as rq
from slurm_fiber.protocol.framing import Frame, close_all
from slurm_fiber.protocol.replies import BatchStarted
from slurm_fiber.protocol.validate import (
    ApiError,
    BatchItem,
    ErrorCode,
    ok_reply,
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
        await send_started(self.conn,
                           ok_reply(rid, {"fiber": record}, "started", final=not op.wait),
                           [outcome], op.hangup)
        if op.wait:
            await stream_exits(self.conn, rid, [outcome], op.hangup, op.early)

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
        await send_started(self.conn, ok_reply(rid, BatchStarted(entries).to_json(), "started",
                                               final=not streams), fibers, op.hangup)
        if streams:
            await stream_exits(self.conn, rid, fibers, op.hangup, op.early)

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
            # fiberd holds a call's result channel from the window's opening to its end:
            # counted as a batch's held descriptors (busy past the cap) while the window runs
            channels = sum(request.call is not None for request in requests)
            server.hold_window_fds(peer, channels)
            try:
                run = await opener(requests, peer, stdios, [str(item.key) for item in valid],
                                   op.window or 1)
            except BaseException:
                server.release_window_fds(peer, channels)
                raise
            if run is None:
                server.release_window_fds(peer, channels)
            else:  # the runtime took the batch as a task window
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
                try:
                    await stream_window(self.conn, rid, run, refused, PeerGone, op.early)
                finally:
                    server.release_window_fds(peer, channels)
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
            await send_started(self.conn,
                               ok_reply(rid, BatchStarted(entries).to_json(), "started",
                                        final=not more),
                               [*fibers, *window.started_unanswered()], op.hangup)
            if more:
                await stream_exits(self.conn, rid, fibers, op.hangup, op.early, window)
        finally:
            window.close()

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
