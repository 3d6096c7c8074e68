"""A blocking client for fiberd's socket, for fiberctl, benchmarks and tests.

``FiberdClient`` speaks the protocol of docs/socket-protocol.md over one
connection: a typed method per op of the protocol (``protocol.validate.TABLE``),
named as the op, sending its request type (``protocol/requests.py``) and returning
its reply type (``protocol/replies.py``); ``send_request`` sends any request type;
``clone`` (optionally passing stdio descriptors) followed by ``wait_exit``
for a waited clone; ``request`` for any op by name (its raw result). Every
failure is one of three exceptions a caller can act on: ``Unreachable``
(no fiberd, or the stream broke), ``Refused`` (an error reply: code,
reason) and ``Missed`` (a clone miss: code, reason, retryable). Not
thread-safe: one client per thread.
"""

from __future__ import annotations

import _socket
import os
import stat
import struct
import time

from slurm_fiber.protocol import requests as rq
from slurm_fiber.protocol.framing import FrameDecoder, FramingError, encode_frame
from slurm_fiber.protocol.limits import BATCH_SINCE, MAX_REPLY, STDIO_NAMES, WINDOW_SINCE
from slurm_fiber.protocol.replies import (
    BatchStarted,
    Cancelled,
    Delivered,
    Document,
    Fiber,
    FiberList,
    GrantList,
    Metrics,
    Ready,
)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (fiberctl imports this)
if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence

PAGE_SIZE = 1000  # fiber records per list_fibers page (limits.MAX_PAGE at most)


class Unreachable(Exception):
    """fiberd could not be reached, or the connection broke mid-conversation."""


class Refused(Exception):
    """fiberd refused the request (an error reply)."""

    def __init__(self, error: Mapping[str, object]) -> None:
        self.code = str(error.get("code"))
        self.reason = str(error.get("reason"))
        super().__init__(f"{self.code}: {self.reason}")


class Missed(Exception):
    """A clone started nothing; ``miss`` is the miss record (code, reason, retryable, ...)."""

    def __init__(self, miss: Mapping[str, object]) -> None:
        self.miss = dict(miss)
        self.code = str(miss.get("code"))
        self.reason = str(miss.get("reason"))
        self.retryable = bool(miss.get("retryable"))
        super().__init__(f"{self.code}: {self.reason}")


