"""Running clauses against one stage: open it, run each clause in turn, close it, report.

``run_suite`` is the harness's one entry (the CLI and the pytest plugin both
call it). It makes a private work directory and a throwaway issuer, opens
the stage there, and runs every selected clause with a time budget. A
clause needing a lever the stage declares it lacks is a declared skip and is
not run. After each clause it checks that no process the clause started
(templates and fibers carry the run's mark) outlived fiberd; any it finds
are killed and the clause fails. Nothing a clause or stage raises escapes:
it becomes that clause's failure, with one line. The stage is closed and the
work directory removed even when a clause fails.
"""

from __future__ import annotations

import asyncio
import fnmatch
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from slurm_fiber import procs
from slurm_fiber.conform.clauses import CLAUSES, Clause
from slurm_fiber.conform.context import Context
from slurm_fiber.conform.issuer import ConformIssuer
from slurm_fiber.conform.live import ClauseFailed
from slurm_fiber.conform.report import Outcome, Report, Result
from slurm_fiber.conform.stage import Stage, StageCannot, missing_members

SETTLE_MARGIN = 10.0  # seconds beyond a few poll intervals for a home and the core to act


class Progress(Protocol):
    """Told as the run goes (e.g. to print a line per clause). Must not raise."""

    def started(self, clause: Clause) -> None: ...

    def finished(self, result: Result) -> None: ...


class NoClauseMatches(ValueError):
    """A clause pattern selected nothing (one line listing the clause names)."""


def select_clauses(pattern: str | None, clauses: Sequence[Clause] = CLAUSES) -> list[Clause]:
    """The clauses a pattern names: a glob (``removal.*``) or a substring; all for None.

    Raises NoClauseMatches when it names none.
    """
    if not pattern:
        return list(clauses)
    glob = any(c in pattern for c in "*?[")
    chosen = [c for c in clauses
              if (fnmatch.fnmatchcase(c.name, pattern) if glob else pattern in c.name)]
    if not chosen:
        raise NoClauseMatches(f"no clause matches {pattern!r}; clauses: "
                              + ", ".join(c.name for c in clauses))
    return chosen


def lacked(stage: Stage, clause: Clause) -> str | None:
    """Why the stage cannot run ``clause`` (its declared reason), None when it can."""
    lacks = stage.lacks
    missing = sorted(cap for cap in clause.needs if cap in lacks)
    if not missing:
        return None
    return "; ".join(f"no {cap}: {lacks[cap]}" for cap in missing)


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


async def run_clause(ctx: Context, clause: Clause, budget: float) -> Result:
    """Run one clause on a stage that can; its result. Never raises but cancellation."""
    began = time.monotonic()
    outcome, reason = Outcome.PASS, ""
    try:
        async with asyncio.timeout(budget):
            await clause.run(ctx)
    except ClauseFailed as err:
        outcome, reason = Outcome.FAIL, str(err)
    except StageCannot as err:
        outcome, reason = Outcome.UNDECLARED_SKIP, f"stage cannot: {err}"
    except TimeoutError:
        outcome, reason = Outcome.FAIL, f"did not finish within {budget:g} s"
    except Exception as err:
        outcome, reason = Outcome.FAIL, f"error: {_one_line(err)}"
    left = procs.marked(ctx.issuer.mark)
    if left:
        seen = ", ".join(procs.describe(pid) for pid in left[:3])
        procs.kill(left)
        outcome = Outcome.FAIL
        reason = "; ".join(filter(None, [reason, f"{len(left)} template/fiber process(es) "
                                         f"outlived fiberd (killed): {seen}"]))
    return Result(clause.name, outcome, reason, time.monotonic() - began)


async def run_suite(stage: Stage, clauses: Sequence[Clause] = CLAUSES, *,
                    strict: bool = False, progress: Progress | None = None,
                    settle_margin: float = SETTLE_MARGIN) -> Report:
    """Open ``stage`` in a private work directory, run ``clauses`` in order, close it.

    Blocks (on the caller's loop) for the whole run. ``settle_margin`` is
    added to a few poll intervals to bound how long a home and the core may
    take to act on a lever (lower it only where that is known to be fast:
    it is how long a broken home takes to fail). Raises only when the stage
    cannot be opened (its error, or TypeError when it is no Stage); every
    clause's trouble is a result.
    """
    if not isinstance(stage, Stage):
        raise TypeError(f"{type(stage).__name__} is not a Stage: it lacks "
                        + ", ".join(missing_members(stage)))
    workdir = Path(tempfile.mkdtemp(prefix="slurm-fiber-conform-"))
    mark = uuid.uuid4().hex
    try:
        issuer = ConformIssuer(workdir, mark)
        stage_dir = workdir / "stage"
        stage_dir.mkdir(mode=0o700)
        await stage.open(stage_dir, issuer.issuer)
        try:
            return await _run_open(stage, issuer, clauses, strict, progress, settle_margin)
        finally:
            await stage.close()
    finally:
        procs.kill(procs.marked(mark))
        shutil.rmtree(workdir, ignore_errors=True)


async def _run_open(stage: Stage, issuer: ConformIssuer, clauses: Sequence[Clause],
                    strict: bool, progress: Progress | None, margin: float) -> Report:
    config = stage.launch().config
    settle = margin + 5 * config.poll_interval + config.grace
    budget = 4 * settle + config.stale_ttl + 30.0
    results = []
    for clause in clauses:
        if progress is not None:
            progress.started(clause)
        why = lacked(stage, clause)
        if why is not None:
            result = Result(clause.name, Outcome.DECLARED_SKIP, why)
        else:
            ctx = Context(stage, issuer, clause.name, settle, config.stale_ttl)
            result = await run_clause(ctx, clause, budget)
        results.append(result)
        if progress is not None:
            progress.finished(result)
    return Report(stage.home, tuple(results), strict)
