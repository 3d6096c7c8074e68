"""The command line of both hooks: bare under slurmd, typer when a person runs it.

slurmd runs a hook with no arguments, and that path runs the hook as it is
(no option parsing, no typer). With any argument the typer command takes
over: ``--help`` explains the hook, ``--verbose`` prints what each step did,
``--json`` ends with one JSON object (the job, the exit code, the failed steps
and their reasons), ``--no-syslog`` keeps syslog out of a manual run. Exit
codes: 0 ok (or only non-fatal problems), 1 the node must drain (a fatal
check failed, or processes survived), 2 usage.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from slurm_fiber.hooks.hook import Hook
from slurm_fiber.version import exit_if_asked

HookRun = Callable[[Mapping[str, str], Hook], int]


def hook_main(name: str, help_text: str, run: HookRun) -> None:
    """Run hook ``name``: ``run(environ, hook)`` gives the exit code. Never returns."""
    if len(sys.argv) <= 1:
        sys.exit(run(os.environ, Hook(name)))
    exit_if_asked(name, sys.argv[1:])
    hook_app(name, help_text, run)(prog_name=name)


def hook_app(name: str, help_text: str, run: HookRun) -> Any:
    """The typer command of hook ``name`` for a person's run (and the man page's parser)."""
    import json

    import typer

    app = typer.Typer(add_completion=False, rich_markup_mode=None)

    @app.command(help=help_text)
    def command(
        verbose: bool = typer.Option(False, "--verbose", "-v",
                                     help="Also print what each step did."),
        as_json: bool = typer.Option(False, "--json",
                                     help="End with one JSON object: job, exit, failed steps."),
        no_syslog: bool = typer.Option(False, "--no-syslog",
                                       help="Write to stderr only (manual runs, tests)."),
        _version: bool = typer.Option(False, "--version",
                                      help="Print the version and exit."),
    ) -> None:
        hook = Hook(name, verbose=verbose, use_syslog=not no_syslog)
        code = run(os.environ, hook)
        if as_json:
            typer.echo(json.dumps({"hook": name, "job": hook.job, "exit": code,
                                   "failed": hook.failed, "notes": hook.notes}))
        raise typer.Exit(code)

    return app
