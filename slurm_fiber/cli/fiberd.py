"""The ``fiberd`` command: the daemon in the foreground, with its home, until SIGTERM/SIGINT.

Exit codes: 0 after a clean stop (SIGTERM or SIGINT: fibers and templates
stopped, cgroups and the socket removed), 1 when fiberd refuses to start
(bad configuration, no trust, an unusable socket path or state) or its home
fails, 2 for a usage error. Errors are one line on stderr.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from slurm_fiber.cli.fiberd_options import (
    option_parameters,
    plain_flags,
    resolve_config,
    with_parameters,
)
from slurm_fiber.config import ConfigError, FiberdConfig
from slurm_fiber.daemon import FiberdRefused, run_daemon
from slurm_fiber.homes.select import HomeRefused, lookup, names
from slurm_fiber.logs import setup_logging
from slurm_fiber.version import exit_if_asked

T = TypeVar("T")

HELP = """Run fiberd, the per-allocation daemon: it verifies grants, keeps a warm template
per grant and forks fibers from it on each Clone over a local Unix socket.

Every option can also come from a TOML file (--config) or an environment variable
(FIBERD_<OPTION>); flags win over the environment, which wins over the file.

\b
Homes (--home NAME; the built-ins and those installed under the entry point group
slurm_fiber.homes), each with the options it reads:
{homes}

Metrics (off by default): --metrics-listen HOST:PORT serves Prometheus GET /metrics
(PORT alone: 127.0.0.1), --metrics-textfile DIR writes a .prom file for node_exporter's
textfile collector; both labelled with the home, and on Slurm the job id and node.

--version prints the version and exits.

Exit codes: 0 clean stop on SIGTERM/SIGINT; 1 refused to start or the home
failed (one line on stderr says why); 2 usage error.
"""

def describe_homes() -> str:
    """One help line per registered home: its name, summary and the options it reads
    (an installed home that cannot be loaded says why instead). Never raises."""
    lines = []
    for name in names():
        try:
            entry = lookup(name)
        except HomeRefused as err:
            lines.append(f"  {name:12} cannot be loaded: {err}")
            continue
        reads = f" [{', '.join(entry.options)}]" if entry.options else ""
        lines.append(f"  {name:12} {entry.summary}{reads}")
    return "\n".join(lines)


class CommandExit(Exception):
    """Leave the command with exit status ``code`` (its line, if any, already printed)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def say(line: str) -> None:
    """One line on stderr, as the commands print their errors and progress."""
    print(line, file=sys.stderr, flush=True)


def fail(line: str) -> CommandExit:
    """Print ``fiberd: line`` to stderr; the CommandExit(1) to raise."""
    say(f"fiberd: {line}")
    return CommandExit(1)


def configured(flags: Mapping[str, object]) -> FiberdConfig:
    """The configuration from ``flags`` and the environment, with logging set up from it:
    a daemon command's first step. Raises CommandExit(1) (its line printed) for a refused
    configuration or home."""
    try:
        config = resolve_config(flags, os.environ)
    except (ConfigError, HomeRefused) as err:
        raise fail(str(err)) from None
    setup_logging(config.log_format, config.log_level)
    return config


def run_loop(daemon: Coroutine[Any, Any, T]) -> T:
    """What ``daemon`` returns, run on a new event loop. Raises CommandExit(1) (its line
    printed) when fiberd refuses to start."""
    try:
        return asyncio.run(daemon)
    except (ConfigError, HomeRefused, FiberdRefused) as err:
        raise fail(str(err)) from None


def fiberd_command(**flags: Any) -> None:
    """Run the daemon with ``flags`` until it stops. Raises CommandExit(1) when it refuses
    to start or ends for another reason than a stop request."""
    config = configured(flags)
    why = run_loop(run_daemon(config, os.environ))
    if why != "stop requested":
        raise fail(why)


def typer_app() -> Any:
    """The typer command for a command line that is not plain flags (``--help``, an
    unknown flag): built, with the list of homes, only then (typer and the installed
    homes' metadata stay out of fiberd: core/runtime/memory.py)."""
    import typer

    def command(**flags: Any) -> None:
        try:
            fiberd_command(**flags)
        except CommandExit as done:
            raise typer.Exit(done.code) from None

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                      rich_markup_mode=None)
    app.command(help=HELP.format(homes=describe_homes()))(
        with_parameters(command, option_parameters()))
    return app


def main() -> None:
    """Console-script entry point: plain flags without typer's parser (``plain_flags``)."""
    exit_if_asked("fiberd", sys.argv[1:])
    flags = plain_flags(sys.argv[1:])
    if flags is None:
        typer_app()()
        return
    try:
        fiberd_command(**flags)
    except CommandExit as done:
        sys.exit(done.code)
