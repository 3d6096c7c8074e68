"""fiberd's metrics where Prometheus can reach them: HTTP ``/metrics`` and a textfile.

The metrics are ``core.metrics.FiberMetrics`` (the same registry the ``metrics``
socket op renders); this module only exposes them, each sample labelled with
where fiberd runs (``scope_labels``: ``home`` always, ``job_id`` and ``node``
from the home's scope on Slurm, ``node`` on Kubernetes). Labels are read at
each exposition, so a scope that changes shows at the next scrape.

``MetricsHttp`` serves ``GET /metrics`` on fiberd's own asyncio loop (no
thread, nothing that could hold a lock across a fork). A connection is bounded:
the request head is at most 8 KiB and must arrive within 5 s, at most 16
connections are served at once (more are closed at once), so a client holding
connections open costs fiberd nothing but those sockets. Anything but GET/HEAD
of ``/metrics`` gets 404/405. A scrape loop is bounded too: connections are
accepted at most ``ACCEPT_RATE`` a second (a burst of ``ACCEPT_BURST``), the
others wait in the kernel's backlog, not in fiberd, and the exposition is
rebuilt at most once a ``RENDER_INTERVAL`` (``core.metrics.Rendered``), so
however fast a local client loops, fiberd builds about one exposition a second
and answers a bounded number of requests. ``MetricsTextfile`` writes ``NAME.prom`` for
node_exporter's textfile collector into a directory opened with
``safefs.open_dir`` (fiberd's uid or root only), replaced atomically
(``safefs.write_atomic``) at start and every ``REFRESH`` seconds, and removed
on a clean stop. Both are off unless configured; ``start_export`` starts what
the configuration names and raises ``ExportRefused`` (one line) when it cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slurm_fiber.core.clock import Clock
from slurm_fiber.core.metrics.families import CONTENT_TYPE, FiberMetrics, Rendered
from slurm_fiber.core.trust.grant import ScopeClaim
from slurm_fiber.safefs import UnsafePath, open_dir, write_atomic

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

log = logging.getLogger("slurm_fiber.metrics")

REFRESH = 15.0  # seconds between textfile rewrites (node_exporter reads it at each scrape)
HEAD_LIMIT = 8192  # bytes of request line and headers
HEAD_TIMEOUT = 5.0  # seconds a client has to send them
MAX_CONNECTIONS = 16
ACCEPT_RATE = 10.0  # connections accepted per second, sustained
ACCEPT_BURST = 20  # and at once after a quiet spell
BACKLOG = 16
# scope claim key (after its "home." prefix) -> label name
_SCOPE_LABELS = {"job_id": "job_id", "node": "node"}

Labels = Callable[[], Mapping[str, str]]


class ExportRefused(Exception):
    """A metrics endpoint or textfile cannot be set up (one line naming what to fix)."""


def scope_labels(home: str, scope: Iterable[ScopeClaim]) -> dict[str, str]:
    """The labels for a fiberd in ``home`` with ``scope``: home, and job_id and node when
    the scope names them (``slurm.job_id``, ``slurm.node``, ``kubernetes.node``...)."""
    labels = {"home": home}
    for claim in scope:
        label = _SCOPE_LABELS.get(claim.key.rpartition(".")[2])
        if label is not None and label not in labels:
            labels[label] = claim.value
    return labels


@dataclass
class Labelled:
    """A collector view of ``metrics``' registry with ``labels()`` added to every sample.

    ``generate_latest(Labelled(...))`` gives the exposition text (prometheus-client is
    imported at the first scrape, not with this module)."""

    metrics: FiberMetrics
    labels: Labels
    rendered: Rendered | None = None

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.samples import Sample

        extra = dict(self.labels())
        for family in self.metrics.registry.collect():
            family.samples = [Sample(s.name, {**extra, **s.labels}, s.value, s.timestamp,
                                     s.exemplar) for s in family.samples]
            yield family

    def render(self) -> bytes:
        """The text exposition, labelled, rebuilt at most every RENDER_INTERVAL seconds.
        Never blocks."""
        if self.rendered is None:
            self.rendered = Rendered(self._render)
        return self.rendered.get()

    def _render(self) -> bytes:
        from prometheus_client.exposition import generate_latest

        return generate_latest(self)  # a collector by protocol (it has collect)


class AcceptBudget:
    """A token bucket on the clock: ``await take()`` returns once a connection may be
    accepted (ACCEPT_RATE a second, ACCEPT_BURST at once)."""

    def __init__(self, clock: Clock, rate: float = ACCEPT_RATE,
                 burst: int = ACCEPT_BURST) -> None:
        self.clock = clock
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.at = clock.mono()

    async def take(self) -> None:
        while True:
            now = self.clock.mono()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens >= 1:
                self.tokens -= 1
                return
            await self.clock.sleep((1 - self.tokens) / self.rate)


class MetricsHttp:
    """``GET /metrics`` over HTTP/1.0 on ``host:port``, on the running loop.

    ``await start()`` binds (raises ExportRefused), ``await close()`` stops and
    drops open connections.
    """

    def __init__(self, view: Labelled, host: str, port: int, clock: Clock) -> None:
        self.view = view
        self.host = host
        self.port = port
        self.budget = AcceptBudget(clock)
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._open: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        try:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            self._listener = socket.create_server((self.host, self.port), family=family,
                                                  backlog=BACKLOG)
        except OSError as err:
            raise ExportRefused(f"cannot serve metrics on {self.host}:{self.port}: "
                                f"{err.strerror or err}") from None
        self._listener.setblocking(False)
        self._accepting = asyncio.ensure_future(self._accept_loop(self._listener))
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)

    async def close(self) -> None:
        tasks = [t for t in (self._accepting, *self._open) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _accept_loop(self, listener: socket.socket) -> None:
        """Accept within the budget (module doc); never raises but for cancellation."""
        loop = asyncio.get_running_loop()
        while True:
            await self.budget.take()
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as err:  # out of descriptors, a reset before accept: try later
                log.debug("metrics accept failed: %s", err)
                continue
            if len(self._open) >= MAX_CONNECTIONS:
                conn.close()
                continue
            task = asyncio.ensure_future(self._serve_socket(conn))
            self._open.add(task)
            task.add_done_callback(self._open.discard)

    async def _serve_socket(self, conn: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_connection(sock=conn, limit=HEAD_LIMIT)
        except OSError:
            conn.close()
            return
        await self._serve(reader, writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(HEAD_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
            await self._answer(head, writer)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                ConnectionError, ValueError):
            pass  # a client that left, dawdled or sent too much: nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, head: bytes, writer: asyncio.StreamWriter) -> None:
        method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
        path = rest.split(" ", 1)[0].split("?", 1)[0]
        if path != "/metrics":
            status, body, ctype = "404 Not Found", b"only /metrics is served here\n", "text/plain"
        elif method not in ("GET", "HEAD"):
            status, body, ctype = "405 Method Not Allowed", b"use GET\n", "text/plain"
        else:
            status, body, ctype = "200 OK", self.view.render(), CONTENT_TYPE
        writer.write(f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
        if method != "HEAD":
            writer.write(body)
        async with asyncio.timeout(HEAD_TIMEOUT):
            await writer.drain()


def textfile_name(labels: Mapping[str, str]) -> str:
    """``slurm_fiber.prom``, or ``slurm_fiber_job_ID.prom`` when a job id is known (one file
    per job on a shared node)."""
    job = re.sub(r"[^A-Za-z0-9_.-]", "_", labels.get("job_id", ""))
    return f"slurm_fiber_job_{job}.prom" if job else "slurm_fiber.prom"


@dataclass
class MetricsTextfile:
    """The metrics as ``name`` in ``dir_fd``, rewritten by ``run()`` every REFRESH seconds.

    ``write()`` blocks on the disk (called in a thread by ``run``); ``remove()``
    unlinks the file and closes ``dir_fd``.
    """

    view: Labelled
    dir_fd: int
    name: str
    where: str

    @classmethod
    def open(cls, view: Labelled, directory: str) -> MetricsTextfile:
        """Open ``directory`` (absolute; fiberd's uid or root, writable by nobody else) and
        write the file once. Raises ExportRefused."""
        try:
            fd = open_dir(directory, trusted_owners=(os.geteuid(),))
        except UnsafePath as err:
            raise ExportRefused(f"unsafe metrics textfile dir {directory}: {err}; "
                                "fix its owner or mode") from None
        except OSError as err:
            raise ExportRefused(f"cannot use the metrics textfile dir {directory}: "
                                f"{err.strerror or err}") from None
        textfile = cls(view, fd, textfile_name(view.labels()), directory)
        try:
            textfile.write(view.render())
        except OSError as err:
            os.close(fd)
            raise ExportRefused(f"cannot write the metrics textfile in {directory}: "
                                f"{err.strerror or err}") from None
        return textfile

    def write(self, text: bytes) -> None:
        write_atomic(self.dir_fd, self.name, text, mode=0o644)

    async def run(self, clock: Clock) -> None:
        """Rewrite the file every REFRESH seconds until cancelled; a failed write is logged."""
        while True:
            await clock.sleep(REFRESH)
            try:
                await asyncio.to_thread(self.write, self.view.render())
            except OSError as err:
                log.warning("metrics textfile %s/%s not refreshed: %s", self.where, self.name,
                            err)

    def remove(self) -> None:
        """Unlink the file (a stale one would be scraped as if fiberd ran) and close the dir."""
        try:
            os.unlink(self.name, dir_fd=self.dir_fd)
        except FileNotFoundError:
            pass
        except OSError as err:
            log.warning("metrics textfile %s/%s not removed: %s", self.where, self.name, err)
        finally:
            os.close(self.dir_fd)


@dataclass
class MetricsExport:
    """What ``start_export`` started; ``await close()`` stops it all (idempotent)."""

    http: MetricsHttp | None = None
    textfile: MetricsTextfile | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []
        if self.http is not None:
            await self.http.close()
            self.http = None
        if self.textfile is not None:
            self.textfile.remove()
            self.textfile = None


async def start_export(metrics: FiberMetrics, labels: Labels, clock: Clock, *,
                       listen: tuple[str, int] | None, textfile: str | None) -> MetricsExport:
    """Start the HTTP endpoint and/or the textfile the configuration names (neither: an
    export that does nothing). Raises ExportRefused, having undone what it started."""
    view = Labelled(metrics, labels)
    view.rendered = Rendered(view._render, now=clock.mono)  # rebuilt on fiberd's clock
    export = MetricsExport()
    try:
        if listen is not None:
            export.http = MetricsHttp(view, *listen, clock)
            await export.http.start()
        if textfile is not None:
            export.textfile = MetricsTextfile.open(view, textfile)
            export.tasks.append(asyncio.ensure_future(export.textfile.run(clock)))
    except BaseException:
        await export.close()
        raise
    return export
