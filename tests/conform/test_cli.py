"""``slurm-fiber conform`` run as a user runs it: real fiberd, templates and fibers.

The standalone home conforms (exit 0, every clause it can exercise passes,
the others are declared skips with a reason); deliberately broken homes
(tests/conform/brokenkit.py) fail exactly the clause they break and exit 1;
--strict turns an undeclared skip into a failure; the JSON report has a
stable shape; usage errors exit 2.
"""

from __future__ import annotations

import json
import time

import pytest
from typer.testing import CliRunner

from slurm_fiber.cli.main import app
from tests.conform.conformkit import conform, outcomes

BROKEN = "tests.conform.brokenkit"


def test_standalone_conforms_with_its_lacks_declared() -> None:
    began = time.monotonic()
    run = conform("--home", "standalone")
    took = time.monotonic() - began
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {line.split()[0]: line for line in run.stdout.splitlines()[1:-1]}
    for clause in ("preadmission.warms", "removal.releases", "removal.denies",
                   "redelivery.lifts", "misses.fresh", "readiness.flips",
                   "devices.provisioned"):
        assert rows[clause].split()[1] == "pass", rows[clause]
    for clause, why in (("misses.stale", "no control_plane"), ("misses.never", "no control_plane"),
                        ("devices.released", "no device_holds"), ("scope.loss", "no scope")):
        assert rows[clause].split()[1] == "declared-skip" and why in rows[clause]
    assert run.stdout.splitlines()[-1].startswith("home standalone: conformant (7 pass, 0 fail")
    assert run.stderr.count("conform: [") == 11  # progress: a line per clause as it starts
    assert took < 30, f"conform --home standalone took {took:.1f} s"


@pytest.mark.parametrize(("stage", "clause", "says"), [
    ("NoRemovalsStage", "removal.releases", "gone from fiberd: not seen within"),
    ("FlappingReadinessStage", "readiness.flips", "[True, False, True, False]"),
    ("LeakyDevicesStage", "devices.provisioned", "expected []"),
])
def test_a_broken_home_fails_the_clause_it_breaks(stage: str, clause: str, says: str) -> None:
    run = conform("--home", f"{BROKEN}:{stage}", "--clause", clause, "--json", "--settle", "1")
    assert run.returncode == 1, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert report["ok"] is False and outcomes(report) == {clause: "fail"}
    assert says in report["clauses"][0]["reason"]


def test_the_same_broken_home_passes_the_clauses_it_keeps() -> None:
    run = conform("--home", f"{BROKEN}:LeakyDevicesStage", "--clause", "readiness.flips")
    assert run.returncode == 0, run.stdout + run.stderr


def test_strict_fails_an_undeclared_skip() -> None:
    lax = conform("--home", f"{BROKEN}:CannotDeliverStage", "--clause", "preadmission",
                  "--json")
    assert lax.returncode == 0, lax.stdout + lax.stderr
    assert outcomes(json.loads(lax.stdout)) == {"preadmission.warms": "undeclared-skip"}
    strict = conform("--home", f"{BROKEN}:CannotDeliverStage", "--clause", "preadmission",
                     "--strict", "--json")
    assert strict.returncode == 1
    assert json.loads(strict.stdout)["ok"] is False


def test_json_report_shape() -> None:
    run = conform("--home", "standalone", "--clause", "misses.*", "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)  # stdout is the JSON alone; progress went to stderr
    assert set(report) == {"version", "home", "ok", "strict", "summary", "clauses"}
    assert report["version"] == 1 and report["home"] == "standalone" and report["ok"] is True
    assert report["summary"] == {"pass": 1, "fail": 0, "declared-skip": 2,
                                 "undeclared-skip": 0}
    for entry in report["clauses"]:
        assert set(entry) == {"clause", "outcome", "reason", "seconds"}
        assert isinstance(entry["seconds"], float | int)
    assert outcomes(report) == {"misses.fresh": "pass", "misses.stale": "declared-skip",
                                "misses.never": "declared-skip"}
    assert "conform: [1/3] misses.fresh" in run.stderr


@pytest.mark.parametrize(("args", "says"), [
    ((), "give --home NAME"),
    (("--home", "nowhere"), "no conformance stage for home 'nowhere'"),
    (("--home", "standalone", "--clause", "no-such-clause"), "no clause matches"),
    (("--home", "no.such.module:Stage"), "cannot load no.such.module:Stage"),
    (("--home", ":"), "cannot load :"),
    (("--home", "standalone", "--bogus"), "No such option"),
])
def test_usage_errors_exit_2_with_one_line(args: tuple[str, ...], says: str) -> None:
    run = CliRunner().invoke(app, ["conform", *args])
    assert run.exit_code == 2, run.output
    assert says in run.output


def test_a_factory_that_gives_no_stage_is_refused_in_one_line() -> None:
    run = CliRunner().invoke(app, ["conform", "--home", "collections:OrderedDict"])
    assert run.exit_code == 1
    assert "the collections:OrderedDict stage could not run: TypeError: OrderedDict is not " \
        "a Stage: it lacks home, lacks, open" in run.output


def test_list_names_every_clause_and_home() -> None:
    run = CliRunner().invoke(app, ["conform", "--list"])
    assert run.exit_code == 0
    assert "removal.denies" in run.output and "homes: standalone, slurm, kubernetes" in run.output
    assert "[needs control_plane]" in run.output
