"""The ``slurm-fiber`` command: admin tools that need no Python.

Each command group lives in its own module, named in ``SUBCOMMANDS`` with a
one-line summary, and is imported only when it runs (``slurm-fiber --help``
imports none of them). Exit codes, shared by every group (the table in
README "Commands"): 0 success, 1 refused or failed (the one-line reason is
printed), 2 usage error.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import typer
import typer.core
import typer.main

if TYPE_CHECKING:  # the click this typer uses (recent typer vendors it as typer._click)
    from typer._click import Command, Context, HelpFormatter

EXIT_CODES = "Exit codes: 0 success; 1 refused or failed (one line says why); 2 usage error."

# name -> (module:attribute, summary for --help). The attribute is a Typer app (a group)
# or a (function, HELP attribute name) registered as one command.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "keys": ("slurm_fiber.cli.tokens:keys_app", "Issuer signing keys and their JWKS."),
    "token": ("slurm_fiber.cli.tokens:token_app", "Grant tokens: mint, verify, inspect."),
    "lease": ("slurm_fiber.lease.cli:app",
              "Hold a machine's shared resources one holder at a time."),
    "quickstart": ("slurm_fiber.cli.quickstart:quickstart",
                   "Run the main job here, with nothing set up."),
    "audit": ("slurm_fiber.cli.audit:audit_command", "Read fiberd's audit log."),
    "conform": ("slurm_fiber.cli.conform:command",
                "Check that a home conforms to the core's contract (grant-conform)."),
    "node-metrics": ("slurm_fiber.cli.nodemetrics:node_metrics",
                     "Relay every job's fiberd metrics on this node to node_exporter."),
    "files": ("slurm_fiber.cli.files:files",
              "Where this install keeps contrib files, man pages and completion."),
}
# The function commands' long help, by the module attribute holding it.
HELP_ATTRIBUTE = {"quickstart": "HELP", "audit": "HELP", "conform": "HELP", "files": "HELP",
                  "node-metrics": "HELP"}


def load(name: str) -> Command:
    """Import subcommand ``name``'s module and return it as a click command."""
    target, _summary = SUBCOMMANDS[name]
    module_name, attribute = target.split(":")
    module = importlib.import_module(module_name)
    obj = getattr(module, attribute)
    if isinstance(obj, typer.Typer):
        command: Command = typer.main.get_group(obj)
    else:
        single = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
        single.command(name, help=getattr(module, HELP_ATTRIBUTE[name]))(obj)
        command = typer.main.get_command(single)
    command.name = name
    plain_help(command)
    return command


def plain_help(command: Command) -> None:
    """One help style for every command: click's plain layout, as the top level and
    fiberd's, not rich's boxes (a group's subcommands included)."""
    for each in [command, *getattr(command, "commands", {}).values()]:
        if hasattr(each, "rich_markup_mode"):
            each.rich_markup_mode = None
        if each is not command:
            plain_help(each)


class LazyGroup(typer.core.TyperGroup):
    """A group whose subcommands are imported on first use; --help lists the summaries."""

    def list_commands(self, ctx: Context) -> list[str]:
        return list(SUBCOMMANDS)

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        return load(cmd_name) if cmd_name in SUBCOMMANDS else None

    def format_commands(self, ctx: Context, formatter: HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, summary) for name, (_t, summary) in SUBCOMMANDS.items()])


app = typer.Typer(
    name="slurm-fiber",
    cls=LazyGroup,
    help="slurm_fiber admin tools: issuer keys, grant tokens, leases, audit, conformance.\n\n"
         + EXIT_CODES,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)



def _print_version(asked: bool) -> None:
    if asked:
        from slurm_fiber.version import version_line

        typer.echo(version_line("slurm-fiber"))
        raise typer.Exit(0)


@app.callback()
def _group(
    _version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                  help="Print the version and exit."),
) -> None:
    """The group itself does nothing; its subcommands do the work."""


def main() -> None:
    """Console-script entry point."""
    app()
