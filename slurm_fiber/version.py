"""The installed release's version and the ``--version`` line every command prints.

One source of truth: the git tag, through setuptools-scm, which writes
``slurm_fiber/_version.py`` when the package is built or installed (a tag
``vX.Y.Z`` gives ``X.Y.Z``; commits after it ``X.Y.(Z+1).devN+gHASH``; a clone
with no tag, pyproject's ``fallback_version`` as the base: ``0.1.1.devN+gHASH``).
Where that file is missing (a checkout used without installing) the installed
distribution's metadata answers, and failing that ``FALLBACK``: ``--version``
always prints a valid PEP 440 version and never raises. Importing this module
imports nothing beyond ``sys``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

DISTRIBUTION = "slurm-fiber"
FALLBACK = "0+unknown"  # neither built nor installed: a checkout on sys.path as it is


def version() -> str:
    """The version of this slurm_fiber (module doc); never raises."""
    from importlib import import_module

    try:  # written by the build (absent from git), so imported by name
        return str(import_module("slurm_fiber._version").version)
    except (ImportError, AttributeError):
        pass
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as installed

        try:
            return installed(DISTRIBUTION)
        except PackageNotFoundError:
            return FALLBACK
    except Exception:  # a broken metadata directory must not break --version
        return FALLBACK


def version_line(prog: str) -> str:
    """What ``PROG --version`` prints: ``slurm-fiber X`` or ``PROG (slurm-fiber) X``."""
    if prog == DISTRIBUTION:
        return f"{DISTRIBUTION} {version()}"
    return f"{prog} ({DISTRIBUTION}) {version()}"


def exit_if_asked(prog: str, argv: Sequence[str]) -> None:
    """Print the version line and exit 0 when ``argv`` (without the program) is
    ``--version`` alone; otherwise return. For the commands whose fast path
    parses arguments without a parser (fiberd, fiberd-run, the hooks)."""
    if list(argv) == ["--version"]:
        print(version_line(prog))
        sys.exit(0)
