"""fiberd's local socket server: accepts, checks peers, frames, validates, dispatches.

``ApiServer`` serves one Unix socket on the running asyncio loop. Each
connection is checked with SO_PEERCRED before anything is read (allowed:
the daemon's own uid and root unless configured; ``allowed_gids`` admit a
primary or, by SO_PEERGROUPS, a supplementary group), then carries one request
at a time: a request gets exactly one reply, except a ``clone`` with
``wait`` which gets a ``started`` event and, later, an ``exit`` event. Every
malformed or refused request gets an error reply with a code and a one-line
reason, is counted in the metrics and reported to the ``audit`` callback;
nothing a client sends can stop the server or reach another connection.
Idle clients, clients that stall mid-frame and clients that stop reading
replies are disconnected on deadlines kept on the injected Clock.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import enum
import logging
import math
import os
import signal
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from slurm_fiber.core.api.framing import (
    DEFAULT_MAX_FRAME,
    MAX_FDS,
    Frame,
    FrameDecoder,
    FramingError,
    encode_frame,
)
from slurm_fiber.core.api.protocol import (
    ApiError,
    CloneOp,
    ErrorCode,
    FiberOp,
    PlainOp,
    Request,
    SignalOp,
    StopOp,
    error_reply,
    miss_reply,
    ok_reply,
    parse_request,
    peer_allowed,
    request_id,
)
from slurm_fiber.core.api.service import (
    CloneRequest,
    FiberHandle,
    FiberNotFound,
    JsonMap,
    Peer,
    Service,
    Stdio,
)
from slurm_fiber.core.api.sockfile import ClaimedSocket, claim_socket, peer_groups
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.metrics import CONTENT_TYPE, FiberMetrics
from slurm_fiber.core.misses import Miss

log = logging.getLogger(__name__)

MAX_REPLY = 16 << 20  # replies (fiber lists) may be larger than requests
_RECV_SIZE = 65536
_ANC_SIZE = socket.CMSG_SPACE(16 * array.array("i").itemsize)  # room to see "too many"
_PEERCRED = struct.Struct("3i")


@dataclass(frozen=True)
class ServerConfig:
    """Where and how to serve. ``allowed_uids`` None means {the daemon's uid, root}."""

    path: Path
    mode: int = 0o600
    allowed_uids: frozenset[int] | None = None
    allowed_gids: frozenset[int] = frozenset()
    max_frame: int = DEFAULT_MAX_FRAME
    max_connections: int = 256
    idle_timeout: float = 300.0  # no request started for this long: disconnect
    frame_timeout: float = 10.0  # a started frame not finished within this: disconnect
    write_timeout: float = 10.0  # a reply not taken by the client within this: disconnect

    def uids(self) -> frozenset[int]:
        if self.allowed_uids is not None:
            return self.allowed_uids
        return frozenset({os.getuid(), 0})


@dataclass(frozen=True)
class Refusal:
    """One refused request or connection, as given to the audit callback."""

    code: str
    reason: str
    peer: Peer | None
    op: str | None = None
    request_id: int | str | None = None


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


class PeerGone(Exception):
    """The client closed the connection or stopped taking data."""


def _mark_ready(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _received_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - len(data) % arr.itemsize])
            fds.extend(arr)
    return fds


