"""The harness's own rules: reports, clause selection, declared lacks, the stage registry,
how a clause's trouble becomes its result, leftover processes, and the standalone stage's
lifecycle. Real processes where a process is the point; no fiberd needed here.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from slurm_fiber import procs
from slurm_fiber.conform.clauses import CLAUSES, Clause, _flips
from slurm_fiber.conform.context import Context
from slurm_fiber.conform.issuer import ConformIssuer
from slurm_fiber.conform.live import ClauseFailed
from slurm_fiber.conform.registry import UnknownStage, stage_factory
from slurm_fiber.conform.report import Outcome, Report, Result
from slurm_fiber.conform.runner import (
    NoClauseMatches,
    lacked,
    run_clause,
    run_suite,
    select_clauses,
)
from slurm_fiber.conform.stage import Capability, Stage, StageCannot
from slurm_fiber.conform.standalone import StandaloneStage
from slurm_fiber.homes.sdnotify import NOTIFY_ENV


def report(*outcomes: Outcome, strict: bool = False) -> Report:
    return Report("h", tuple(Result(f"c{i}", o, "why" if o is not Outcome.PASS else "")
                             for i, o in enumerate(outcomes)), strict)


def test_a_run_fails_on_a_failure_and_on_an_undeclared_skip_only_when_strict() -> None:
    assert report(Outcome.PASS, Outcome.DECLARED_SKIP).ok
    assert not report(Outcome.PASS, Outcome.FAIL).ok
    assert report(Outcome.UNDECLARED_SKIP).ok
    assert not report(Outcome.UNDECLARED_SKIP, strict=True).ok
    assert report(Outcome.DECLARED_SKIP, strict=True).ok


def test_report_renders_a_table_and_json() -> None:
    r = report(Outcome.PASS, Outcome.FAIL)
    lines = r.table().splitlines()
    assert lines[0].split() == ["clause", "outcome", "reason"]
    assert lines[2].split() == ["c1", "fail", "why"]
    assert lines[-1] == ("home h: NOT conformant (1 pass, 1 fail, 0 declared-skip, "
                         "0 undeclared-skip)")
    assert r.to_json()["clauses"] == [
        {"clause": "c0", "outcome": "pass", "reason": "", "seconds": 0.0},
        {"clause": "c1", "outcome": "fail", "reason": "why", "seconds": 0.0}]


def test_clause_patterns_are_globs_or_substrings() -> None:
    assert [c.name for c in select_clauses("removal.*")] == ["removal.releases",
                                                             "removal.denies"]
    assert [c.name for c in select_clauses("stale")] == ["misses.stale"]
    assert select_clauses(None) == list(CLAUSES)
    with pytest.raises(NoClauseMatches, match=r"clauses: preadmission\.warms"):
        select_clauses("nothing*")


def test_clause_names_are_unique_and_every_capability_is_needed_somewhere() -> None:
    assert len({c.name for c in CLAUSES}) == len(CLAUSES)
    assert set().union(*(c.needs for c in CLAUSES)) == set(Capability)


def test_a_lack_is_reported_with_the_stage_reason() -> None:
    stage = StandaloneStage()
    by_name = {c.name: c for c in CLAUSES}
    assert lacked(stage, by_name["removal.releases"]) is None
    assert lacked(stage, by_name["devices.provisioned"]) is None
    assert lacked(stage, by_name["scope.loss"]) == (
        "no scope: a plain host asserts no scope, so it has none to lose")


def test_readiness_history_folds_republishes_but_not_flips() -> None:
    assert _flips((True, True, False, False)) == [True, False]
    assert _flips((True, False, True, False)) == [True, False, True, False]
    assert _flips(()) == []


def test_registry_resolves_builtin_and_import_specs_and_refuses_the_rest() -> None:
    assert stage_factory("standalone") is StandaloneStage
    assert stage_factory("slurm_fiber.conform.standalone:StandaloneStage") is StandaloneStage
    with pytest.raises(UnknownStage, match="known: standalone, slurm, kubernetes"):
        stage_factory("nowhere")
    with pytest.raises(UnknownStage, match="cannot load"):
        stage_factory("slurm_fiber.conform.standalone:Missing")
    with pytest.raises(UnknownStage, match="not a Stage class or factory"):
        stage_factory("slurm_fiber.conform.standalone:POLL_INTERVAL")


def test_the_standalone_stage_names_its_notify_socket_to_fiberd_only(tmp_path: Path) -> None:
    stage = StandaloneStage()
    assert isinstance(stage, Stage)
    before = os.environ.get(NOTIFY_ENV)

    async def body() -> None:
        issuer = ConformIssuer(tmp_path, "m")
        (tmp_path / "stage").mkdir(mode=0o700)
        await stage.open(tmp_path / "stage", issuer.issuer)
        launch = stage.launch()
        assert launch.environ[NOTIFY_ENV] == str(tmp_path / "stage" / "notify.sock")
        assert os.environ.get(NOTIFY_ENV) == before
        assert launch.config.trust == {"grant-conform": str(issuer.issuer.jwks)}
        assert (tmp_path / "issuer.jwks.json").stat().st_mode & 0o077 == 0
        await stage.close()

    asyncio.run(body())
    assert os.environ.get(NOTIFY_ENV) == before


def _run_one(tmp_path: Path, body: Callable[[Context], Awaitable[None]],
             budget: float = 10.0) -> tuple[Result, str]:
    issuer = ConformIssuer(tmp_path, os.urandom(8).hex())
    ctx = Context(StandaloneStage(), issuer, "t.clause", settle=1.0, stale_ttl=1.0)
    result = asyncio.run(run_clause(ctx, Clause("t.clause", "a test", body), budget))
    return result, issuer.mark


@pytest.mark.parametrize(("raised", "outcome", "reason"), [
    (ClauseFailed("expected x, saw y"), Outcome.FAIL, "expected x, saw y"),
    (StageCannot("no GPU on this cluster"), Outcome.UNDECLARED_SKIP,
     "stage cannot: no GPU on this cluster"),
    (ValueError("bad\nsecond line"), Outcome.FAIL, "error: ValueError: bad"),
])
def test_a_clause_trouble_becomes_its_result(tmp_path: Path, raised: Exception,
                                             outcome: Outcome, reason: str) -> None:
    async def body(ctx: Context) -> None:
        raise raised

    result, _ = _run_one(tmp_path, body)
    assert (result.outcome, result.reason) == (outcome, reason)


def test_a_clause_over_its_budget_fails(tmp_path: Path) -> None:
    async def body(ctx: Context) -> None:
        await asyncio.Event().wait()

    result, _ = _run_one(tmp_path, body, budget=0.2)
    assert result.outcome is Outcome.FAIL and result.reason == "did not finish within 0.2 s"


def test_a_process_of_the_run_left_behind_fails_the_clause_and_is_killed(
        tmp_path: Path) -> None:
    spawned: list[subprocess.Popen[bytes]] = []

    async def body(ctx: Context) -> None:
        env = {**os.environ, procs.MARK_ENV: ctx.issuer.mark}
        spawned.append(subprocess.Popen([sys.executable, "-c", "import time; "
                                         "time.sleep(60)"], env=env))
        while not procs.marked(ctx.issuer.mark):
            await asyncio.sleep(0.01)

    result, mark = _run_one(tmp_path, body)
    assert result.outcome is Outcome.FAIL
    assert "1 template/fiber process(es) outlived fiberd (killed)" in result.reason
    assert spawned[0].wait(timeout=5) == -9 and not procs.marked(mark)


class _FailingOpen(StandaloneStage):
    async def open(self, workdir: Path, issuer: object) -> None:  # type: ignore[override]
        self.workdir = workdir
        raise OSError("no room")


def test_a_stage_that_cannot_open_raises_and_leaves_no_workdir() -> None:
    stage = _FailingOpen()
    with pytest.raises(OSError, match="no room"):
        asyncio.run(run_suite(stage, select_clauses("misses.fresh")))
    assert not stage.workdir.parent.exists()
