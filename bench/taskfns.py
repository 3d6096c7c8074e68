"""The tasks bench/tasks.py runs in every system: importable by name everywhere (the
checkout is on the venv's path, so ``bench.taskfns`` is found by a template, a Pool or
Dask worker and a fresh interpreter alike)."""

from __future__ import annotations

import subprocess


def square(i: int) -> int:
    """W2: a function call in an interpreter that holds the preloads."""
    return i * i


def run_true(_i: int = 0) -> int:
    """W1 for the systems that run Python workers: start ``true`` and wait for it."""
    return subprocess.run(["true"], check=False).returncode


def square_arg(text: str) -> int:
    """W2 for ``fiberctl map --call``, whose arguments are text."""
    return square(int(text))