class _Connection:
    """One accepted client. Runs as one task; its watchdog cancels it on a deadline."""

    def __init__(self, server: ApiServer, sock: socket.socket) -> None:
        self.server = server
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.decoder = FrameDecoder(server.config.max_frame)
        self.peer: Peer | None = None
        self.phase = Phase.IDLE
        self.since = server.clock.mono()
        self.phase_changed = asyncio.Event()
        self.watching_until = math.inf  # the deadline the watchdog is waiting for
        self.pending_read: asyncio.Task[Frame | None] | None = None
        self.task: asyncio.Task[None] | None = None

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
        self.server.refusal(Refusal(ErrorCode.TIMEOUT.value, reason, self.peer))
        self.send_nowait(error_reply(None, ApiError(ErrorCode.TIMEOUT, reason)))
        if self.task is not None:
            self.task.cancel()

    # --- I/O -----------------------------------------------------------------------------

    async def _wait_readable(self) -> None:
        fut: asyncio.Future[None] = self.loop.create_future()
        self.loop.add_reader(self.sock.fileno(), _mark_ready, fut)
        try:
            await fut
        finally:
            self.loop.remove_reader(self.sock.fileno())

    async def _read_frame(self) -> Frame | None:
        """The next frame, None at end of stream. Raises FramingError."""
        while True:
            frame = self.decoder.next_frame()
            if frame is not None:
                return frame
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
            if self.phase is Phase.IDLE and self.decoder.mid_frame:
                self.set_phase(Phase.READING)

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

    async def send(self, message: dict[str, object]) -> None:
        """Send one reply; raises PeerGone when the client is gone."""
        data = self._encode(message)
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

    async def run(self) -> None:
        watchdog = asyncio.ensure_future(self.watchdog())
        try:
            pid, uid, gid = _PEERCRED.unpack(
                self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            self.peer = Peer(pid=pid, uid=uid, gid=gid)
            config = self.server.config
            if not (peer_allowed(self.peer, config.uids(), config.allowed_gids)
                    or (config.allowed_gids and config.allowed_gids & peer_groups(self.sock))):
                await self.refuse(None, None, ApiError(
                    ErrorCode.FORBIDDEN,
                    f"uid {uid} (gid {gid}) may not use this fiberd; ask its owner to allow it"))
                return
            await self.serve_requests()
        except PeerGone:
            pass
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
                await self.refuse(None, None, ApiError(ErrorCode(e.code), e.reason))
                return
            if frame is None:
                return
            self.set_phase(Phase.BUSY)
            try:
                await self.handle(frame)
            finally:
                frame.close_fds()

    async def refuse(self, rid: int | str | None, op: str | None, error: ApiError) -> None:
        self.server.refusal(Refusal(error.code.value, error.reason, self.peer, op, rid))
        await self.send(error_reply(rid, error))

    async def handle(self, frame: Frame) -> None:
        """Answer one frame: validate it, ask the service, reply. Only PeerGone escapes."""
        rid = request_id(frame.body)
        op_name = frame.body.get("op") if isinstance(frame.body, dict) else None
        op_name = op_name if isinstance(op_name, str) else None
        try:
            if frame.error is not None:
                raise ApiError(ErrorCode.BAD_FRAME, frame.error)
            if frame.fds_truncated:
                raise ApiError(ErrorCode.BAD_FDS, f"too many descriptors; at most {MAX_FDS}")
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
            log.exception("op %s from %s failed", op_name, self.peer)
            await self.refuse(rid, op_name, ApiError(
                ErrorCode.INTERNAL, f"fiberd failed on this request: {type(e).__name__}: {e}"))

    async def dispatch(self, request: Request, frame: Frame) -> None:
        service, op, rid = self.server.service, request.op, request.id
        assert self.peer is not None
        result: JsonMap
        if isinstance(op, CloneOp):
            await self.clone(rid, op, frame)
            return
        if isinstance(op, FiberOp):
            result = {"fiber": dict(service.inspect_fiber(op.fiber))}
        elif isinstance(op, StopOp):
            result = {"fiber": dict(await service.stop_fiber(op.fiber, op.grace, self.peer))}
        elif isinstance(op, SignalOp):
            result = {"delivered": bool(service.signal_fiber(op.fiber, op.signum, self.peer))}
        else:
            result = self.server.plain_result(op)
        await self.send(ok_reply(rid, result))

    async def clone(self, rid: int | str | None, op: CloneOp, frame: Frame) -> None:
        server = self.server
        assert self.peer is not None
        started_at = server.clock.mono()
        request = CloneRequest(peer=self.peer, call=op.call, exec=op.exec, grant=op.grant,
                               token=op.token, env=op.env)
        stdio = Stdio(**dict(zip(op.stdio, frame.fds, strict=True)))
        try:
            outcome = await server.service.clone(request, stdio)
        finally:
            frame.close_fds()
        elapsed = server.clock.mono() - started_at
        if isinstance(outcome, Miss):
            server.metrics.clone_missed(outcome.code, elapsed)
            await self.send(miss_reply(rid, outcome))
            return
        server.metrics.clone_started(elapsed)
        await self.send(ok_reply(rid, {"fiber": outcome.to_json()}, "started", final=not op.wait))
        if op.wait:
            await self.stream_exit(rid, outcome, op.hangup)

    async def stream_exit(self, rid: int | str | None, fiber: FiberHandle, hangup: bool) -> None:
        """Wait for the fiber's exit and send it; meanwhile answer stray frames with busy.

        A client that disconnects first gets its fiber a SIGHUP when ``hangup``
        (as a terminal hang-up would), and the wait is abandoned.
        """
        exited = asyncio.ensure_future(fiber.wait())
        try:
            while True:
                reading = self.next_frame()
                await asyncio.wait({exited, reading}, return_when=asyncio.FIRST_COMPLETED)
                if exited.done():
                    await self.send(ok_reply(rid, exited.result().to_json(), "exit"))
                    return
                self.pending_read = None
                try:
                    stray = reading.result()
                except FramingError:
                    stray = None
                if stray is None:
                    if hangup:
                        self.hang_up(fiber)
                    raise PeerGone("client left while its fiber ran")
                stray.close_fds()
                await self.refuse(request_id(stray.body), None, ApiError(
                    ErrorCode.BUSY, "this connection is waiting for a fiber; use another one"))
        finally:
            exited.cancel()

    def hang_up(self, fiber: FiberHandle) -> None:
        assert self.peer is not None
        try:
            self.server.service.signal_fiber(fiber.id, signal.SIGHUP, self.peer)
        except Exception as e:  # the fiber may be gone already; nothing to do then
            log.info("hang-up of fiber %s: %s", fiber.id, e)


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
        self.metrics = metrics or FiberMetrics(service.fibers_running)
        self.audit = audit
        self.closing = False
        self._claimed: ClaimedSocket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def connections(self) -> int:
        """How many client connections are open now."""
        return len(self._connections)

    async def start(self) -> None:
        """Claim the socket path and begin accepting. Raises SocketPathError."""
        self._claimed = claim_socket(self.config.path, self.config.mode)
        self._accepting = asyncio.ensure_future(self._accept_loop(self._claimed.sock))

    async def close(self) -> None:
        """Stop accepting, drop every connection, remove the socket. Idempotent."""
        self.closing = True
        tasks = [t for t in (self._accepting, *self._connections) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._claimed is not None:
            self._claimed.release()

    def refusal(self, refusal: Refusal) -> None:
        """Count and audit one refusal; an audit callback failure is logged, not raised."""
        self.metrics.refused(refusal.code)
        try:
            self.audit(refusal)
        except Exception:
            log.exception("audit callback failed for %s", refusal)

    def plain_result(self, op: PlainOp) -> JsonMap:
        """The answer to an op that takes no fields."""
        service = self.service
        match op.name:
            case "list_fibers":
                return {"fibers": [dict(f) for f in service.list_fibers()]}
            case "list_grants":
                return {"grants": [dict(g) for g in service.list_grants()]}
            case "status":
                return service.status()
            case "health":
                return service.health()
            case "ready":
                return {"ready": bool(service.ready())}
            case _:
                return {"content_type": CONTENT_TYPE, "text": self.metrics.render()}

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as e:  # EMFILE and friends: back off briefly, keep serving
                log.warning("accept failed: %s", e)
                await self.clock.sleep(0.05)
                continue
            sock.setblocking(False)
            conn = _Connection(self, sock)
            if len(self._connections) >= self.config.max_connections:
                reason = f"fiberd has {len(self._connections)} connections open; retry later"
                self.refusal(Refusal(ErrorCode.BUSY.value, reason, None))
                conn.send_nowait(error_reply(None, ApiError(ErrorCode.BUSY, reason)))
                sock.close()
                continue
            conn.task = asyncio.ensure_future(conn.run())
            self._connections.add(conn.task)
            conn.task.add_done_callback(self._connections.discard)
