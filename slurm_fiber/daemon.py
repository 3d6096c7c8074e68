"""fiberd: a home, the core, the local socket API and the audit log, wired and run until stopped.

This is the wiring every way of running fiberd shares: the ``fiberd`` and ``fiberd-run``
commands (slurm_fiber.cli), grant-conform (conform.live) and the tests.
``run_daemon`` is the daemon's whole life on one asyncio loop: ``started`` builds
the configured home (or a stage's, through ``build``) and ``start_fiberd`` opens the
audit log and the grant book (refusing to start on a corrupt state file), sweeps the
cgroups a dead predecessor left (homes.sweep), claims the socket, publishes "not
ready" over the predecessor's stale readiness, exposes the metrics over HTTP and/or
a textfile when configured (core.metrics_export), writes the start record and only
then answers the socket (no request is answered before it); ``serve`` then feeds the
home's deliveries into the core (``drive``), runs the home and the core's upkeep,
and registers the core for the home's scope losses. It returns when ``stop`` is set
(on SIGTERM/SIGINT, ``stop_on_signals``) or when the home's ``run`` fails, after a
clean shutdown: no new Clone is accepted (``closed``), every fiber and template is
stopped and waited for, devices and cgroups are released, the socket and the metrics
textfile are removed, and the audit log records start and stop.

Refusals to start raise ``FiberdRefused`` with one line a person can act on; a root
fiberd refuses to start unless ``fiber_user`` names whom its templates and fibers run
as (core/identity.py: an unprivileged account without capabilities, or ``root`` said
explicitly).
Before anything is opened, fiberd checks the directories it writes in (state
dir, socket dir, audit log dir; ``check_dirs``): each must belong to fiberd's
uid or root and be writable by nobody else, up from "/" (a root-owned sticky
ancestor such as /tmp is fine). Missing ones are created 0700 whatever the
umask; the socket's dir is made traversable (0711) when other users are
allowed on the socket (docs/socket-protocol.md, "Who may connect").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_fiber.config import FiberdConfig
from slurm_fiber.core.api.server import ApiServer, ServerConfig
from slurm_fiber.core.api.sockfile import SocketPathError
from slurm_fiber.core.audit.log import AuditEvent, AuditLog, AuditWriteFailed
from slurm_fiber.core.audit.refusals import RefusalLog
from slurm_fiber.core.book.decisions import GrantBook
from slurm_fiber.core.book.health import SourceHealth
from slurm_fiber.core.book.state import StateCorrupt, StateFile
from slurm_fiber.core.cgroups.manager import CgroupManager
from slurm_fiber.core.clock import Clock, SystemClock
from slurm_fiber.core.metrics.export import (
    ExportRefused,
    MetricsExport,
    scope_labels,
    start_export,
)
from slurm_fiber.core.runtime.core import Core
from slurm_fiber.core.runtime.identity import IdentityRefused, resolve_fiber_user
from slurm_fiber.core.seam import Home, HomePorts
from slurm_fiber.core.trust.issuers import TrustStore
from slurm_fiber.core.trust.tokens import TokenVerifier
from slurm_fiber.defaults import STATE_FILE_NAME
from slurm_fiber.homes.delivery import drive
from slurm_fiber.homes.problem import Problem, ProblemSink, log_problem
from slurm_fiber.homes.select import BuiltHome, build_home, close_home
from slurm_fiber.homes.sweep import reset_readiness, sweep_cgroups
from slurm_fiber.safefs import UnsafePath, open_dir

log = logging.getLogger("slurm_fiber.fiberd")

class FiberdRefused(Exception):
    """fiberd cannot start as configured (one line naming what to fix)."""


class ProblemRelay:
    """Where a home's problems go: logged always, and audited once the audit log is open.

    Homes are built before the audit log exists, so they get ``relay.report``.
    """

    def __init__(self) -> None:
        self.audit: AuditLog | None = None

    def report(self, problem: Problem) -> None:
        """A home's ProblemSink: never raises."""
        log_problem(problem)
        if self.audit is not None:
            try:
                self.audit.write(AuditEvent.PROBLEM, code=problem.code, subject=problem.subject,
                                 reason=problem.reason)
            except OSError as err:
                log.error("audit of %s failed: %s", problem, err)


