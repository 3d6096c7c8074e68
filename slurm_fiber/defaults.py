"""The default paths and file names every part of slurm_fiber agrees on, in one place.

``STATE_DIR`` is where fiberd keeps its state outside a job and the node's
state root on Slurm (site config ``state_root``). The names are the files and
dirs fiberd keeps in a state dir; fiberd's options (config), the Slurm
layout (homes.slurm.paths) and the clients (discovery, ``slurm-fiber
audit``) all take them from here, so both ends of a socket or a log agree
without configuration.

The node's path convention on Slurm is spelled here once, as strings: state
root -> a node's dir -> a job's dir -> its socket. homes.slurm.paths builds
the job's whole layout on it and a client in a job finds the job's socket with
it, so the two cannot disagree. A node name is checked before it becomes a
path component (``is_node_name``), so no caller steps out of the state root.
Constants and pure string functions: this module imports only ``os`` (it is on
the thin client's path, tests/client/test_import_budget.py).
"""

from __future__ import annotations

import os

STATE_DIR = "/var/lib/slurm-fiber"
SOCKET_NAME = "fiberd.sock"  # the local API's Unix socket
AUDIT_NAME = "audit.jsonl"  # fiberd's audit log
GRANTDIR_NAME = "grants"  # the grantdir a file-fed home polls
READY_NAME = "ready.json"  # the readiness file
STATE_FILE_NAME = "grantbook.json"  # the grant book's state, kept across restarts

# The Slurm site: its config file, and the state root it or the environment names.
SITE_CONFIG_ENV = "SLURM_FIBER_CONFIG"  # the site file, when not the default
DEFAULT_SITE_CONFIG = "/etc/slurm-fiber/slurm-fiber.toml"
STATE_ROOT_ENV = "SLURM_FIBER_STATE_ROOT"  # wins over the site file's state_root

# A node name is a path component of the node's state (``node_dir_of``): it starts with a
# letter or a digit, so it is never "", "." or "..", and holds no "/" or control character.
NODE_RULE = "letters, digits and _ . + -, starting with a letter or digit"
MAX_NODE_NAME = 128
_ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_NODE_CHARS = _ALNUM | frozenset("_.+-")


def is_node_name(value: str) -> bool:
    """Whether ``value`` is a node name (NODE_RULE: ASCII letters, digits and ``_ . + -``,
    the first a letter or digit, at most MAX_NODE_NAME characters)."""
    return (0 < len(value) <= MAX_NODE_NAME and value[0] in _ALNUM
            and all(c in _NODE_CHARS for c in value))


def state_root_of(override: str) -> str:
    """The state root ``override`` (the value of ``$SLURM_FIBER_STATE_ROOT``, "" when
    unset) names, else STATE_DIR. Raises ValueError when it is set but not absolute."""
    if not override:
        return STATE_DIR
    if not os.path.isabs(override):
        raise ValueError(f"{STATE_ROOT_ENV}={override[:200]!r} must be an absolute path")
    return override


def node_dir_of(root: str | os.PathLike[str], node: str) -> str:
    """The per-node directory under ``root``. Raises ValueError when ``node`` is not a
    node name (``is_node_name``), so no caller can step out of ``root``."""
    if not is_node_name(node):
        raise ValueError(f"{node[:80]!r} is not a node name ({NODE_RULE})")
    return os.path.join(root, "nodes", node)


def job_dir_of(root: str | os.PathLike[str], node: str, job_id: int) -> str:
    """The state dir of job ``job_id`` on ``node`` under ``root`` (``node_dir_of``'s
    ValueError for a bad node name)."""
    return os.path.join(node_dir_of(root, node), "jobs", str(job_id))


def job_socket_of(root: str | os.PathLike[str], node: str, job_id: int) -> str:
    """The socket of job ``job_id``'s fiberd on ``node`` under ``root`` (``node_dir_of``'s
    ValueError for a bad node name)."""
    return os.path.join(job_dir_of(root, node, job_id), SOCKET_NAME)
