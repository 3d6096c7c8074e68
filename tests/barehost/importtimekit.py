"""What a command imported, read from the ``python -X importtime`` lines on its stderr."""

from __future__ import annotations


def imported(stderr: str) -> set[str]:
    """The names of the modules ``-X importtime`` reported in ``stderr`` (other lines,
    such as the command's own error, are left out)."""
    return {line.split("|")[-1].strip() for line in stderr.splitlines()
            if line.startswith("import time:")}
