"""``fiberd-run``'s choice of home: --home as fiberd takes it; --standalone only as a
deprecated alias (its run is covered in tests/cli/test_commands.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slurm_fiber.cli.fiberd_run import UsageError, choose_home

FIBERD_RUN = str(Path(sys.executable).with_name("fiberd-run"))


@pytest.mark.parametrize(("flags", "standalone", "environ", "home"), [
    ({}, False, {}, "standalone"),
    ({}, False, {"SLURM_JOB_ID": "42"}, "slurm"),
    ({"home": "standalone"}, False, {"SLURM_JOB_ID": "42"}, "standalone"),
    ({"home": "kubernetes"}, False, {}, "kubernetes"),
    ({}, True, {"SLURM_JOB_ID": "42"}, "standalone"),
    ({"home": "standalone"}, True, {}, "standalone"),
])
def test_the_home_chosen(flags, standalone, environ, home) -> None:
    assert choose_home(flags, standalone, environ)["home"] == home


def test_home_from_the_environment_is_left_to_fiberd() -> None:
    assert choose_home({}, False, {"FIBERD_HOME": "kubernetes", "SLURM_JOB_ID": "1"}) == {}


def test_standalone_with_another_home_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="contradicts --home slurm"):
        choose_home({"home": "slurm"}, True, {})
    done = subprocess.run([FIBERD_RUN, "--standalone", "--home", "slurm", "--", "true"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "contradicts --home slurm" in done.stderr


def test_help_offers_one_way_to_pick_a_home() -> None:
    done = subprocess.run([FIBERD_RUN, "--help"], capture_output=True, text=True, timeout=60)
    assert "--home" in done.stdout and "--standalone " not in done.stdout
    assert "Exit codes:" in done.stdout