@dataclass
class Running:
    """What a started fiberd exposes to its caller (fiberd-run, tests, conformance)."""

    core: Core
    server: ApiServer
    audit: AuditLog
    socket: Path
    export: MetricsExport
    refusals: RefusalLog
    ports: HomePorts


def _trust(config: FiberdConfig) -> TrustStore:
    if not config.trust:
        raise FiberdRefused("no issuer is trusted: give --trust ISSUER=JWKS (or trust in the "
                            "config file), else every grant would be refused")
    return TrustStore(dict(config.trust), on_problem=lambda line: log.warning("trust: %s", line))


PRIVATE_DIR_MODE = 0o700


def _shares_socket(config: FiberdConfig) -> bool:
    return bool(config.allowed_uids or config.allowed_gids)


def check_dirs(config: FiberdConfig) -> None:
    """Refuse to start on a state, socket or audit dir that anyone but fiberd's uid or root
    could change (see the module doc); create missing ones with exactly mode 0700.

    When other users are allowed on the socket, its dir (when fiberd owns
    it) gets search permission for everyone (0711): the socket itself is then
    0666 and SO_PEERCRED decides. Raises FiberdRefused (one line, also logged).
    """
    dirs = [("state dir", config.state_dir),
            ("socket dir", os.path.dirname(config.socket) or "."),
            ("audit log dir", os.path.dirname(config.audit_path) or ".")]
    for what, path in dirs:
        try:
            fd = open_dir(os.path.abspath(path), trusted_owners=(os.geteuid(),),
                          create_mode=PRIVATE_DIR_MODE)
        except UnsafePath as err:
            line = f"unsafe {what} {path}: {err}; fix its owner or mode"
            log.error("refusing to start: %s", line)
            raise FiberdRefused(line) from None
        except OSError as err:
            raise FiberdRefused(f"cannot use the {what} {path}: "
                                f"{err.strerror or err}") from None
        try:
            if what == "socket dir" and _shares_socket(config):
                _open_for_search(fd)
                _warn_unreachable(path)
        finally:
            os.close(fd)


def _warn_unreachable(socket_dir: str) -> None:
    """Log the first ancestor of ``socket_dir`` that others cannot search (allowed users
    then cannot reach the socket; fiberd does not change dirs it did not make)."""
    path = os.path.abspath(socket_dir)
    while True:
        with contextlib.suppress(OSError):
            if os.stat(path).st_mode & 0o001 == 0:
                log.warning("allowed users cannot reach the socket: %s is not searchable by "
                            "others (mode %04o)", path, os.stat(path).st_mode & 0o7777)
                return
        if path == "/":
            return
        path = os.path.dirname(path)


def _open_for_search(dir_fd: int) -> None:
    """Give everyone search permission on fiberd's own dir ``dir_fd`` (left open)."""
    st = os.fstat(dir_fd)
    if st.st_uid == os.geteuid() and st.st_mode & 0o011 != 0o011:
        os.fchmod(dir_fd, (st.st_mode & 0o7777) | 0o011)


def _server_config(config: FiberdConfig) -> ServerConfig:
    uids = None
    if config.allowed_uids:
        uids = frozenset({os.getuid(), 0, *config.allowed_uids})
    return ServerConfig(path=Path(config.socket), allowed_uids=uids,
                        allowed_gids=frozenset(config.allowed_gids),
                        mode=0o666 if _shares_socket(config) else 0o600)


