"""The ``fiberd-run`` command: fiberd in the foreground, optionally running one command as a fiber.

Inside a Slurm job step (``srun --overlap fiberd-run``) it runs fiberd with
the Slurm home and the prolog's grantdir; with no job in the environment it
uses the standalone home; ``--home NAME`` (or FIBERD_HOME), as fiberd takes
it, picks one. ``--standalone`` is the deprecated spelling of ``--home
standalone`` (it says so on stderr). It never daemonizes: it serves until
SIGTERM/SIGINT, then stops and waits for every child. With ``-- CMD ...`` it
waits until a template is warm, runs CMD as a fiber (exec mode, this
terminal's stdin/stdout/stderr, Ctrl-C forwarded to it), then stops fiberd
and exits with CMD's status. Like ``fiberd``, it imports asyncio only once its
configuration names the home (cli/fiberd.py's ``configured``; its loop is
cli/fiberd_run_loop.py).

Exit codes: CMD's status (128+N when a signal N ended it); without CMD, 0
after a clean stop; 1 when fiberd cannot start, no template warms within
``--warm-timeout``, or the Clone misses (its code and reason on stderr);
2 for a usage error.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Mapping
from typing import Any

from slurm_fiber.cli.fiberd import CommandExit, configured, run_loop, say
from slurm_fiber.cli.fiberd_options import KW, option_parameters, plain_flags, with_parameters
from slurm_fiber.cli.fiberd_run_loop import run
from slurm_fiber.homes.select import claiming
from slurm_fiber.version import exit_if_asked

WARM_TIMEOUT = 120.0  # seconds --warm-timeout defaults to

HELP = """Run fiberd in the foreground; with `-- CMD ...`, run CMD as a fiber once warm.

\b
  srun --overlap fiberd-run &          in a Slurm batch script: fiberd for this job
  fiberd-run --home standalone -- CMD ...   a plain host: serve, run CMD, stop, exit with its status

Takes every fiberd option (see `fiberd --help`); the home is --home NAME, else slurm
inside a job, else standalone (--standalone: deprecated, same as --home standalone).
--version prints the version and exits.

Exit codes: CMD's status (128+N for signal N, 126/127 when its exec failed); without
CMD 0 after SIGTERM/SIGINT; 1 fiberd could not start, no template warmed in time, or
the Clone missed; 2 usage error.
"""



def choose_home(flags: Mapping[str, object], standalone: bool,
                environ: Mapping[str, str]) -> dict[str, object]:
    """The flags with the home decided: --standalone (deprecated), else --home, else
    $FIBERD_HOME, else the first registered home that claims the environment (slurm
    inside a job), else standalone. Raises UsageError (exit 2) for --standalone with
    another --home."""
    out = dict(flags)
    if standalone:
        if out.get("home") not in (None, "", "standalone"):
            raise UsageError(f"--standalone (deprecated: --home standalone) "
                             f"contradicts --home {out['home']}")
        out["home"] = "standalone"
    elif not out.get("home") and not environ.get("FIBERD_HOME"):
        out["home"] = claiming(environ)
    return out


class UsageError(Exception):
    """A command line that contradicts itself: a usage error (exit 2), as typer says it."""


def fiberd_run_command(**flags: Any) -> None:
    """Serve, and run ``cmd`` once warm. Raises CommandExit with the status (module doc),
    UsageError for contradicting flags."""
    argv = list(flags.pop("cmd") or [])
    warm_timeout = float(flags.pop("warm_timeout"))
    standalone = bool(flags.pop("standalone"))
    if standalone:
        say("fiberd-run: --standalone is deprecated; use --home standalone")
    config = configured(choose_home(flags, standalone, os.environ))
    raise CommandExit(run_loop(run(config, argv, warm_timeout)))


def typer_app() -> Any:
    """The typer command for a command line that is not plain flags (``--help``, an
    unknown flag): built only then, so a daemon started with plain flags never loads
    typer."""
    import typer

    def command(**flags: Any) -> None:
        try:
            fiberd_run_command(**flags)
        except UsageError as err:
            raise typer.BadParameter(str(err)) from None
        except CommandExit as done:
            raise typer.Exit(done.code) from None

    params = [
        inspect.Parameter("standalone", KW, annotation=bool, default=typer.Option(
            False, "--standalone", hidden=True,
            help="deprecated: --home standalone (says so on stderr)")),
        inspect.Parameter("warm_timeout", KW, annotation=float, default=typer.Option(
            WARM_TIMEOUT, "--warm-timeout",
            help="seconds to wait for a warm template before running CMD")),
        *option_parameters(),
        inspect.Parameter("cmd", KW, annotation=list[str] | None,
                          default=typer.Argument(None, metavar="[-- CMD ...]")),
    ]
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                      rich_markup_mode=None)
    app.command(help=HELP, context_settings={"allow_interspersed_args": False})(
        with_parameters(command, params))
    return app


def plain_run_flags(argv: list[str]) -> dict[str, object] | None:
    """fiberd-run's parameters from plain flags and ``-- CMD ...`` (``plain_flags``); None
    for anything else, which typer parses."""
    split = argv.index("--") if "--" in argv else len(argv)
    flags = plain_flags(argv[:split], {"--warm-timeout": False, "--standalone": True})
    if flags is None:
        return None
    try:
        flags["warm_timeout"] = float(str(flags["warm_timeout"] or WARM_TIMEOUT))
    except ValueError:
        return None
    flags["cmd"] = argv[split + 1:]
    return flags


def main() -> None:
    """Console-script entry point: plain flags without typer's parser (``plain_flags``)."""
    exit_if_asked("fiberd-run", sys.argv[1:])
    flags = plain_run_flags(sys.argv[1:])
    if flags is None:
        typer_app()()
        return
    try:
        fiberd_run_command(**flags)
    except UsageError as err:  # as typer would say it: a usage error
        import typer

        bad = typer.BadParameter(str(err))
        bad.show()
        sys.exit(bad.exit_code)
    except CommandExit as done:
        sys.exit(done.code)
