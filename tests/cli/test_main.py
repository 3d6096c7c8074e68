"""``slurm-fiber``: a subcommand's module is imported only when that subcommand runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_fiber.cli import main

SCRIPT = str(Path(sys.executable).with_name("slurm-fiber"))
# Print the slurm_fiber modules loaded after running the CLI with argv (it exits via SystemExit).
PROBE = ("import sys\nfrom slurm_fiber.cli.main import app\n"
         "try:\n    app(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
         "print(' '.join(sorted(m for m in sys.modules if m.startswith('slurm_fiber'))),"
         " file=sys.stderr)\n")
MODULES = {name: target.split(":")[0] for name, (target, _s) in main.SUBCOMMANDS.items()}


def loaded_after(*argv: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True,
                          text=True, timeout=60)
    return set(done.stderr.split())


def test_help_lists_every_subcommand_and_imports_none() -> None:
    done = subprocess.run([SCRIPT, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for name, (_target, summary) in main.SUBCOMMANDS.items():
        assert name in done.stdout and summary.split()[0] in done.stdout
    assert "Exit codes: 0 success; 1 refused or failed" in done.stdout
    assert not loaded_after("--help") & set(MODULES.values())


@pytest.mark.parametrize("name", sorted(main.SUBCOMMANDS))
def test_a_subcommand_imports_its_own_module_only(name: str) -> None:
    loaded = loaded_after(name, "--help") & set(MODULES.values())
    assert loaded == {MODULES[name]}


@pytest.mark.parametrize("name", sorted(main.SUBCOMMANDS))
def test_each_summary_is_the_start_of_the_commands_own_help(name: str) -> None:
    command = main.load(name)
    assert command.name == name
    summary = main.SUBCOMMANDS[name][1].rstrip(".")
    assert (command.help or "").startswith(summary)


def test_an_unknown_subcommand_is_a_usage_error() -> None:
    done = subprocess.run([SCRIPT, "nope"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "No such command 'nope'" in done.stderr


@pytest.mark.parametrize("name", sorted(main.SUBCOMMANDS))
def test_each_subcommands_help_states_the_shared_exit_codes(name: str) -> None:
    """0 success, 1 refused or failed (each says what failing means for it), 2 usage."""
    words = " ".join((main.load(name).help or "").split())
    assert re.search(r"Exit codes: 0 [^;,]+[;,] 1 [^;]+[;,] 2 usage", words), words