async def start_fiberd(config: FiberdConfig, home: Home, clock: Clock, *, audience: str,
                       cgroup_reason: Callable[[], str],
                       relay: ProblemRelay | None = None) -> Running:
    """Open state, build the core and serve the socket; returns once the socket is answered
    (after the start record).

    The home is asked through its ports (``HomePorts``: each port it provides, else the
    port's default). ``cgroup_reason()`` says why the cgroup root is what it is
    (BuiltHome.cgroup_line).

    The caller runs ``serve`` next (or shuts ``Running`` down itself).
    Raises FiberdRefused when fiberd cannot start.
    """
    state_dir = Path(config.state_dir)
    try:
        identity = resolve_fiber_user(config.fiber_user)
    except IdentityRefused as err:
        log.error("refusing to start: %s", err)
        raise FiberdRefused(str(err)) from None
    check_dirs(config)
    ports = HomePorts(home, SourceHealth(clock, config.stale_ttl, control_plane=False))
    try:
        audit = AuditLog(config.audit_path, config.audit_fsync, clock=clock,
                         scope=ports.liveness.scope())
    except OSError as err:
        raise FiberdRefused(f"cannot open the audit log {config.audit_path}: "
                            f"{err.strerror or err}") from None
    if relay is not None:
        relay.audit = audit
    health = ports.liveness.health()
    try:
        book = GrantBook(clock, health, fence_ttl=config.fence_ttl if health.control_plane
                         else None, store=StateFile(state_dir / STATE_FILE_NAME))
    except StateCorrupt as err:
        audit.close()
        raise FiberdRefused(f"grant state {state_dir / STATE_FILE_NAME} is unreadable ({err}); "
                            "move it aside to start afresh") from None
    verifier = TokenVerifier(_trust(config), audience, clock, config.leeway)
    root = ports.cgroups.cgroup_root()
    # cgroup_root none means no cgroup at all: no v1 groups either.
    backend = config.cgroup_backend if config.cgroup_root is not None else "v2"
    cgroups = CgroupManager(Path(root) if root else None, cgroup_reason(), backend)
    if identity is not None and not identity.root:
        cgroups.hand_procs(identity.uid)  # its leaves' cgroup.procs only (core/cgroups/groups.py)
    swept = await sweep_cgroups(cgroups)  # a dead predecessor's cgroups, before carving
    core = Core(ports, book, verifier, audit, cgroups, clock=clock, state_dir=state_dir,
                grace=config.grace, spares=config.spares,
                spares_idle=config.spares_idle or None, strict_limits=config.strict_limits,
                task_window=config.task_window,
                template_timeout=config.template_timeout, identity=identity,
                history=config.history, history_seconds=config.history_seconds)
    refusals = RefusalLog(audit, clock)  # rate-limited per caller (core/refusal_log.py)
    server = ApiServer(core, _server_config(config), clock=clock, audit=refusals.refused)
    core.on_fiber_end = server.metrics.fiber_ended
    try:
        await server.start()
    except SocketPathError as err:
        audit.close()
        raise FiberdRefused(str(err)) from None
    try:
        export = await start_export(
            server.metrics, lambda: scope_labels(home.name(), ports.liveness.scope()), clock,
            listen=config.metrics_listen, textfile=config.metrics_textfile)
    except ExportRefused as err:
        await server.close()
        audit.close()
        raise FiberdRefused(str(err)) from None
    readiness = await reset_readiness(ports.readiness)  # a dead predecessor's "ready", once ours
    try:
        audit.write(AuditEvent.START, home=home.name(), pid=os.getpid(), audience=audience,
                    socket=config.socket, epoch=book.epoch,
                    cgroups={**cgroups.status.to_json(), "backend": cgroups.mode,
                             "enforced": cgroups.describe()},
                    swept=swept.paths(), swept_trees=[t.to_json() for t in swept.trees],
                    readiness=readiness,
                    fiber_user=identity.to_json() if identity is not None else None)
    except AuditWriteFailed as err:
        await export.close()
        await server.close()
        audit.close()
        raise FiberdRefused(f"{err}; free space there and start again") from None
    server.accept()  # only now: no request is answered before the start record
    log.info("fiberd %s listening on %s (cgroups: %s)", home.name(), config.socket,
             cgroups.status.reason)
    return Running(core, server, audit, Path(config.socket), export, refusals, ports)


