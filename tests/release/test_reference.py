"""Man pages and shell completion for every command, generated from its parser (issue 40,
item 5; slurm_fiber/cli/reference.py, run by the wheel's build), and one help style."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_fiber.cli.reference import COMMANDS, build, model

BIN = Path(sys.executable).parent
SECTIONS = {"fiberd": 8, "fiberd-run": 1, "fiberctl": 1, "slurm-fiber": 1,
            "slurm-fiber-prolog": 8, "slurm-fiber-epilog": 8}


@pytest.fixture(scope="module")
def share(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("share")
    build(target)
    return target


def test_every_command_has_its_man_page_in_its_section(share: Path) -> None:
    assert {prog: section for prog, (section, _p, _l) in COMMANDS.items()} == SECTIONS
    for prog, section in SECTIONS.items():
        page = share / "man" / f"man{section}" / f"{prog}.{section}"
        text = page.read_text()
        assert text.startswith(f'.TH "{prog.upper()}" "{section}"')
        for option in (f for sub in model(prog).walk() for o in sub.options for f in o.flags):
            assert option.replace("-", "\\-") in text, f"{prog}({section}) lacks {option}"
        if shutil.which("man"):
            shown = subprocess.run(["man", "-l", str(page)], capture_output=True, text=True,
                                   env={"MANWIDTH": "80", "PATH": "/usr/bin:/bin"}, timeout=60)
            assert shown.returncode == 0 and "NAME" in shown.stdout and "OPTIONS" in \
                shown.stdout, shown.stderr


def complete_bash(script: Path, words: list[str]) -> list[str]:
    fn = "_" + words[0].replace("-", "_")
    line = " ".join(f"'{w}'" for w in words)
    done = subprocess.run(["bash", "-c", f'source "{script}"; COMP_WORDS=({line}); '
                           f'COMP_CWORD={len(words) - 1}; {fn}; echo "${{COMPREPLY[@]}}"'],
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.split()


def test_bash_completion_knows_every_subcommand_and_option(share: Path) -> None:
    bash = share / "completion" / "bash"
    for prog in SECTIONS:
        cmd = model(prog)
        script = bash / prog
        assert subprocess.run(["bash", "-n", str(script)], timeout=60).returncode == 0
        expected = {c.name.split()[-1] for c in cmd.commands}
        expected |= {f for o in cmd.options for f in o.flags}
        assert set(complete_bash(script, [prog, ""])) == expected, prog
    assert complete_bash(bash / "fiberctl", ["fiberctl", "map", "--ran"]) == ["--range"]
    assert complete_bash(bash / "slurm-fiber", ["slurm-fiber", "token", "mi"]) == ["mint"]
    assert complete_bash(bash / "fiberd", ["fiberd", "--metrics-t"]) == ["--metrics-textfile"]


def test_zsh_completion_parses(share: Path) -> None:
    zsh = shutil.which("zsh")
    assert zsh, "zsh is missing: apt-get install zsh (./dev test does)"
    for prog in SECTIONS:
        script = share / "completion" / "zsh" / f"_{prog}"
        assert script.read_text().startswith(f"#compdef {prog}\n")
        done = subprocess.run([zsh, "-n", str(script)], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("argv", [
    ["slurm-fiber", "--help"], ["slurm-fiber", "keys", "--help"],
    ["slurm-fiber", "token", "mint", "--help"], ["slurm-fiber", "lease", "--help"],
    ["fiberd", "--help"], ["fiberd-run", "--help"], ["slurm-fiber-epilog", "--help"],
])
def test_one_help_style_no_boxes(argv: list[str]) -> None:
    done = subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "COLUMNS": "100"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage: ") and "╭" not in done.stdout, done.stdout[:300]
