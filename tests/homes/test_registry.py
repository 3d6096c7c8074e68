"""The home registry: built-in entries, unknown names refused in one line, and what a
built home hands fiberd (audience, cgroup reason, close) without probing the home."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_fiber.cli.fiberd_options import resolve_config
from slurm_fiber.cli.fiberd_run import choose_home
from slurm_fiber.config import load_config
from slurm_fiber.core.clock import SystemClock
from slurm_fiber.homes.problem import log_problem
from slurm_fiber.homes.select import (
    HomeRefused,
    UnknownHome,
    build_home,
    claiming,
    close_home,
    home_defaults,
    lookup,
    names,
)


def test_the_builtin_homes_come_first_in_order() -> None:
    assert names()[:3] == ["standalone", "slurm", "kubernetes"]
    assert [lookup(n).name for n in names()[:3]] == ["standalone", "slurm", "kubernetes"]
    assert lookup("kubernetes").stage == "slurm_fiber.conform.kubernetes:KubernetesStage"


def test_an_unknown_home_is_refused_in_one_line_naming_the_known_ones() -> None:
    with pytest.raises(UnknownHome) as refused:
        lookup("slurmm")
    line = str(refused.value)
    assert "\n" not in line and "no home named 'slurmm'" in line
    assert "standalone, slurm, kubernetes" in line and line.endswith("did you mean slurm?")
    with pytest.raises(UnknownHome):
        home_defaults("k8s", {})
    # fiberd's start-up refuses it before building anything (exit 1, the same line)
    with pytest.raises(HomeRefused, match="no home named 'nowhere'"):
        resolve_config({"home": "nowhere"}, {})


def test_the_cli_names_the_homes_it_can_run() -> None:
    fiberd = str(Path(sys.executable).with_name("fiberd"))
    out = subprocess.run([fiberd, "--help"], capture_output=True, text=True, check=True).stdout
    assert "standalone   a plain host, grants from a directory" in out
    assert "kubernetes   the grant Pod" in out
    bad = subprocess.run([fiberd, "--home", "nowhere"], capture_output=True, text=True)
    assert bad.returncode == 1
    assert bad.stderr.startswith("fiberd: no home named 'nowhere' (known: standalone, slurm")


def test_fiberd_run_picks_the_home_that_claims_the_environment() -> None:
    assert claiming({"SLURM_JOB_ID": "7"}) == "slurm"
    assert claiming({}) == "standalone"
    assert choose_home({}, False, {"SLURM_JOB_ID": "7"})["home"] == "slurm"


def test_a_built_standalone_home_says_its_audience_cgroup_reason_and_closes(
        tmp_path: Path) -> None:
    config = load_config(env={}, flags={"state_dir": str(tmp_path / "state"),
                                        "cgroup_root": "none", "audience": "aud:x"})

    async def scenario() -> None:
        built = await build_home(config, SystemClock(), {}, log_problem)
        assert built.home.name() == "standalone" and built.audience == "aud:x"
        assert built.home.cgroup_root() is None
        assert "uncarved" in built.cgroup_line()
        assert await close_home(built) == []

    asyncio.run(scenario())


def test_every_option_a_home_says_it_reads_is_a_fiberd_option() -> None:
    """fiberd's own or one a home declares (``HomeEntry.own_options``)."""
    from slurm_fiber.cli.fiberd_options import all_options

    known = {opt.name for opt in all_options()}
    for name in names()[:3]:
        assert set(lookup(name).options) <= known, name
