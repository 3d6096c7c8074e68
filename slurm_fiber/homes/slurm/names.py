"""Slurm's parse errors, and a node name checked as one of them.

The node name rule itself is the path convention's (slurm_fiber.defaults);
``check_node`` refuses a name that breaks it with the Slurm home's coded error.
Pure.
"""

from __future__ import annotations

from slurm_fiber.defaults import NODE_RULE, is_node_name
from slurm_fiber.errors import CodedError


class SlurmParseError(CodedError, ValueError):
    """Slurm gave something this package cannot use.

    ``code`` is one of ``missing`` (a required value is absent), ``invalid`` (a
    value is malformed), ``ambiguous`` (text that can be read two ways),
    ``slurm_error`` (Slurm itself reported a failure) or ``unrecognised``
    (output in no format this package knows). ``str()`` is one line.
    """


def check_node(node: str) -> str:
    """``node`` when it is a valid node name (``is_node_name``); SlurmParseError
    ("invalid", one line) otherwise."""
    if not is_node_name(node):
        raise SlurmParseError("invalid", f"{node[:80]!r} is not a node name ({NODE_RULE})")
    return node
