"""A home written outside slurm_fiber (tests/homes/example_home), installed with pip and
registered only through its ``slurm_fiber.homes`` entry point, is found by the registry,
listed by ``fiberd --help`` and passes ``slurm-fiber conform``.

The package is installed once per session with pip into a directory of its own (pip's
``--target``), which the tests put on the path: the venv stays as ``./dev setup`` made it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.homes import select

EXAMPLE = Path(__file__).parent / "example_home"
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def example_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where pip installed the example home (its package and its dist-info)."""
    target = tmp_path_factory.mktemp("example-home-site")
    source = tmp_path_factory.mktemp("example-home-source") / "example_home"
    shutil.copytree(EXAMPLE, source)  # pip's build leaves build/ and egg-info behind it
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--disable-pip-version-check", "--target", str(target), str(source)],
                   check=True, capture_output=True, timeout=240)
    assert (target / "slurm_fiber_example_home").is_dir()
    return target


@pytest.fixture
def installed(example_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The example home on this process's path; yields the environment for subprocesses."""
    monkeypatch.syspath_prepend(str(example_site))
    select.forget_installed()
    yield {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(example_site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    select.forget_installed()


def test_the_entry_point_registers_the_home(installed: dict[str, str]) -> None:
    assert "example" in select.names()
    entry = select.lookup("example")
    assert entry.stage == "slurm_fiber_example_home.stage:ExampleStage"
    assert "grantdir" in entry.options
    help_text = subprocess.run([str(BIN / "fiberd"), "--help"], env=installed,
                               capture_output=True, text=True, check=True).stdout
    assert "example      an example: grants from a directory" in help_text


def test_an_uninstalled_home_is_unknown() -> None:
    select.forget_installed()
    with pytest.raises(select.UnknownHome, match="no home named 'example'"):
        select.lookup("example")


def test_the_example_home_conforms(installed: dict[str, str]) -> None:
    run = subprocess.run([str(BIN / "slurm-fiber"), "conform", "--home", "example",
                          "--strict"], env=installed, capture_output=True, text=True,
                         timeout=240)
    print(run.stdout)  # conform's table, shown with -s
    assert run.returncode == 0, run.stderr[-2000:]
    for clause in ("preadmission.warms", "removal.releases", "removal.denies",
                   "redelivery.lifts", "misses.fresh", "readiness.flips"):
        row = next(line for line in run.stdout.splitlines() if line.startswith(clause))
        assert "pass" in row, row
