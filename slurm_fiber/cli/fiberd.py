"""The ``fiberd`` command: the daemon in the foreground, with its home, until SIGTERM/SIGINT.

Exit codes: 0 after a clean stop (SIGTERM or SIGINT: fibers and templates
stopped, cgroups and the socket removed), 1 when fiberd refuses to start
(bad configuration, no trust, an unusable socket path or state) or its home
fails, 2 for a usage error. Errors are one line on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import typer

from slurm_fiber.cli.fiberd_options import option_parameters, resolve_config, with_parameters
from slurm_fiber.config import ConfigError, FiberdConfig
from slurm_fiber.core.clock import Clock, SystemClock
from slurm_fiber.daemon import (
    FiberdRefused,
    ProblemRelay,
    Running,
    serve,
    shutdown,
    start_fiberd,
)
from slurm_fiber.homes.problem import ProblemSink
from slurm_fiber.homes.select import BuiltHome, HomeRefused, build_home, close_home
from slurm_fiber.logs import setup_logging

HELP = """Run fiberd, the per-allocation daemon: it verifies grants, keeps a warm template
per grant and forks fibers from it on each Clone over a local Unix socket.

Every option can also come from a TOML file (--config) or an environment variable
(FIBERD_<OPTION>); flags win over the environment, which wins over the file.
Homes: standalone (a plain host, grants from a directory), slurm (inside a job
step, run it as `srun --overlap fiberd-run`), kubernetes (the grant Pod).

Exit codes: 0 clean stop on SIGTERM/SIGINT; 1 refused to start or the home
failed (one line on stderr says why); 2 usage error.
"""

STARTUP_ERRORS = (ConfigError, HomeRefused, FiberdRefused)

# How ``started`` builds the home: ``build_home``'s signature (conform passes its own).
HomeBuilder = Callable[[FiberdConfig, Clock, Mapping[str, str], ProblemSink],
                       Awaitable[BuiltHome]]


def fail(line: str) -> typer.Exit:
    """Print ``fiberd: line`` to stderr; the Exit(1) to raise."""
    typer.echo(f"fiberd: {line}", err=True)
    return typer.Exit(1)


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
                                     relay=relay)
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
            typer.echo(f"fiberd: {line}", err=True)


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
        return await serve(fiberd.running, fiberd.built.home, stop)


def fiberd_command(**flags: Any) -> None:
    try:
        config = resolve_config(flags, os.environ)
        setup_logging(config.log_format, config.log_level)
        why = asyncio.run(run_daemon(config, os.environ))
    except STARTUP_ERRORS as err:
        raise fail(str(err)) from None
    if why != "stop requested":
        raise fail(why)


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
app.command(help=HELP)(with_parameters(fiberd_command, option_parameters()))


def main() -> None:
    """Console-script entry point."""
    app()
