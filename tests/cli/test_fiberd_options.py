"""plain_flags: the daemons' own parse of a command line of plain flags, and what it leaves
to typer (None), so typer keeps parsing and explaining everything else."""

from __future__ import annotations

import pytest

from slurm_fiber.cli.fiberd_options import plain_flags

RUN_EXTRA = {"--warm-timeout": False, "--standalone": True}


def given(argv: list[str], extra: dict[str, bool] | None = None) -> dict[str, object]:
    flags = plain_flags(argv, extra)
    assert flags is not None
    return {k: v for k, v in flags.items() if v is not None}


def test_values_switches_and_the_last_of_a_repeated_flag() -> None:
    assert given([]) == {}
    assert given(["--home", "slurm", "--grace=2", "--grace", "3"]) == {
        "home": "slurm", "grace": "3"}
    assert given(["--trust=a=b=c", "--config", "f.toml"]) == {"trust": "a=b=c", "config": "f.toml"}
    assert given(["--strict-limits"]) == {"strict_limits": True}
    assert given(["--strict-limits", "--no-strict-limits"]) == {"strict_limits": False}
    assert given(["--grace", "-1", "--home", "-"]) == {"grace": "-1", "home": "-"}
    assert given(["--home="]) == {"home": ""}


def test_extra_options() -> None:
    assert given([], RUN_EXTRA) == {"standalone": False}
    assert given(["--standalone", "--warm-timeout", "5"], RUN_EXTRA) == {
        "standalone": True, "warm_timeout": "5"}


@pytest.mark.parametrize("argv", [
    ["--help"], ["-h"], ["word"], ["--hom", "x"], ["--home"], ["--home", "--grace", "1"],
    ["--grace", "-x"], ["--strict-limits=1"], ["--no-strict-limits=1"], ["--", "x"],
    ["--standalone"], ["--no-standalone"],
])
def test_anything_else_is_left_to_typer(argv: list[str]) -> None:
    assert plain_flags(argv) is None


def test_an_extra_switch_has_no_negative() -> None:
    assert plain_flags(["--no-standalone"], RUN_EXTRA) is None
