"""The wheel is the install path (issue 40, item 2): built from this tree with ``python -m
build``, installed into a fresh venv of the system Python, and run from there, not from
the checkout: ``--version``, the files a site copies (contrib, man pages, completion) and
``slurm-fiber quickstart``.

Two builds: the checkout itself (git: the version is the tag's, or the fallback's dev
release with no tag), and a copy of it without git and with a SPANK plugin's source in
contrib/spank/, which shows that contrib/ reaches the wheel by pattern whatever it holds
and that a tree without git metadata still builds, as the fallback version.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3.11"
COMMANDS = ["slurm-fiber", "fiberd", "fiberd-run", "fiberctl", "slurm-fiber-prolog",
            "slurm-fiber-epilog"]
MAN_PAGES = ["man1/slurm-fiber.1", "man8/fiberd.8", "man1/fiberd-run.1", "man1/fiberctl.1",
             "man8/slurm-fiber-prolog.8", "man8/slurm-fiber-epilog.8"]
SPANK_FILES = {"contrib/spank/Makefile": "all:\n\ttrue\n",
               "contrib/spank/src/slurm_fiber_spank.c": "/* a plugin's source */\n"}


def build(tree: Path, out: Path) -> tuple[Path, Path]:
    """``python -m build`` of ``tree`` (sdist, then the wheel from the sdist) into ``out``."""
    subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(tree)],
                   check=True, capture_output=True, text=True, timeout=900)
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return sdist, wheel


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build(REPO, tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def venv(built: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv of the system Python with the wheel installed (dependencies from the
    package index, as a site's pip gets them)."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.fail(f"{SYSTEM_PYTHON} is missing: the wheel is tested with the system Python")
    where = tmp_path_factory.mktemp("venv") / "slurm-fiber"
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", str(where)], check=True, timeout=300)
    subprocess.run([str(where / "bin" / "pip"), "install", "-q",
                    "--disable-pip-version-check", str(built[1])],
                   check=True, capture_output=True, text=True, timeout=900)
    return where


def clean_env(venv: Path) -> dict[str, str]:
    """A user's environment with the venv first on PATH and nothing of the checkout."""
    return {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8"}


def run(venv: Path, *argv: str, cwd: Path,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], env=clean_env(venv),
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_sdist_and_wheel_carry_the_license_and_the_site_files(built: tuple[Path, Path]) -> None:
    sdist, wheel = built
    with tarfile.open(sdist) as tar:
        top = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"LICENSE", "NOTICE", "CHANGELOG.md", "setup.py"} <= top
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "contrib"], check=True,
                             capture_output=True, text=True).stdout.split()
    assert tracked and set(tracked) <= top
    names = set(zipfile.ZipFile(wheel).namelist())
    dist_info = next(n.split("/")[0] for n in names if ".dist-info/" in n)
    assert {f"{dist_info}/licenses/LICENSE", f"{dist_info}/licenses/NOTICE"} <= names
    assert "Apache License" in zipfile.ZipFile(wheel).read(
        f"{dist_info}/licenses/LICENSE").decode()
    assert "slurm_fiber/py.typed" in names
    assert {f"slurm_fiber/share/{path}" for path in tracked} <= names
    assert {f"slurm_fiber/share/man/{page}" for page in MAN_PAGES} <= names
    for prog in COMMANDS:
        assert f"slurm_fiber/share/completion/bash/{prog}" in names
        assert f"slurm_fiber/share/completion/zsh/_{prog}" in names
    metadata = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata


def test_installed_wheel_runs_from_the_venv_not_the_checkout(
        venv: Path, built: tuple[Path, Path], tmp_path: Path) -> None:
    where = run(venv, "python", "-c", "import slurm_fiber; print(slurm_fiber.__file__)",
                cwd=tmp_path)
    assert where.stdout.startswith(str(venv)), where
    wheel_version = built[1].name.split("-")[1]
    for prog in COMMANDS:
        done = run(venv, prog, "--version", cwd=tmp_path)
        assert done.returncode == 0, (prog, done.stderr)
        assert done.stdout.split()[-1] == str(Version(wheel_version)), (prog, done.stdout)


def test_installed_files_are_where_slurm_fiber_files_says(venv: Path, tmp_path: Path) -> None:
    listed = dict(line.split("\t") for line in
                  run(venv, "slurm-fiber", "files", cwd=tmp_path).stdout.splitlines())
    assert set(listed) == {"contrib", "man", "bash", "zsh"}
    for path in listed.values():
        assert path.startswith(str(venv)) and Path(path).is_dir()
    man = Path(listed["man"])
    assert all((man / page).is_file() for page in MAN_PAGES)
    if shutil.which("man"):
        page = subprocess.run(["man", "-l", str(man / "man1/fiberctl.1")], capture_output=True,
                              text=True, env={**clean_env(venv), "MANWIDTH": "80"}, timeout=60)
        assert "fiberctl" in page.stdout and "--socket" in page.stdout.replace("\u2010", "-")
    bash = Path(listed["bash"]) / "fiberctl"
    done = subprocess.run(["bash", "-c", f'source "{bash}"; COMP_WORDS=(fiberctl st); '
                           'COMP_CWORD=1; _fiberctl; echo "${COMPREPLY[@]}"'],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["stop", "status"]


def test_quickstart_runs_from_the_installed_wheel(venv: Path, tmp_path: Path) -> None:
    done = run(venv, "slurm-fiber", "quickstart", "--clones", "10", "--cold-runs", "2",
               cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Clone" in done.stdout
    assert str(REPO) not in done.stdout + done.stderr


def test_a_tree_without_git_builds_with_contrib_spank_and_the_fallback_version(
        tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files"], check=True,
                             capture_output=True, text=True).stdout.splitlines()
    for name in tracked:
        if (REPO / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, tree / name)
    for name, text in SPANK_FILES.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(text)
    _sdist, wheel = build(tree, tmp_path / "dist")
    fallback = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools_scm"][
        "fallback_version"]
    assert wheel.name.split("-")[1] == fallback
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"slurm_fiber/share/{name}" for name in SPANK_FILES} <= names
