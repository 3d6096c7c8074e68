"""The one build step pyproject.toml cannot declare: the files a site needs, in the wheel.

Everything else about the build is in pyproject.toml. This adds to the wheel, under
``slurm_fiber/share/`` (``slurm-fiber files`` prints where it is installed):

- ``contrib/``, copied as it is in the tree being built (the Slurm config snippets, the
  Grafana dashboard, the Prometheus rules, the systemd unit, the SPANK plugin's source
  ``contrib/spank/`` when the tree has it), so what a wheel carries is exactly contrib/;
- ``man/man{1,8}/`` and ``completion/{bash,zsh}/``: every command's man page and shell
  completion, generated from the command's own parser (``slurm_fiber.cli.reference``),
  so they cannot drift from ``--help``.

An editable install gets neither: its ``slurm-fiber files`` points at the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithShare(build_py):
    """build_py, then contrib/ and the generated man pages and completion."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        share = Path(self.build_lib) / "slurm_fiber" / "share"
        if share.exists():
            shutil.rmtree(share)
        if (HERE / "contrib").is_dir():
            shutil.copytree(HERE / "contrib", share / "contrib",
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*"))
        env = {**os.environ, "PYTHONPATH": str(HERE)}
        subprocess.run([sys.executable, "-m", "slurm_fiber.cli.reference", "build", str(share)],
                       check=True, env=env, cwd=HERE)


setup(cmdclass={"build_py": BuildPyWithShare})
