"""``slurm-fiber conform``: run grant-conform against one home and say whether it conforms.

It opens the home's stage, starts fiberd in this process for each clause
(exactly as the ``fiberd`` command wires it), pulls the stage's levers and
checks the core's contract, printing a line per clause as it goes (stderr)
and a table or JSON at the end (stdout). Started as root for the Slurm
home, it runs itself again as the stage's job user (fiberd runs as the job
user there, and the harness runs fiberd in its own process). Exit codes: 0 every clause passed
or was a declared skip, 1 a clause failed (or, with --strict, was skipped
without being declared) or the stage could not be opened, 2 usage (unknown
home, a clause pattern that matches nothing).
"""

from __future__ import annotations

import asyncio
import json
import os

import typer

from slurm_fiber.conform.clauses import CLAUSES, Clause
from slurm_fiber.conform.registry import UnknownStage, known_homes, stage_factory
from slurm_fiber.conform.report import Result
from slurm_fiber.conform.runner import (
    SETTLE_MARGIN,
    NoClauseMatches,
    run_suite,
    select_clauses,
)
from slurm_fiber.conform.stage import StageCannot

HELP = """Check that a home conforms to the core's contract (grant-conform).

The harness plays the control plane: it makes a throwaway issuer, opens
the home's stage (temporary directories, the home's control plane or a
stand-in), starts fiberd in this process for each clause, and checks:
pre-admission warms before the first Clone; removal releases fibers and
denies the UID until its tokens expire; redelivery lifts a denial; miss
codes follow source health; scope loss bumps the epoch or removes the
grant; readiness flips once per change; devices are provisioned exactly
and released. Progress goes to stderr, the report to stdout.

A clause needing a lever the home lacks (standalone has no control plane
and no scope) is a declared skip with the stage's reason; it never passes.

Examples:

  slurm-fiber conform --home standalone

  slurm-fiber conform --home standalone --clause 'removal.*' --json

  slurm-fiber conform --home mypkg.conform:MyStage --strict

Exit codes: 0 conformant; 1 a clause failed (with --strict also an
undeclared skip) or the stage could not be opened; 2 usage error.
"""


class _Lines:
    """Progress on stderr: one line as a clause starts, its outcome as it ends."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0

    def started(self, clause: Clause) -> None:
        self.done += 1
        typer.echo(f"conform: [{self.done}/{self.total}] {clause.name} ...", err=True)

    def finished(self, result: Result) -> None:
        tail = f": {result.reason}" if result.reason else ""
        typer.echo(f"conform:   {result.outcome.value} ({result.seconds:.1f} s){tail}",
                   err=True)


def _usage(line: str) -> typer.Exit:
    typer.echo(f"slurm-fiber conform: {line}", err=True)
    return typer.Exit(2)


def _listing() -> str:
    width = max(len(c.name) for c in CLAUSES)
    rows = [f"{c.name:<{width}}  {c.summary}"
            + (f" [needs {', '.join(sorted(c.needs))}]" if c.needs else "") for c in CLAUSES]
    return "\n".join([*rows, f"homes: {', '.join(known_homes())} (or module:StageFactory)"])


def _as_job_user(as_json: bool, clause: str, strict: bool, settle: float,
                 clauses: int) -> int:
    """This command again for the Slurm stage, as its job user (conform.slurm's
    rerun_as_job_user); the exit code."""
    # Lazy on purpose: the Slurm stage's module only when this command runs as root.
    from slurm_fiber.conform.slurm import rerun_as_job_user, rerun_bound

    args = ["conform", "--home", "slurm", "--settle", str(settle),
            *(["--json"] if as_json else []), *(["--clause", clause] if clause else []),
            *(["--strict"] if strict else [])]
    try:
        return rerun_as_job_user(args, os.environ, rerun_bound(clauses, settle))
    except KeyboardInterrupt:
        typer.echo("slurm-fiber conform: interrupted; fiberd stopped", err=True)
        return 1
    except (StageCannot, OSError) as err:
        typer.echo(f"slurm-fiber conform: the slurm stage could not run: {err}", err=True)
        return 1


def command(
    home: str = typer.Option("", "--home", metavar="NAME",
                             help="The home to check: a registered name (standalone, ...) "
                                  "or module:StageFactory."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON "
                                 "object (progress stays on stderr)."),
    clause: str = typer.Option("", "--clause", metavar="PATTERN",
                               help="Run only clauses matching a glob ('removal.*') or "
                                    "containing the text."),
    strict: bool = typer.Option(False, "--strict", help="Count undeclared skips (a lever "
                                "that failed at run time) as failures."),
    settle: float = typer.Option(SETTLE_MARGIN, "--settle", metavar="SECONDS", min=0.1,
                                 help="Seconds (beyond a few poll intervals) a home may take "
                                      "to act on a lever before a clause fails."),
    list_clauses: bool = typer.Option(False, "--list", help="List the clauses and known "
                                      "homes, then exit."),
) -> None:
    if list_clauses:
        typer.echo(_listing())
        return
    if not home:
        raise _usage("give --home NAME (known: " + ", ".join(known_homes()) + ")")
    try:
        factory = stage_factory(home)
        chosen = select_clauses(clause or None)
    except (UnknownStage, NoClauseMatches) as err:
        raise _usage(str(err)) from None
    if home == "slurm" and os.geteuid() == 0:
        # fiberd runs as the job user, and the harness runs fiberd in its own process.
        raise typer.Exit(_as_job_user(as_json, clause, strict, settle, len(chosen)))
    try:
        stage = factory()
        report = asyncio.run(run_suite(stage, chosen, strict=strict, settle_margin=settle,
                                       progress=_Lines(len(chosen))))
    except KeyboardInterrupt:
        typer.echo("slurm-fiber conform: interrupted; fiberd stopped", err=True)
        raise typer.Exit(1) from None
    except Exception as err:
        typer.echo(f"slurm-fiber conform: the {home} stage could not run: "
                   f"{type(err).__name__}: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(report.to_json(), indent=2) if as_json else report.table())
    if not report.ok:
        raise typer.Exit(1)
