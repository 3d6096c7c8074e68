"""The clauses standalone cannot exercise, run against a home that has every lever.

``tests/conform/planekit.py`` gives the real standalone home a pretend control
plane (HealthPoll, ScopeLossQueue, a scope claim, device holds). With it
every clause runs and passes; each broken variant fails exactly the clause
for the promise it breaks. Real fiberd, templates and fibers, in-process.
"""

from __future__ import annotations

import asyncio

import pytest

from slurm_fiber.conform.report import Outcome
from slurm_fiber.conform.runner import run_suite, select_clauses
from slurm_fiber.conform.stage import Stage
from tests.conform import planekit

FAST_FAIL = 1.0  # settle margin: these homes act within a few poll intervals


def run(stage: Stage, pattern: str | None = None) -> dict[str, tuple[Outcome, str]]:
    report = asyncio.run(run_suite(stage, select_clauses(pattern), settle_margin=FAST_FAIL))
    return {r.clause: (r.outcome, r.reason) for r in report.results}


def test_a_home_with_every_lever_passes_every_clause() -> None:
    results = run(planekit.PlaneStage())
    assert {name: outcome for name, (outcome, _) in results.items()} == {
        name: Outcome.PASS for name in results}
    assert len(results) == 11


def test_scope_loss_may_remove_the_grants_instead_of_only_bumping() -> None:
    assert run(planekit.RemovingPlaneStage(), "scope.loss") == {"scope.loss": (Outcome.PASS, "")}


@pytest.mark.parametrize(("stage", "pattern", "failed", "says"), [
    (planekit.DeafPlaneStage, "misses.*", {"misses.stale", "misses.never"}, "source health"),
    (planekit.ScopeKeepingStage, "scope.loss", {"scope.loss"}, "bumping the epoch or removing"),
    (planekit.HoardingStage, "devices.*", {"devices.released"}, "devices of the removed grant "
                                                             "released"),
])
def test_a_broken_lever_fails_its_clause(stage: type[Stage], pattern: str, failed: set[str],
                                         says: str) -> None:
    results = run(stage(), pattern)
    assert {name for name, (outcome, _) in results.items() if outcome is Outcome.FAIL} == failed
    assert all(says in results[name][1] for name in failed)
    assert all(outcome is Outcome.PASS for name, (outcome, _) in results.items()
               if name not in failed)
