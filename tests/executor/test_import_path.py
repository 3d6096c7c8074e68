"""Code travels as the caller expects (issue 39, 1): a function importable in the caller
is importable in its fiber, for the Executor and ``fiberctl call`` / ``map --call``.

Each caller is a fresh process in a directory of its own holding a package the template
never saw (``mypkg``), against the module's real standalone fiberd; the README's Executor
and ``fiberctl map`` examples run verbatim. A directory other users may write is never
imported from: its entry is left out, with a line on the fiber's stderr.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from slurm_fiber.cli.throwaway import Site
from slurm_fiber.client.tasks import caller_path

FIBERCTL = str(Path(sys.executable).parent / "fiberctl")
README = Path(__file__).parents[2] / "README.md"
TASKS = "def score(x):\n    return int(x) ** 2\n"


def package(root: Path, name: str = "mypkg", body: str = TASKS) -> Path:
    """``root/name/tasks.py`` holding ``body``; ``root``."""
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text("")
    (root / name / "tasks.py").write_text(body)
    return root


def env_for(site: Site, **extra: str) -> dict[str, str]:
    return {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
            "HOME": os.environ.get("HOME", "/root"), "FIBERD_SOCKET": str(site.socket),
            **extra}


def python(code: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=120)


def readme_block(language: str, containing: str) -> str:
    """The README's first fenced ``language`` block that contains ``containing``."""
    blocks = re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)
    return next(b for b in blocks if containing in b)


def test_the_callers_path_leaves_out_the_interpreters_own(tmp_path: Path) -> None:
    lib = os.path.join(sys.base_prefix, "lib", "python3.11")
    got = caller_path(["", str(tmp_path), lib, os.path.join(sys.prefix, "lib", "x"), "rel",
                       str(tmp_path)])
    assert got == [os.getcwd(), str(tmp_path), os.path.join(os.getcwd(), "rel")]


def test_a_function_of_the_callers_package_runs_in_its_fiber(site: Site,
                                                             tmp_path: Path) -> None:
    work = package(tmp_path / "work")
    out = python("from slurm_fiber import Executor\nfrom mypkg.tasks import score\n"
                 "with Executor(max_workers=2) as ex:\n"
                 "    print(list(ex.map(score, range(5))))\n", work, env_for(site))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 1, 4, 9, 16]"


def test_pythonpath_travels_with_the_executor_and_fiberctl_call(site: Site,
                                                                tmp_path: Path) -> None:
    lib = package(tmp_path / "lib", "otherpkg")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = env_for(site, PYTHONPATH=str(lib))
    out = python("from slurm_fiber import Executor\nfrom otherpkg.tasks import score\n"
                 "with Executor() as ex:\n    print(ex.submit(score, 6).result(60))\n",
                 elsewhere, env)
    assert (out.returncode, out.stdout.strip()) == (0, "36"), out.stderr
    call = subprocess.run([FIBERCTL, "call", "otherpkg.tasks:score", "[7]"], cwd=elsewhere,
                          env=env, text=True, capture_output=True, timeout=60)
    assert (call.returncode, call.stdout.strip()) == (0, "49"), call.stderr
    here = subprocess.run([FIBERCTL, "call", "otherpkg.tasks:score", "[8]"], cwd=lib,
                          env=env_for(site), text=True, capture_output=True, timeout=60)
    assert (here.returncode, here.stdout.strip()) == (0, "64"), here.stderr  # the cwd


def test_a_directory_others_can_write_is_never_imported_from(site: Site,
                                                             tmp_path: Path) -> None:
    open_dir = package(tmp_path / "open", "openpkg")
    open_dir.chmod(0o777)
    out = subprocess.run([FIBERCTL, "call", "openpkg.tasks:score", "[2]"], cwd=open_dir,
                         env=env_for(site), text=True, capture_output=True, timeout=60)
    assert out.returncode == 1
    assert "ModuleNotFoundError: No module named 'openpkg'" in out.stderr, out.stderr


def test_the_readme_executor_example_runs_verbatim(site: Site, tmp_path: Path) -> None:
    work = package(tmp_path / "work")
    block = readme_block("python", "Executor")
    (work / "example.py").write_text(block)
    out = python("import runpy\nns = runpy.run_path('example.py')\n"
                 "print(len(ns['results']), ns['results'][:4])\n", work, env_for(site))
    assert out.returncode == 0, out.stderr
    printed, mine = out.stdout.splitlines()[:-1], out.stdout.splitlines()[-1]
    assert printed == ["49 "]  # the example's own print: the result, what score printed
    assert mine == "1000 [0, 1, 4, 9]"
