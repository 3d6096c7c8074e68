"""fiberd's local socket server: accepts, checks peers, frames, validates, dispatches.

``ApiServer`` serves one Unix socket on the running asyncio loop. Each
connection is checked with SO_PEERCRED before anything is read (allowed:
the daemon's own uid and root unless configured; ``allowed_gids`` admit a
primary or, by SO_PEERGROUPS, a supplementary group), then carries one request
at a time: a request gets exactly one reply, except a ``clone`` or
``clone_batch`` with ``wait``, which gets ``started`` events and, later, an
``exit`` event per fiber (a windowed batch starts the rest of its items as its
fibers end, ``window.BatchWindow``), and a ``cancel`` of such a batch, answered
in its stream (outside one, with nothing to cancel, it gets no reply). Every
malformed or refused request gets an error reply with a code and a one-line
reason, is counted in the metrics and reported to the ``audit`` callback;
nothing a client sends can stop the server or reach another connection.
Idle clients, clients that stall mid-frame and clients that stop reading
replies are disconnected on deadlines kept on the injected Clock. Each
connection (``_Connection``) reads and writes frames, keeps those deadlines,
follows the conversation table (conversation.py) and dispatches each request by
its row in ``OPS``; its Clone and batch requests are its ``Streams`` (streams.py),
their exit events exits.py's.

Admission (docs/socket-protocol.md, "Connection limits"): the peer is read
and checked at accept, before the connection takes a slot. A uid other than
fiberd's own and root ("another user") may hold at most
``max_connections_per_uid`` connections, and other users together at most
``max_connections - owner_reserve``, so no number of idle connections from
other users can lock fiberd's own user out. When every slot is taken, or
accept fails for want of file descriptors (EMFILE/ENFILE), fiberd sheds the
longest-idle connection of the uid holding the most (another user may shed
only its own or a heavier uid's) to let the newcomer in, or answers the
newcomer ``busy``; a spare descriptor is kept for exactly that, so a full fd
table never leaves a client unanswered and accept never spins. Running out
of descriptors is logged as one line per minute at most. Another user's
windowed batches may hold at most ``max_window_fds_per_uid`` descriptors for
items not started yet (a window keeps them as long as it runs); a batch past
that is refused ``busy``.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import enum
import errno
import inspect
import logging
import math
import os
import socket
import struct
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from slurm_fiber.core.api.answers import OUT_OF_FDS, PeerGone, out_of_fds
from slurm_fiber.core.api.answers import Refusal as Refusal  # still importable from here
from slurm_fiber.core.api.conversation import Action, Conversation, Event, State, Violation
from slurm_fiber.core.api.service import (
    FiberNotFound,
    Peer,
    Service,
)
from slurm_fiber.core.api.sockfile import ClaimedSocket, claim_socket, peer_groups
from slurm_fiber.core.api.streams import Streams
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.metrics.families import CONTENT_TYPE, FiberMetrics
from slurm_fiber.protocol import requests as rq
from slurm_fiber.protocol.framing import (
    Frame,
    FrameDecoder,
    FramingError,
    encode_frame,
)
from slurm_fiber.protocol.limits import DEFAULT_MAX_FRAME, MAX_BATCH_FDS, MAX_REPLY
from slurm_fiber.protocol.validate import (
    TABLE,
    ApiError,
    ErrorCode,
    Parsed,
    error_reply,
    max_fds,
    ok_reply,
    parse_request,
    request_id,
)

log = logging.getLogger(__name__)

_RECV_SIZE = 65536
_ANC_SIZE = socket.CMSG_SPACE((MAX_BATCH_FDS + 1) * array.array("i").itemsize)  # room to
# see "too many" (each descriptor received is closed unless its frame may carry it)
_PEERCRED = struct.Struct("3i")


def peer_allowed(peer: Peer, uids: frozenset[int], gids: frozenset[int]) -> bool:
    """Whether a connecting peer may talk to fiberd: its uid or its primary gid is listed."""
    return peer.uid in uids or peer.gid in gids


_ACCEPT_BACKOFF = (0.05, 1.0)  # first and longest pause when accept cannot get a descriptor
LOG_EVERY = 60.0  # seconds between two log lines about running out of descriptors


@dataclass(frozen=True)
class ServerConfig:
    """Where and how to serve. ``allowed_uids`` None means {the daemon's uid, root}."""

    path: Path
    mode: int = 0o600
    allowed_uids: frozenset[int] | None = None
    allowed_gids: frozenset[int] = frozenset()
    max_frame: int = DEFAULT_MAX_FRAME
    max_connections: int = 256
    max_connections_per_uid: int = 64  # for each uid other than fiberd's own and root
    owner_reserve: int = 32  # slots only fiberd's own uid and root may take
    idle_timeout: float = 300.0  # no request started for this long: disconnect
    frame_timeout: float = 10.0  # a started frame not finished within this: disconnect
    write_timeout: float = 10.0  # a reply not taken by the client within this: disconnect
    max_window_fds_per_uid: int = 256  # descriptors another user's windowed batches may
    # hold at once for items not started yet (a window holds them for as long as it runs)

    def uids(self) -> frozenset[int]:
        if self.allowed_uids is not None:
            return self.allowed_uids
        return frozenset({os.getuid(), 0})

    def owners(self) -> frozenset[int]:
        """The uids the connection limits never count as "another user": fiberd's own and root."""
        return frozenset({os.getuid(), 0})


class Phase(enum.Enum):
    """What a connection is doing, which decides which deadline applies."""

    IDLE = "idle"  # between requests
    READING = "reading"  # part of a frame received
    WRITING = "writing"  # a reply being sent
    BUSY = "busy"  # the service is working or a fiber is being waited for: no deadline


def phase_deadline(phase: Phase, since: float, config: ServerConfig) -> float | None:
    """When a connection in ``phase`` since ``since`` (monotonic) must be cut; None: never."""
    limit = {
        Phase.IDLE: config.idle_timeout,
        Phase.READING: config.frame_timeout,
        Phase.WRITING: config.write_timeout,
    }.get(phase)
    return None if limit is None else since + limit


def _mark_ready(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def _readable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    """Wait until ``fd`` is readable (or has a connection to accept)."""
    fut: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, _mark_ready, fut)
    try:
        await fut
    finally:
        loop.remove_reader(fd)


def _peer_of(sock: socket.socket) -> Peer:
    """The connected peer's pid, uid and gid (SO_PEERCRED). Raises OSError."""
    pid, uid, gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return Peer(pid=pid, uid=uid, gid=gid)


class RateLimitedLog:
    """Logs a warning at most once per ``every`` seconds (on ``clock``), counting the rest."""

    def __init__(self, clock: Clock, every: float = LOG_EVERY) -> None:
        self.clock = clock
        self.every = every
        self.next_at = -math.inf
        self.suppressed = 0

    def warn(self, message: str) -> bool:
        """Log ``message`` unless one was logged less than ``every`` s ago; True if logged."""
        now = self.clock.mono()
        if now < self.next_at:
            self.suppressed += 1
            return False
        more = f" ({self.suppressed} more since the last such line)" if self.suppressed else ""
        log.warning("%s%s", message, more)
        self.suppressed, self.next_at = 0, now + self.every
        return True


def _received_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - len(data) % arr.itemsize])
            fds.extend(arr)
    return fds