class FiberdClient:
    """One connection to fiberd. Blocks; ``timeout`` bounds each send and receive
    (None: wait forever), except ``wait_exit`` which waits as long as the fiber runs."""

    def __init__(self, path: str | os.PathLike[str], timeout: float | None = 30.0,
                 sock: _socket.socket | None = None) -> None:
        self.timeout = timeout
        self._decoder = FrameDecoder(MAX_REPLY)
        self._next_id = 0
        self._held: list[dict[str, object]] = []  # stream events read ahead by ``cancel``
        if sock is not None:  # a stream already connected (a relay's end: nodes/link.py)
            self.sock = sock
            self.sock.settimeout(timeout)
            return
        # The C socket type: socket.py (with selectors and enum) would be about a third of
        # the imports of a fiberctl run or call, which a job may start per task.
        self.sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(os.fspath(path))
        except OSError as e:
            self.sock.close()
            raise Unreachable(f"cannot connect to fiberd at {path}: {_connect_failure(path, e)}") \
                from e

    def __enter__(self) -> FiberdClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send(self, message: dict[str, object], fds: Sequence[int] = ()) -> None:
        """Send one request frame, with ``fds`` attached to its first byte."""
        data = encode_frame(message)
        # C ints packed by struct, not array.array: importing array imports collections.abc
        rights = struct.pack(f"{len(fds)}i", *fds)
        try:
            sent = self.sock.sendmsg(
                [data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)]) if fds else 0
            self.sock.sendall(data[sent:])
        except OSError as e:
            raise Unreachable(f"sending to fiberd failed: {e.strerror or e}") from e

    def receive(self, wait_forever: bool = False,
                within: float | None = None) -> dict[str, object]:
        """The next reply frame as sent (no error raising). Raises Unreachable; with
        ``within`` (seconds), TimeoutError when no whole frame came in that time (the
        connection stays usable: a later call picks up where this one stopped)."""
        if self._held:
            return self._held.pop(0)
        self.sock.settimeout(within if within is not None
                             else None if wait_forever else self.timeout)
        try:
            while True:
                frame = self._decoder.next_frame()
                if frame is not None:
                    if not isinstance(frame.body, dict):
                        raise Unreachable(f"fiberd sent a malformed reply: {frame.error}")
                    return frame.body
                data = self.sock.recv(65536)
                if not data:
                    raise Unreachable("fiberd closed the connection")
                self._decoder.feed(data)
        except FramingError as e:
            raise Unreachable(f"fiberd broke the protocol: {e.reason}") from e
        except OSError as e:
            if within is not None and isinstance(e, TimeoutError):
                raise
            raise Unreachable(f"reading from fiberd failed: {e.strerror or e}") from e

    def reply(self, wait_forever: bool = False,
              within: float | None = None) -> dict[str, object]:
        """The next reply if it is a success. Raises Refused, Missed, Unreachable
        (and TimeoutError with ``within``, see ``receive``)."""
        message = self.receive(wait_forever, within)
        if message.get("ok"):
            return message
        if isinstance(message.get("miss"), dict):
            raise Missed(message["miss"])  # type: ignore[arg-type]
        error = message.get("error")
        raise Refused(error if isinstance(error, dict) else {"code": "?", "reason": str(message)})

    def exchange(self, message: dict[str, object], fds: Sequence[int] = ()) -> dict[str, object]:
        """Send one request and return its (first) successful reply.

        fiberd may refuse a connection (forbidden, busy) before reading it;
        the refusal it sent first is then what this raises, not the broken pipe.
        """
        try:
            self.send(message, fds)
        except Unreachable as lost:
            try:
                return self.reply()
            except Unreachable:
                raise lost from None
        return self.reply()

    def request(self, op: str, **fields: object) -> dict[str, object]:
        """Send ``op`` with ``fields`` and return the reply's result."""
        self._next_id += 1
        result = self.exchange({"op": op, "id": self._next_id, **fields})["result"]
        return result if isinstance(result, dict) else {}

    def send_request(self, request: rq.Request) -> dict[str, object]:
        """Send a typed request and return the reply's result (raw JSON)."""
        self._next_id += 1
        result = self.exchange(request.to_json(self._next_id))["result"]
        return result if isinstance(result, dict) else {}

    # --- one typed method per op (protocol.TABLE); each raises Refused, Unreachable ---------

    def clone(self, request: rq.Clone | None = None, /, *,
              stdio: Mapping[str, int] | None = None, wait: bool = False,
              **fields: object) -> Fiber:
        """Start a fiber; its record as the ``started`` event gave it. ``request`` is the
        clone (its ``stdio`` names and ``wait`` are this call's), or ``fields`` are the
        clone's own as JSON (``exec``/``call``, ``grant``/``token``, ``env``, ``hangup``,
        ``v``). ``stdio`` maps "stdin", "stdout", "stderr" to descriptors to pass. With
        ``wait``, follow with ``wait_exit``. Raises Missed, Refused, Unreachable."""
        stdio = dict(stdio or {})
        names = [n for n in STDIO_NAMES if n in stdio]
        message: dict[str, object]
        if request is not None:
            message = rq.Clone(request.call, request.exec, request.grant, request.token,
                               request.env, tuple(names), wait, request.hangup,
                               request.early).to_json()
        else:
            message = {"op": "clone", "wait": wait, **fields}
            if names:
                message["stdio"] = names
        result = self.exchange(message, [stdio[n] for n in names])["result"]
        return Fiber.from_json(result if isinstance(result, dict) else {})

    def clone_batch(self, items: Sequence[Mapping[str, object]], *,
                    stdio: Sequence[Mapping[str, int]] = (), wait: bool = False,
                    window: int | None = None, **fields: object) -> BatchStarted:
        """Start one fiber per item (protocol v3) in one request: each item is
        ``{"key": str, "exec"|"call": ..., "env"?: ...}``, ``stdio[i]`` the descriptors of
        item i (as in ``clone``); ``fields`` hold for every item (``grant``/``token``,
        ``env``, ``hangup``). The reply names each item's fiber, miss or error. With
        ``wait``, follow with one ``wait_exit`` per started fiber. With ``window`` (v5,
        needs ``wait``), at most that many run at once and the reply names the first
        ones; ``wait_event`` then also gives ``("started", {"items": [...]})`` for the
        items started later. Raises Refused (a v2 fiberd: ``unsupported_version``; a v4
        one for a window), Unreachable."""
        sent: list[dict[str, object]] = []
        fds: list[int] = []
        for n, item in enumerate(items):
            given = stdio[n] if n < len(stdio) else {}
            names = [name for name in STDIO_NAMES if name in given]
            sent.append({**item, "stdio": names} if names else dict(item))
            fds.extend(given[name] for name in names)
        message: dict[str, object] = {"op": "clone_batch", "v": BATCH_SINCE, "wait": wait,
                                      **fields, "items": sent}
        if window is not None:
            message.update(window=window, v=max(WINDOW_SINCE, int(str(message["v"]))))
        result = self.exchange(message, fds)["result"]
        return BatchStarted.from_json(result if isinstance(result, dict) else {})

    def cancel(self, within: float | None = None) -> Cancelled:
        """During a windowed batch's stream (protocol v5): start none of its items not
        started yet; the keys of those, from its ``cancelled`` event. Its fibers running go
        on: their events, and any read here before that one, come to ``wait_event`` as
        usual. A stream that ended before fiberd took the cancel answers nothing: the keys
        are then none. ``within`` as for ``wait_event``. Raises Refused (a fiberd older
        than v5), Unreachable."""
        self._next_id += 1
        asked = self._next_id
        self.send(rq.Cancel().to_json(asked))
        held: list[dict[str, object]] = []
        try:
            while True:
                message = self.receive(wait_forever=True, within=within)
                if message.get("event") == "cancelled":
                    return Cancelled.from_json(_result(message))
                if message.get("id") == asked and not message.get("ok"):
                    error = message.get("error")  # an older fiberd (busy, unknown_op)
                    raise Refused(error if isinstance(error, dict) else {"code": "?"})
                held.append(message)
                if message.get("final"):
                    return Cancelled([])  # the stream had ended; the cancel goes unanswered
        finally:
            self._held[:0] = held

    def inspect_fiber(self, fiber: str) -> Fiber:
        """One fiber's record. Refused ``not_found`` when fiberd does not know it."""
        return Fiber.from_json(self.send_request(rq.InspectFiber(fiber)))

    def stop_fiber(self, fiber: str, grace: float | None = None) -> Fiber:
        """Stop a fiber (SIGTERM, ``grace`` s, SIGKILL); its record once it is gone."""
        return Fiber.from_json(self.send_request(rq.StopFiber(fiber, grace)))

    def signal_fiber(self, fiber: str, signal: int | str) -> Delivered:
        """Send a signal (number or name); ``delivered`` False when it had exited."""
        return Delivered.from_json(self.send_request(rq.SignalFiber(fiber, signal)))

    def list_fibers(self, after: str | None = None, limit: int | None = None,
                    ended: bool = False) -> FiberList:
        """The fibers fiberd tracks: all of them, or (protocol v3) the page of at most
        ``limit`` after the cursor ``after`` (a previous page's ``next``); ``ended``: with
        the ended fibers fiberd still remembers."""
        return FiberList.from_json(self.send_request(rq.ListFibers(after, limit, ended)))

    def iter_fibers(self, page_size: int = PAGE_SIZE,
                    ended: bool = False) -> Iterator[dict[str, object]]:
        """Every fiber's record, page by page (each fiber once; one that starts while the
        pages are read comes too, one that ends before its page does not; ``ended``: with
        those ended that fiberd remembers)."""
        page = self.list_fibers(limit=page_size, ended=ended)
        while True:
            yield from page.fibers
            if page.next is None:
                return
            page = self.list_fibers(after=page.next, limit=page_size, ended=ended)

    def list_grants(self) -> GrantList:
        """The grants fiberd holds."""
        return GrantList.from_json(self.send_request(rq.ListGrants()))

    def status(self) -> Document:
        """fiberd's status document."""
        return Document.from_json(self.send_request(rq.Status()))

    def health(self) -> Document:
        """The source's health document."""
        return Document.from_json(self.send_request(rq.Health()))

    def ready(self) -> Ready:
        """Whether fiberd serves clones now."""
        return Ready.from_json(self.send_request(rq.Ready()))

    def metrics(self) -> Metrics:
        """fiberd's metrics, Prometheus text."""
        return Metrics.from_json(self.send_request(rq.Metrics()))

    def wait_exit(self, within: float | None = None) -> dict[str, object]:
        """After ``clone(wait=True)``: block until the exit event; returns it
        (fiber_id, exit_code, signal, status, rusage, result or error), passing over
        ``result`` events (``early``). With ``within`` (seconds), raises TimeoutError if
        the fiber has not ended by then; call again to keep waiting (e.g. after stopping
        it)."""
        deadline = None if within is None else time.monotonic() + within
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            event, result = self.wait_event(left)
            if event == "exit":
                return result

    def wait_event(self, within: float | None = None) -> tuple[str, dict[str, object]]:
        """After a clone or batch with ``wait``: the next event, ``("exit", exit)`` or,
        with ``early`` (protocol v4), ``("result", {fiber_id, result or error})``, which
        comes before that fiber's exit event, or, with a batch's ``window`` (v5),
        ``("started", {"items": [...]})``. ``within`` as for ``wait_exit``."""
        reply = self.reply(wait_forever=True, within=within)
        return str(reply.get("event")), _result(reply)


def _result(message: Mapping[str, object]) -> dict[str, object]:
    result = message.get("result")
    return result if isinstance(result, dict) else {}


def _connect_failure(path: str | os.PathLike[str], err: OSError) -> str:
    """Why a connect to ``path`` failed and what to do, in a few words."""
    hint = "is fiberd running? (start it, or give --socket PATH or $FIBERD_SOCKET)"
    if isinstance(err, FileNotFoundError):
        return f"no such socket; {hint}"
    if isinstance(err, ConnectionRefusedError):
        try:
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                return "not a socket; give --socket fiberd's socket"
        except OSError:
            pass
        return f"nothing listens there (a stale socket); {hint}"
    if isinstance(err, PermissionError):
        return ("permission denied; the socket is fiberd's user's (allowed_uids/"
                "allowed_gids let others in)")
    return str(err.strerror or err)
