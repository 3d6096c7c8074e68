"""Every command answers --version with the one version of the package (issue 40, item 1)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
COMMANDS = ["slurm-fiber", "fiberd", "fiberd-run", "fiberctl", "slurm-fiber-prolog",
            "slurm-fiber-epilog"]


@pytest.mark.parametrize("prog", COMMANDS)
def test_every_command_prints_its_version(prog: str) -> None:
    done = subprocess.run([str(BIN / prog), "--version"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    words = done.stdout.split()
    expected = ["slurm-fiber"] if prog == "slurm-fiber" else [prog, "(slurm-fiber)"]
    assert words[:-1] == expected
    Version(words[-1])  # a valid PEP 440 version, the same for every command
    from slurm_fiber import __version__

    assert words[-1] == __version__


def test_version_without_build_or_install_is_the_fallback(tmp_path: Path) -> None:
    """A checkout on sys.path with neither the build's _version.py nor an installed
    distribution still answers, with a valid version that says it is unknown."""
    shutil.copytree(REPO / "slurm_fiber", tmp_path / "slurm_fiber",
                    ignore=shutil.ignore_patterns("_version.py", "__pycache__"))
    done = subprocess.run(
        [sys.executable, "-S", "-c",
         "import sys; sys.path.insert(0, sys.argv[1]); import slurm_fiber; "
         "print(slurm_fiber.__version__)", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=True, cwd=tmp_path)
    assert done.stdout.strip() == "0+unknown"
    Version(done.stdout.strip())
