"""Slurm's node names and parse errors, checked without ``re``.

``fiberctl`` inside a job finds the job's socket through the node's directory
(homes.slurm.layout), whose name must be a node name: this module is all that
path needs of the job's variables, and it stays within fiberctl's import budget
(tests/cli/test_fiberctl.py: no ``re``). Pure.
"""

from __future__ import annotations

from slurm_fiber.errors import CodedError

# A node name is a path component of the node's state (paths.node_dir): it starts with a
# letter or a digit, so it is never "", "." or "..", and holds no "/" or control character.
NODE_RULE = "letters, digits and _ . + -, starting with a letter or digit"
MAX_NODE_NAME = 128
_ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_NODE_CHARS = _ALNUM | frozenset("_.+-")


class SlurmParseError(CodedError, ValueError):
    """Slurm gave something this package cannot use.

    ``code`` is one of ``missing`` (a required value is absent), ``invalid`` (a
    value is malformed), ``ambiguous`` (text that can be read two ways),
    ``slurm_error`` (Slurm itself reported a failure) or ``unrecognised``
    (output in no format this package knows). ``str()`` is one line.
    """


def is_node_name(value: str) -> bool:
    """Whether ``value`` is a node name (NODE_RULE: ASCII letters, digits and ``_ . + -``,
    the first a letter or digit, at most MAX_NODE_NAME characters)."""
    return (0 < len(value) <= MAX_NODE_NAME and value[0] in _ALNUM
            and all(c in _NODE_CHARS for c in value))


def check_node(node: str) -> str:
    """``node`` when it is a valid node name (``is_node_name``); SlurmParseError
    ("invalid", one line) otherwise."""
    if not is_node_name(node):
        raise SlurmParseError("invalid", f"{node[:80]!r} is not a node name ({NODE_RULE})")
    return node