class _Connection:
    """One accepted client: frame I/O, the per-phase deadlines, the conversation, dispatch.

    Runs as one task; its watchdog cancels it on a deadline. Its clone and batch
    requests and their streams are answered by ``self.streams``.
    """

    def __init__(self, server: ApiServer, sock: socket.socket, peer: Peer) -> None:
        self.server = server
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.decoder = FrameDecoder(server.config.max_frame)
        self.peer: Peer | None = peer
        self.shed_reason: str | None = None
        self.phase = Phase.IDLE
        self.since = server.clock.mono()
        self.phase_changed = asyncio.Event()
        self.watching_until = math.inf  # the deadline the watchdog is waiting for
        self.pending_read: asyncio.Task[Frame | None] | None = None
        self.task: asyncio.Task[None] | None = None
        self.talk = Conversation()  # where the conversation is (docs/socket-protocol.md)
        self.windowed = False  # the request answered is a windowed batch
        self.streams = Streams(self)  # its clone and batch requests, and their streams

    # --- deadlines ---------------------------------------------------------------------

    def set_phase(self, phase: Phase) -> None:
        """Enter ``phase`` now; wake the watchdog only if its deadline came closer."""
        self.phase, self.since = phase, self.server.clock.mono()
        deadline = phase_deadline(phase, self.since, self.server.config)
        if deadline is not None and deadline < self.watching_until:
            self.phase_changed.set()

    async def watchdog(self) -> None:
        """Cancel the connection's task when its current phase outlives its deadline."""
        clock, config = self.server.clock, self.server.config
        while True:
            self.phase_changed.clear()
            deadline = phase_deadline(self.phase, self.since, config)
            self.watching_until = math.inf if deadline is None else deadline
            if deadline is None:
                await self.phase_changed.wait()
                continue
            now = clock.mono()
            if now >= deadline:
                break
            sleeping = asyncio.ensure_future(clock.sleep(deadline - now))
            changed = asyncio.ensure_future(self.phase_changed.wait())
            try:
                await asyncio.wait({sleeping, changed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                sleeping.cancel()
                changed.cancel()
        reason = f"connection {self.phase.value} for over {deadline - self.since:g} s; closed"
        self.closing_down()
        self.server.refusal(Refusal(ErrorCode.TIMEOUT.value, reason, self.peer))
        self.send_nowait(error_reply(None, ApiError(ErrorCode.TIMEOUT, reason)))
        if self.task is not None:
            self.task.cancel()

    # --- I/O -----------------------------------------------------------------------------

    async def _wait_readable(self) -> None:
        await _readable(self.loop, self.sock.fileno())

    async def _read_frame(self) -> Frame | None:
        """The next frame, None at end of stream. Raises FramingError.

        The connection is ``reading`` (the frame deadline) only while part of a frame
        waits for the rest, not for a frame that came whole: entering that phase wakes
        the watchdog, which would otherwise happen on every request."""
        while True:
            frame = self.decoder.next_frame()
            if frame is not None:
                return frame
            if self.phase is Phase.IDLE and self.decoder.mid_frame:
                self.set_phase(Phase.READING)
            try:
                data, anc, flags, _ = self.sock.recvmsg(
                    _RECV_SIZE, _ANC_SIZE, socket.MSG_CMSG_CLOEXEC)
            except BlockingIOError:
                await self._wait_readable()
                continue
            except OSError:
                return None
            fds = _received_fds(anc)
            self.decoder.feed(data, fds, truncated=bool(flags & socket.MSG_CTRUNC))
            if not data:
                return None  # end of stream (a partial frame is dropped)

    def next_frame(self) -> asyncio.Task[Frame | None]:
        """The task reading the next frame (one at a time, kept across a stream)."""
        if self.pending_read is None:
            self.pending_read = asyncio.ensure_future(self._read_frame())
        return self.pending_read

    async def take_frame(self) -> Frame | None:
        task = self.next_frame()
        try:
            return await task
        finally:
            if task.done():
                self.pending_read = None

    def _encode(self, message: dict[str, object]) -> bytes:
        try:
            return encode_frame(message, MAX_REPLY)
        except (TypeError, ValueError) as e:
            log.error("reply to %s could not be encoded: %s", self.peer, e)
            err = ApiError(ErrorCode.INTERNAL, f"the reply could not be encoded: {e}")
            return encode_frame(error_reply(message.get("id"), err))  # type: ignore[arg-type]

    async def send(self, *messages: dict[str, object]) -> None:
        """Send replies, in order, in one write (a stream's events of one loop step: one
        wake-up of the client, not one each); raises PeerGone when the client is gone."""
        for message in messages:
            self.said(message)
        data = b"".join(self._encode(message) for message in messages)
        try:
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                sent = 0
            if sent < len(data):  # the client is not keeping up: now a deadline applies
                previous = self.phase
                self.set_phase(Phase.WRITING)
                await self.loop.sock_sendall(self.sock, data[sent:])
                self.set_phase(previous)
        except OSError as e:
            raise PeerGone(str(e)) from e

    def send_nowait(self, message: dict[str, object]) -> None:
        """Best effort, never blocks: used on the way out of a connection."""
        with contextlib.suppress(OSError):
            self.sock.send(self._encode(message), socket.MSG_DONTWAIT)

    # --- the connection's life --------------------------------------------------------

    def shed(self, reason: str) -> None:
        """Close this (idle) connection to make room: a ``busy`` reply, audited, then cancel."""
        self.shed_reason = reason
        self.closing_down()
        self.server.refusal(Refusal(ErrorCode.BUSY.value, reason, self.peer))
        self.send_nowait(error_reply(None, ApiError(ErrorCode.BUSY, reason)))
        if self.task is not None:
            self.task.cancel()

    async def run(self) -> None:
        watchdog = asyncio.ensure_future(self.watchdog())
        try:
            await self.serve_requests()
        except PeerGone:
            if self.talk.state is not State.CLOSED:  # found by a send: the table's hang-up
                self.talk.on(Event.HANG_UP)
        except Exception:  # a defect, not the client: this connection ends, the server carries on
            log.exception("connection from %s failed", self.peer)
        finally:
            watchdog.cancel()
            if self.pending_read is not None:
                self.pending_read.cancel()
                with contextlib.suppress(BaseException):
                    await self.pending_read
            self.decoder.close()
            self.sock.close()

    async def serve_requests(self) -> None:
        while True:
            self.set_phase(Phase.IDLE)
            try:
                frame = await self.take_frame()
            except FramingError as e:
                self.hear(None, broken=True)  # refuse and close
                await self.refuse(None, None, ApiError(ErrorCode(e.code), e.reason))
                return
            if frame is None:
                self.hear(None)  # close
                return
            self.set_phase(Phase.BUSY)
            try:
                await self.handle(frame)
            finally:
                frame.close_fds()
            if self.talk.state is not State.IDLE:  # a request left unanswered, a stream cut
                raise Violation(f"a request ended with the conversation {self.talk.state.value}")

    def hear(self, frame: Frame | None, nfds: int | None = None,
             broken: bool = False) -> Action:
        """Feed what was read to the conversation and return the table's action: ``frame``
        (a cancel when it validates as one, with ``nfds`` descriptors, default its own),
        or None at end of stream (``broken``: a framing error)."""
        if frame is None:
            return self.talk.on(Event.BROKEN_FRAME if broken else Event.HANG_UP)
        cancel = False
        if frame.error is None and not frame.fds_truncated:
            with contextlib.suppress(ApiError):
                cancel = isinstance(parse_request(
                    frame.body, len(frame.fds) if nfds is None else nfds).request, rq.Cancel)
        return self.talk.on(Event.CANCEL if cancel else Event.REQUEST)

    def said(self, message: dict[str, object]) -> None:
        """Feed a reply or event going out to the conversation (a busy refusal during a
        stream, the table's ``busy`` action, and a last word on closing feed nothing)."""
        state, event = self.talk.state, message.get("event")
        if state is State.CLOSED or (event is None and state is not State.ANSWERING):
            return
        if event == "cancelled":
            self.talk.on(Event.CANCELLED)
        elif message.get("final"):
            self.talk.on(Event.REPLY if state is State.ANSWERING else Event.FINAL)
        elif state is State.ANSWERING:
            self.talk.on(Event.STARTED_WINDOW if self.windowed else Event.STARTED)
        else:
            self.talk.on(Event.EXIT)

    def closing_down(self) -> None:
        """fiberd closes this connection (a timeout, shed for room): the table's close."""
        if self.talk.state is not State.CLOSED:
            self.talk.on(Event.CLOSE)

    async def refuse(self, rid: int | str | None, op: str | None, error: ApiError) -> None:
        self.server.refusal(Refusal(error.code.value, error.reason, self.peer, op, rid))
        await self.send(error_reply(rid, error))

    async def handle(self, frame: Frame) -> None:
        """Answer one frame: validate it, ask the service, reply. Only PeerGone escapes."""
        rid = request_id(frame.body)
        op_name = frame.body.get("op") if isinstance(frame.body, dict) else None
        op_name = op_name if isinstance(op_name, str) else None
        if self.hear(frame) is Action.IGNORE:  # a cancel with no windowed batch streaming
            log.debug("cancel %r from %s with no windowed batch streaming", rid, self.peer)
            return
        self.windowed = False
        try:
            if frame.error is not None:
                raise ApiError(ErrorCode.BAD_FRAME, frame.error)
            if frame.fds_truncated:
                raise ApiError(ErrorCode.BAD_FDS,
                               f"too many descriptors; at most {max_fds(op_name)}")
            request = parse_request(frame.body, len(frame.fds))
            if self.server.closing:
                raise ApiError(ErrorCode.CLOSED, "fiberd is shutting down")
            await self.dispatch(request, frame)
        except PeerGone:
            raise
        except ApiError as e:
            await self.refuse(rid, op_name, e)
        except FiberNotFound as e:
            await self.refuse(rid, op_name, ApiError(ErrorCode.NOT_FOUND, str(e)))
        except Exception as e:
            if out_of_fds(e):  # not a defect: retryable (an OSError, or a failed fork's)
                why = e.strerror if isinstance(e, OSError) else str(e)
                reason = f"fiberd is out of file descriptors ({why}); retry later"
                self.server.fd_log.warn(f"op {op_name} from {self.peer} failed: {reason}")
                await self.refuse(rid, op_name, ApiError(ErrorCode.BUSY, reason))
                return
            log.exception("op %s from %s failed", op_name, self.peer)
            await self.refuse(rid, op_name, ApiError(
                ErrorCode.INTERNAL, f"fiberd failed on this request: {type(e).__name__}: {e}"))

    async def dispatch(self, parsed: Parsed, frame: Frame) -> None:
        """Answer a validated request by its type's row in ``OPS``."""
        answer = OPS[type(parsed.request)]
        await answer(self, parsed.id, parsed.request, frame)

    async def answer(self, rid: int | str | None, request: rq.Request, value: Any) -> None:
        """Send ``value`` (what the Service returned, awaited) as ``request``'s reply type."""
        if inspect.isawaitable(value):
            value = await value
        await self.send(ok_reply(rid, TABLE[request.OP].reply.of(value).to_json()))



class ApiServer:
    """Serves a Service on a Unix socket. Create, ``await start()``, later ``await close()``.

    Runs on the loop that calls ``start``. ``audit`` receives every refusal
    (it must not block; its exceptions are logged and ignored).
    """

    def __init__(
        self,
        service: Service,
        config: ServerConfig,
        *,
        clock: Clock,
        metrics: FiberMetrics | None = None,
        audit: Callable[[Refusal], None] = lambda _r: None,
    ) -> None:
        self.service = service
        self.config = config
        self.clock = clock
        self.metrics = metrics or FiberMetrics(service.fibers_running, now=clock.mono)
        self.audit = audit
        self.closing = False
        self._claimed: ClaimedSocket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._open: dict[asyncio.Task[None], _Connection] = {}
        self._reserve: int | None = None  # a spare descriptor, given up to answer at EMFILE
        self._shedding: set[asyncio.Task[None]] = set()  # connections shed, not yet closed
        self._window_fds: Counter[int] = Counter()  # by uid: held for windows' unstarted items
        self.fd_log = RateLimitedLog(clock)

    @property
    def connections(self) -> int:
        """How many client connections are open now."""
        return len(self._open)

    def connections_by_uid(self) -> dict[int, int]:
        """How many connections each peer uid holds now."""
        return dict(Counter(c.peer.uid for c in self._open.values() if c.peer is not None))

    async def start(self) -> None:
        """Claim the socket path: it listens from here on, but connections wait in the
        backlog until ``accept``, so the caller can record its start first. Raises
        SocketPathError."""
        self._claimed = claim_socket(self.config.path, self.config.mode)
        self._take_reserve()

    def accept(self) -> None:
        """Begin accepting on the claimed socket (after ``start``); non-blocking."""
        assert self._claimed is not None, "accept before start"
        self._accepting = asyncio.ensure_future(self._accept_loop(self._claimed.sock))

    async def close(self) -> None:
        """Stop accepting, drop every connection, remove the socket. Idempotent."""
        self.closing = True
        tasks = [t for t in (self._accepting, *self._open) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._claimed is not None:
            self._claimed.release()
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None

    def window_fds_by_uid(self) -> dict[int, int]:
        """How many descriptors each uid's windowed batches hold for items not started."""
        return dict(self._window_fds)

    def hold_window_fds(self, peer: Peer, count: int) -> None:
        """Count ``count`` descriptors a windowed batch of ``peer`` holds for items not
        started yet. Raises ApiError (busy) when another user's would pass
        ``max_window_fds_per_uid`` (fiberd's own uid and root are not limited)."""
        if peer.uid not in self.config.owners():
            held, cap = self._window_fds[peer.uid], self.config.max_window_fds_per_uid
            if held + count > cap:
                raise ApiError(ErrorCode.BUSY, f"uid {peer.uid}'s windowed batches hold {held} "
                               f"descriptors for items not started; at most {cap} wait at "
                               "once: pass fewer, or wait for a batch to end")
        self._window_fds[peer.uid] += count

    def release_window_fds(self, peer: Peer, count: int) -> None:
        """``count`` of ``peer``'s held descriptors were closed."""
        self._window_fds[peer.uid] -= count
        if self._window_fds[peer.uid] <= 0:
            del self._window_fds[peer.uid]

    def refusal(self, refusal: Refusal) -> None:
        """Count and audit one refusal; an audit callback failure is logged, not raised."""
        self.metrics.refused(refusal.code)
        try:
            self.audit(refusal)
        except Exception:
            log.exception("audit callback failed for %s", refusal)

    def metrics_text(self) -> tuple[str, str]:
        """The ``metrics`` op's answer: the content type and the exposition."""
        return CONTENT_TYPE, self.metrics.render()

    # --- accepting and admission ---------------------------------------------------------

    def _take_reserve(self) -> None:
        """Hold the spare descriptor again if it was given up (no-op when fds are still short)."""
        if self._reserve is None:
            with contextlib.suppress(OSError):
                self._reserve = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    async def _accept_loop(self, listener: socket.socket) -> None:
        """Accept forever. Out of descriptors, each round either answers the waiting client
        (with the spare descriptor), sheds one idle connection to get the spare back, or
        sleeps (0.05 s doubling to 1 s): it never spins."""
        loop = asyncio.get_running_loop()
        pause = _ACCEPT_BACKOFF[0]
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                await _readable(loop, listener.fileno())
                continue
            except OSError as e:
                if e.errno not in (*OUT_OF_FDS, errno.ENOBUFS, errno.ENOMEM):
                    log.info("accept failed: %s", e)  # e.g. a client that left (ECONNABORTED)
                    continue
                if e.errno in OUT_OF_FDS and await self._answer_without_fds(listener, e):
                    pause = _ACCEPT_BACKOFF[0]
                    continue
                self.fd_log.warn(f"fiberd cannot accept a connection: {e.strerror}; "
                                 f"pausing accept up to {_ACCEPT_BACKOFF[1]:g} s at a time")
                await self.clock.sleep(pause)
                pause = min(pause * 2, _ACCEPT_BACKOFF[1])
                self._take_reserve()
                continue
            pause = _ACCEPT_BACKOFF[0]
            self._admit(sock, out_of_fds=False)

    async def _answer_without_fds(self, listener: socket.socket, error: OSError) -> bool:
        """Accept hit EMFILE/ENFILE: serve or answer the waiting client with the spare
        descriptor, or (spare taken by another part of fiberd) shed the idlest connection to
        get it back. False when neither was possible (the caller backs off)."""
        if self._reserve is None:
            victim = self._idlest(self.config.owners())
            if victim is None:
                return False
            self._shed(victim, "fiberd is out of file descriptors")
            await self._shed_done()
            self._take_reserve()
            return self._reserve is not None
        os.close(self._reserve)  # one descriptor to answer the waiting client with
        self._reserve = None
        try:
            sock, _ = listener.accept()
        except OSError:
            self._take_reserve()
            return False
        self._out_of_fds(sock, error)
        await self._shed_done()
        self._take_reserve()
        return True

    async def _shed_done(self) -> None:
        """Wait (at most 1 s) until the connections being shed have closed their sockets."""
        if self._shedding:
            await asyncio.wait(set(self._shedding), timeout=_ACCEPT_BACKOFF[1])

    def _out_of_fds(self, sock: socket.socket, error: OSError) -> None:
        """A client accepted with the spare descriptor: let it in by shedding, or answer busy."""
        self.fd_log.warn(
            f"fiberd is out of file descriptors ({errno.errorcode.get(error.errno or 0, '?')}: "
            f"{error.strerror}) with {self.connections} connections open: shedding idle ones "
            "and answering busy; raise its RLIMIT_NOFILE (LimitNOFILE=, ulimit -n)")
        self._admit(sock, out_of_fds=True)

    def _admit(self, sock: socket.socket, *, out_of_fds: bool) -> None:
        """Start serving ``sock``, or answer it (forbidden / busy, audited) and close it.

        Never raises: a failure here costs this one client, never the accept loop.
        """
        try:
            self._admit_or_refuse(sock, out_of_fds)
        except Exception:
            log.exception("admitting a connection failed")
            sock.close()

    def _admit_or_refuse(self, sock: socket.socket, out_of_fds: bool) -> None:
        sock.setblocking(False)
        try:
            peer = _peer_of(sock)
        except OSError:
            sock.close()
            return
        config = self.config
        error: ApiError | None = None
        if not (peer_allowed(peer, config.uids(), config.allowed_gids)
                or (config.allowed_gids and config.allowed_gids & peer_groups(sock))):
            error = ApiError(ErrorCode.FORBIDDEN, f"uid {peer.uid} (gid {peer.gid}) may not use "
                                                  "this fiberd; ask its owner to allow it")
        else:
            busy = self._no_room(peer, out_of_fds)
            if busy is not None:
                error = ApiError(ErrorCode.BUSY, busy)
        if error is not None:
            self.refusal(Refusal(error.code.value, error.reason, peer))
            with contextlib.suppress(OSError):  # a new socket's buffer is empty: never blocks
                sock.send(encode_frame(error_reply(None, error)), socket.MSG_DONTWAIT)
            sock.close()
            return
        conn = _Connection(self, sock, peer)
        conn.task = asyncio.ensure_future(conn.run())
        self._open[conn.task] = conn
        conn.task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        conn = self._open.pop(task, None)
        self._shedding.discard(task)
        if conn is not None:  # a task cancelled before it ran never reached run()'s cleanup
            conn.decoder.close()
            conn.sock.close()
        self._take_reserve()  # a shed connection's descriptor is free again

    def _no_room(self, peer: Peer, out_of_fds: bool) -> str | None:
        """None when ``peer`` may have a connection now (shedding one if need be), else why not."""
        config, owners = self.config, self.config.owners()
        counts = Counter(c.peer.uid for c in self._open.values()
                         if c.peer is not None and c.shed_reason is None)
        if peer.uid not in owners:
            if counts[peer.uid] >= config.max_connections_per_uid:
                return (f"uid {peer.uid} has {counts[peer.uid]} connections open, the most one "
                        "user may hold here; close some")
            others = sum(n for uid, n in counts.items() if uid not in owners)
            if others >= config.max_connections - config.owner_reserve:
                return (f"other users hold {others} connections, all they may share here "
                        f"({config.owner_reserve} are kept for fiberd's own user); retry later")
        if not out_of_fds and sum(counts.values()) < config.max_connections:
            return None
        why = ("fiberd is out of file descriptors" if out_of_fds
               else f"fiberd has {sum(counts.values())} connections open")
        victim = self._shed_candidate(peer, counts)
        if victim is None:
            return f"{why}; retry later"
        self._shed(victim, why)
        return None

    def _shed(self, victim: _Connection, why: str) -> None:
        idle = self.clock.mono() - victim.since
        if victim.task is not None:
            self._shedding.add(victim.task)
        victim.shed(f"{why}: this connection was idle for {idle:.0f} s and was closed to "
                    "make room; reconnect when you have a request")

    def _idlest(self, owners: frozenset[int]) -> _Connection | None:
        """The longest-idle connection of the uid holding the most (another user's first)."""
        counts = Counter(c.peer.uid for c in self._open.values()
                         if c.peer is not None and c.shed_reason is None)
        idle = [c for c in self._open.values()
                if c.phase is Phase.IDLE and c.shed_reason is None and c.peer is not None]
        return min(idle, default=None, key=lambda c: (
            c.peer.uid in owners, -counts[c.peer.uid], c.since))  # type: ignore[union-attr]

    def _shed_candidate(self, peer: Peer, counts: Counter[int]) -> _Connection | None:
        """The idle connection to close for ``peer``: the longest idle of the heaviest uid.

        fiberd's own user and root may shed anyone's idle connection; another
        user only its own or one of a uid holding more connections than it.
        """
        owners = self.config.owners()

        def may_shed(conn: _Connection) -> bool:
            if conn.phase is not Phase.IDLE or conn.shed_reason is not None or conn.peer is None:
                return False
            uid = conn.peer.uid
            return peer.uid in owners or uid == peer.uid or (
                uid not in owners and counts[uid] > counts[peer.uid])

        candidates = [c for c in self._open.values() if may_shed(c)]
        if not candidates:
            return None
        return min(candidates, key=lambda c: (-counts[c.peer.uid], c.since))  # type: ignore[union-attr]


R = TypeVar("R", bound=rq.Request)
Answer = Callable[[_Connection, "int | str | None", Any, Frame], Awaitable[None]]


def _simple(_kind: type[R], answer: Callable[[ApiServer, R, Peer], object]) -> Answer:
    """A row for an op answered by one call (awaited when it returns an awaitable), whose
    value is sent as the op's reply type."""
    async def run(conn: _Connection, rid: int | str | None, request: R, _frame: Frame) -> None:
        assert conn.peer is not None
        await conn.answer(rid, request, answer(conn.server, request, conn.peer))
    return run


def _stream(_kind: type[R],
            method: Callable[[Streams, int | str | None, R, Frame], Awaitable[None]]) -> Answer:
    """A row for an op the connection's ``Streams`` answers (a Clone or batch, a cancel)."""
    async def run(conn: _Connection, rid: int | str | None, request: R, frame: Frame) -> None:
        await method(conn.streams, rid, request, frame)
    return run


# The server's op table: who answers each request type (validate.TABLE reads it).
# Adding an op: its request type (protocol/requests.py), its row in validate.TABLE
# (fields, parser, reply type), its reply type (protocol/replies.py), its row here,
# and the client's typed method (client/connection.py).
OPS: dict[type[rq.Request], Answer] = {
    rq.Clone: _stream(rq.Clone, Streams.clone),
    rq.CloneBatch: _stream(rq.CloneBatch, Streams.clone_batch),
    rq.Cancel: _stream(rq.Cancel, Streams.cancel),
    rq.InspectFiber: _simple(rq.InspectFiber, lambda s, r, _p: s.service.inspect_fiber(r.fiber)),
    rq.StopFiber: _simple(rq.StopFiber, lambda s, r, p: s.service.stop_fiber(r.fiber, r.grace, p)),
    rq.SignalFiber: _simple(rq.SignalFiber,
                            lambda s, r, p: s.service.signal_fiber(r.fiber, int(r.signal), p)),
    rq.ListFibers: _simple(rq.ListFibers,
                           lambda s, r, _p: s.service.list_fibers(r.after, r.limit, r.ended)),
    rq.ListGrants: _simple(rq.ListGrants, lambda s, _r, _p: s.service.list_grants()),
    rq.Status: _simple(rq.Status, lambda s, _r, _p: s.service.status()),
    rq.Health: _simple(rq.Health, lambda s, _r, _p: s.service.health()),
    rq.Ready: _simple(rq.Ready, lambda s, _r, _p: s.service.ready()),
    rq.Metrics: _simple(rq.Metrics, lambda s, _r, _p: s.metrics_text()),
}
assert {kind.OP for kind in OPS} == set(TABLE), "every op of the protocol has its answer here"
