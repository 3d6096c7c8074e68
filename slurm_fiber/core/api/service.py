"""The Service: what the socket server asks the runtime to do.

The server owns transport, validation and peer checks; everything a request
means (resolving grants, forking fibers, stopping them) belongs to a
``Service``, which the core runtime implements. These types are the whole
contract between the two: requests arrive already validated, descriptors
arrive open, answers go back as plain JSON-able mappings, and a ``Miss`` is
the only way a clone that starts nothing answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from slurm_fiber.core.book.misses import Miss
from slurm_fiber.protocol.requests import CallTarget as CallTarget
from slurm_fiber.protocol.requests import Clone as Clone
from slurm_fiber.protocol.requests import ExecTarget as ExecTarget
from slurm_fiber.protocol.requests import Peer as Peer

JsonMap = Mapping[str, object]
T = TypeVar("T")


@dataclass(frozen=True)
class Stdio:
    """Descriptors the caller passed for the fiber's stdin/stdout/stderr (None: not passed).

    They are open only for the duration of ``Service.clone``: the server
    closes them when it returns, so a service that keeps one must dup it.
    Without them, the fiber's output goes wherever the runtime decides
    (files under the state dir).
    """

    stdin: int | None = None
    stdout: int | None = None
    stderr: int | None = None


@dataclass(frozen=True)
class FiberExit:
    """How a fiber ended: exit code or killing signal, resource usage, and a call's outcome.

    ``rusage`` holds at least ``utime`` and ``stime`` (seconds) and
    ``maxrss_kib`` where known. In call mode exactly one of ``result`` (the
    function's JSON return value) and ``error`` ({"type", "message"}) is
    meaningful; ``error`` is also set when a call-mode fiber died without
    reporting. ``reason`` ({"code", "message"}) says why fiberd (or the OOM
    killer) ended it, None when it ended by itself; ``exec_failed`` ({"errno",
    "name", "path", "message", "interpreter"?}) is set when exec mode's exec
    itself failed (the status is then 127 or 126, as a shell's).
    """

    fiber_id: str
    exit_code: int | None
    signal: int | None
    rusage: JsonMap = field(default_factory=dict)
    result: object = None
    error: JsonMap | None = None
    reason: JsonMap | None = None
    exec_failed: JsonMap | None = None

    @property
    def status(self) -> int:
        """The shell's view: the exit code, or 128 + the signal that killed it."""
        if self.signal is not None:
            return 128 + self.signal
        return self.exit_code if self.exit_code is not None else 255

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "fiber_id": self.fiber_id,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "status": self.status,
            "rusage": dict(self.rusage),
            "reason": dict(self.reason) if self.reason is not None else None,
        }
        if self.exec_failed is not None:
            out["exec_failed"] = dict(self.exec_failed)
        if self.error is not None:
            out["error"] = dict(self.error)
        else:
            out["result"] = self.result
        return out


class FiberHandle(Protocol):
    """A started fiber as ``Service.clone`` returns it."""

    @property
    def id(self) -> str: ...

    @property
    def pid(self) -> int: ...

    def to_json(self) -> dict[str, object]:
        """The fiber record (id, pid, grant, jti, epoch, deadline, state, ...)."""
        ...

    async def call_result(self) -> dict[str, object] | None:
        """A call fiber's ``result`` event once it has written its result, before its exit
        (None: none written, or no call); may be awaited by many callers."""
        ...

    async def wait(self) -> FiberExit:
        """Wait until the fiber has exited and been reaped; may be awaited by many callers."""
        ...

    def on_exit(self, callback: Callable[[FiberExit], None]) -> None:
        """Have ``callback(exit)`` called on the loop once the fiber has exited and been
        reaped, in the loop step its ``wait()`` could first return (no task between)."""
        ...


Forked = Callable[[FiberHandle], None]  # told of a batch item's fiber once it runs


def page(ordered: Iterable[tuple[int, T]], after: str | None,
         limit: int | None) -> tuple[list[T], str | None]:
    """One page of ``ordered`` ((order, item) pairs by increasing order, e.g. fibers by when
    they were registered): the items whose order is past the cursor ``after`` (None:
    all), at most ``limit``; and the cursor of the next page, None when nothing follows.

    The cursor is the last order returned, so a page never repeats an item of an earlier
    one, an item gone between pages is simply not seen, and one that arrives between
    pages (a higher order) comes on a later page: listing page by page misses nothing
    that stays from the first page to the last. Raises ValueError on a cursor that is
    not one (protocol validation refuses those first)."""
    start = int(after) if after is not None else 0
    out: list[T] = []
    last = start
    for order, item in ordered:
        if order <= start:
            continue
        if limit is not None and len(out) >= limit:
            return out, str(last)
        out.append(item)
        last = order
    return out, None


class FiberNotFound(LookupError):
    """Raised by a Service when a fiber id names no fiber it knows (reply: not_found)."""

    def __init__(self, fiber_id: str) -> None:
        super().__init__(f"no fiber {fiber_id!r}")
        self.fiber_id = fiber_id


class Service(Protocol):
    """The runtime behind the socket. Called on the server's event loop.

    Synchronous methods must not block. Any exception other than
    FiberNotFound becomes an ``internal`` error reply to that one request;
    the server and its other clients carry on.
    """

    async def clone(self, request: Clone, peer: Peer, stdio: Stdio) -> FiberHandle | Miss:
        """Start a fiber for ``peer`` or say why not. Returns once the fiber is running (or
        missed). ``request`` is the validated request as the socket got it (the core reads
        its grant or token, its call or exec and its env; the server keeps the rest)."""
        ...

    async def clone_batch(self, requests: Sequence[Clone], peer: Peer, stdio: Sequence[Stdio],
                          batch: int | None = None, forked: Forked | None = None,
                          ) -> Sequence[FiberHandle | Miss | Exception]:
        """Start one fiber per request (same grant and token in each), in order: the
        grant resolved (a token verified and admitted) once; each fiber decided, started
        and audited on its own, so one miss does not stop the others. One outcome per
        request, in order: a fiber, a miss, or the exception that failed that item alone
        (answered ``internal`` for it). ``batch``: the client's request's item count, for
        the audit records (None: ``len(requests)``; a windowed batch starts its items a
        few at a time). ``forked``: called with each item's fiber as soon as it runs,
        before its record is durable and its outcome returned (a windowed batch then
        counts a fiber that has already ended as no longer running). Descriptors as in
        ``clone``."""
        ...

    def list_fibers(self, after: str | None = None, limit: int | None = None,
                    ended: bool = False) -> tuple[Sequence[JsonMap], str | None]:
        """The fibers the runtime tracks, as records, in the order they were registered:
        those after the cursor ``after`` (None: from the first), at most ``limit`` (None:
        all), and the cursor of the next page (None: this was the last). See ``page``.
        ``ended``: with the ended fibers the runtime still remembers (their last
        records; the protocol's ``ended`` field)."""
        ...

    def inspect_fiber(self, fiber_id: str) -> JsonMap:
        """One fiber's record. Raises FiberNotFound."""
        ...

    async def stop_fiber(self, fiber_id: str, grace: float | None, peer: Peer) -> JsonMap:
        """SIGTERM, ``grace`` seconds (None: the runtime's default), SIGKILL; returns the
        record once the fiber is gone. Raises FiberNotFound."""
        ...

    def signal_fiber(self, fiber_id: str, signum: int, peer: Peer) -> bool:
        """Send ``signum`` to the fiber; False when it has already exited. Raises FiberNotFound."""
        ...

    def list_grants(self) -> Sequence[JsonMap]:
        """Every admitted grant: UID, lease, template state, running fibers."""
        ...

    def status(self) -> JsonMap:
        """The daemon's status: home, epoch, cgroup mode (carved or not), counts."""
        ...

    def health(self) -> JsonMap:
        """Source health (state, age of last sync) and anything else a prober needs."""
        ...

    def ready(self) -> bool:
        """Whether fiberd is ready to serve clones (the home's readiness)."""
        ...

    def fibers_running(self) -> int:
        """How many fibers are running now (read at each metrics scrape)."""
        ...