async def serve(running: Running, stop: asyncio.Event) -> str:
    """Run delivery, the home and upkeep until ``stop`` is set or the home fails; then shut
    down cleanly. Returns why it stopped (one line)."""
    core, ports = running.core, running.ports
    if ports.scope_loss is not None:
        ports.scope_loss.on_scope_lost(core.lose_scope)
    delivery = asyncio.ensure_future(drive(ports.home, core))
    background = [asyncio.ensure_future(ports.home.run()), asyncio.ensure_future(core.maintain()),
                  asyncio.ensure_future(running.refusals.run())]
    stopping = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait([stopping, *background], return_when=asyncio.FIRST_COMPLETED)
    why = "stop requested"
    for task in done:
        if task is not stopping:
            err = task.exception()
            why = f"the home stopped: {err}" if err else "the home stopped"
            log.error("%s", why)
    await shutdown(running, [delivery, stopping, *background], why)
    return why


async def shutdown(running: Running, tasks: list[asyncio.Future[Any]], why: str) -> None:
    """Refuse new Clones, stop every fiber and template, close the socket and the audit log."""
    running.core.closing = True
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await running.core.shutdown()
    for failure in running.core.cgroups.close():  # the v1 carving roots, once empty
        log.warning("%s", failure)
    await running.export.close()  # the textfile goes: a stale one would read as running
    await running.server.close()
    running.refusals.flush()  # the refusals only counted so far, before the stop record
    try:
        running.audit.write(AuditEvent.STOP, reason=why, pid=os.getpid())
    except AuditWriteFailed as err:
        log.error("the stop is not audited: %s", err)
    running.audit.close()
    log.info("fiberd stopped: %s", why)


# How ``started`` builds the home: ``build_home``'s signature (conform passes its own).
HomeBuilder = Callable[[FiberdConfig, Clock, Mapping[str, str], ProblemSink],
                       Awaitable[BuiltHome]]


@dataclass
class Fiberd:
    """A started fiberd: its home and its running parts."""

    built: BuiltHome
    running: Running
    config: FiberdConfig


@contextlib.asynccontextmanager
async def started(config: FiberdConfig, environ: Mapping[str, str],
                  clock: Clock | None = None, *,
                  build: HomeBuilder = build_home) -> AsyncIterator[Fiberd]:
    """Build the home, start fiberd; on exit undo the home (the caller serves or shuts down).

    ``build`` makes the home (default: the configured one; grant-conform
    passes a stage's builder). Raises HomeRefused or FiberdRefused when it
    cannot start. A start that fails after the socket listens (the home's
    announcement cannot be written) shuts that fiberd down again first
    (socket closed and its lock freed, the stop audited), so the next start
    on the same socket is not refused as "in use".
    """
    clock = clock or SystemClock()
    relay = ProblemRelay()
    built = await build(config, clock, environ, relay.report)
    try:
        running = await start_fiberd(config, built.home, clock, audience=built.audience,
                                     cgroup_reason=built.cgroup_line, relay=relay)
        try:
            built.announce(running.socket)
        except BaseException as err:
            why = f"cannot announce fiberd: {err}"
            await shutdown(running, [], why)
            if isinstance(err, OSError):  # e.g. safefs.UnsafePath: a state dir not ours
                raise FiberdRefused(why) from None
            raise
        yield Fiberd(built, running, config)
    finally:
        for line in await close_home(built):
            print(f"fiberd: {line}", file=sys.stderr, flush=True)


def stop_on_signals(stop: asyncio.Event) -> None:
    """Set ``stop`` on SIGTERM and SIGINT (on the running loop)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


async def run_daemon(config: FiberdConfig, environ: Mapping[str, str]) -> str:
    """Run fiberd until a stop signal or a home failure; the reason it stopped.

    The signals are caught before start-up, so a SIGTERM while fiberd starts (its
    socket may already answer) stops it cleanly once started, never kills it midway.
    """
    stop = asyncio.Event()
    stop_on_signals(stop)
    async with started(config, environ) as fiberd:
        return await serve(fiberd.running, stop)
