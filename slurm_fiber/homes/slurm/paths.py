"""Where a Slurm job's slurm_fiber state lives on a node: one convention for every part.

The prolog creates these paths, fiberd-run and the Slurm home use them,
fiberctl finds the socket from ``SLURM_JOB_ID``, and the epilog removes
them. All of them derive from ``job_paths(state_root, job)``, built on the
node's path convention in slurm_fiber.defaults (which a client finding a job's
socket uses too), so the parts cannot disagree. The layout, under the
state root (default /var/lib/slurm-fiber, overridden by
``SLURM_FIBER_STATE_ROOT``)::

    nodes/<node>/jobs/<job_id>/          the job's state dir (owned by the job user)
        grants/                          its grantdir (*.jwt, written by the prolog)
        fiberd.sock                      fiberd's socket
        ready.json                       readiness, written by the Slurm home
        cgroup                           the cgroup subtree the prolog delegated (one line)
    nodes/<node>/leases/                 the node's lease dir (GPU leases, one per device)
        state.json                       its lease state document (the lease CLI's default)

Paths are per node name because several slurmd may share one host (the test
cluster runs n1 and n2 on 127.0.0.1), and their GPU 0s are different
devices. Pure: nothing here touches the file system. Node names are checked
(``node_dir``), like job ids, which are integers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slurm_fiber.defaults import (
    GRANTDIR_NAME,
    READY_NAME,
    SOCKET_NAME,
    STATE_DIR,
    STATE_ROOT_ENV,
    job_dir_of,
    node_dir_of,
    state_root_of,
)
from slurm_fiber.homes.slurm.names import check_node

DEFAULT_STATE_ROOT = Path(STATE_DIR)
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


@dataclass(frozen=True)
class JobPaths:
    """The paths of one job on one node (see the module docstring for the layout)."""

    state_dir: Path
    grantdir: Path
    socket: Path
    ready_file: Path
    cgroup_file: Path
    lease_dir: Path
    lease_state: Path

    def socket_fits(self) -> bool:
        """Whether the socket path fits a Unix socket address (a deep state root may not)."""
        return len(os.fsencode(self.socket)) <= MAX_SOCKET_PATH


def state_root(env: Mapping[str, str] | None = None) -> Path:
    """The state root: ``SLURM_FIBER_STATE_ROOT`` from ``env`` (default os.environ) or
    /var/lib/slurm-fiber. Raises ValueError when the variable is set but not absolute."""
    return Path(state_root_of((os.environ if env is None else env).get(STATE_ROOT_ENV, "")))


def node_dir(root: str | os.PathLike[str], node: str) -> Path:
    """The per-node directory under ``root``. Raises SlurmParseError (a ValueError) for a
    name that is not a node's (names.check_node), so no caller can step out of ``root``."""
    return Path(node_dir_of(root, check_node(node)))


def job_paths(root: str | os.PathLike[str], node: str, job_id: int) -> JobPaths:
    """The paths of job ``job_id`` on ``node`` under state root ``root``.

    ``node`` and ``job_id`` come from a validated SlurmJob (jobenv), so they
    are single path components; a node name that is not one raises
    ValueError (node_dir). Pure.
    """
    here = node_dir(root, node)
    state = Path(job_dir_of(root, node, job_id))
    return JobPaths(
        state_dir=state,
        grantdir=state / GRANTDIR_NAME,
        socket=state / SOCKET_NAME,
        ready_file=state / READY_NAME,
        cgroup_file=state / "cgroup",
        lease_dir=here / "leases",
        lease_state=here / "leases" / "state.json",
    )


def gpu_resource(node: str, index: int) -> str:
    """The lease resource name of GPU ``index`` on ``node`` ("gpu:n1:0").

    The prolog grants it, the Slurm home claims it and the epilog releases it.
    """
    return f"gpu:{node}:{index}"
