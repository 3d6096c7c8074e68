"""The node's path convention as strings: the state root, a node's dir, a job's dir.

The one place the layout under the state root is spelled (homes.slurm.paths
builds its ``Path`` values on it; see its docstring for the whole layout).
Strings, not ``pathlib``: ``fiberctl`` inside a job imports this module, and its
import budget (tests/cli/test_fiberctl.py) leaves pathlib out. Pure: nothing here
touches the file system.
"""

from __future__ import annotations

import os

from slurm_fiber.defaults import STATE_DIR
from slurm_fiber.homes.slurm.names import check_node

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (fiberctl imports this)
if TYPE_CHECKING:
    from collections.abc import Mapping

STATE_ROOT_ENV = "SLURM_FIBER_STATE_ROOT"


def state_root_of(env: Mapping[str, str]) -> str:
    """The state root ``SLURM_FIBER_STATE_ROOT`` in ``env`` names, else the default
    (/var/lib/slurm-fiber). Raises ValueError when the variable is set but not absolute."""
    value = env.get(STATE_ROOT_ENV, "")
    if not value:
        return STATE_DIR
    if not os.path.isabs(value):
        raise ValueError(f"{STATE_ROOT_ENV}={value!r} must be an absolute path")
    return value


def node_dir_of(root: str | os.PathLike[str], node: str) -> str:
    """The per-node directory under ``root``. Raises ValueError (SlurmParseError) when
    ``node`` is not a node name (names.is_node_name: never "..", "/", empty or control
    characters), so no caller can step out of ``root``."""
    return os.path.join(root, "nodes", check_node(node))


def job_dir_of(root: str | os.PathLike[str], node: str, job_id: int) -> str:
    """The state dir of job ``job_id`` on ``node`` under ``root`` (``node_dir_of``'s
    ValueError for a bad node name)."""
    return os.path.join(node_dir_of(root, node), "jobs", str(job_id))
