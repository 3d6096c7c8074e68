"""The ``slurm-fiber`` command: admin tools that need no Python.

Each command group lives in its own module and is added here. Exit codes,
shared by every group: 0 success, 1 refused or failed (the one-line reason is
printed), 2 usage error.
"""

from __future__ import annotations

import typer

from slurm_fiber.cli.audit import HELP as AUDIT_HELP
from slurm_fiber.cli.audit import audit_command
from slurm_fiber.cli.conform import HELP as CONFORM_HELP
from slurm_fiber.cli.conform import command as conform_command
from slurm_fiber.cli.quickstart import HELP as QUICKSTART_HELP
from slurm_fiber.cli.quickstart import quickstart
from slurm_fiber.cli.tokens import keys_app, token_app
from slurm_fiber.lease.cli import app as lease_app

app = typer.Typer(
    name="slurm-fiber",
    help="slurm_fiber admin tools: issuer keys, grant tokens, leases, audit, conformance.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(keys_app, name="keys")
app.add_typer(token_app, name="token")
app.add_typer(lease_app, name="lease")
app.command("quickstart", help=QUICKSTART_HELP)(quickstart)
app.command("audit", help=AUDIT_HELP)(audit_command)
app.command("conform", help=CONFORM_HELP)(conform_command)


def main() -> None:
    """Console-script entry point."""
    app()
