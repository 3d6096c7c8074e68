"""The pytest plugin: inert unless asked, and the same clauses as pytest items when asked.

Each test runs a separate pytest in an empty directory (this repo's conftest
does not apply there), with the plugin loaded from its ``pytest11`` entry
point as any installation would load it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def pytest_in(where: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA",
                           *args], cwd=where, env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_without_the_option_nothing_is_added(tmp_path: Path) -> None:
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    run = pytest_in(tmp_path, "-q", "--co")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "conform" not in run.stdout and "1 test collected" in run.stdout
    helped = pytest_in(tmp_path, "--help")
    assert "--conform-home=NAME" in helped.stdout and "--conform-strict" in helped.stdout


def test_clauses_run_as_items_with_declared_skips(tmp_path: Path) -> None:
    run = pytest_in(tmp_path, "--conform-home", "standalone", "-k", "misses or readiness")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASSED ::conform[standalone]::misses.fresh" in run.stdout
    assert "PASSED ::conform[standalone]::readiness.flips" in run.stdout
    skipped = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1 and skipped[0].startswith("SKIPPED [2]")  # the same reason twice
    assert "declared-skip: no control_plane: a plain host has no control plane" in skipped[0]
    assert "2 passed, 2 skipped, 7 deselected" in run.stdout


def test_a_broken_home_fails_under_pytest(tmp_path: Path) -> None:
    run = pytest_in(tmp_path, "--conform-home", "tests.conform.brokenkit:FlappingReadinessStage",
                    "-k", "flips")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAILED ::conform[tests.conform.brokenkit:FlappingReadinessStage]::readiness.flips"\
        in run.stdout
    assert "readiness.flips: the control plane saw readiness [True, False, True, False]" \
        in run.stdout


def test_an_unknown_home_fails_every_selected_item(tmp_path: Path) -> None:
    run = pytest_in(tmp_path, "--conform-home", "nowhere", "-k", "removal")
    assert run.returncode == 1
    assert run.stdout.count("no conformance stage for home 'nowhere'") >= 2
    assert "2 failed" in run.stdout
