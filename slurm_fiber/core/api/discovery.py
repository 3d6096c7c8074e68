"""Where a client finds fiberd's socket.

Order: an explicit path (``--socket``), then ``$FIBERD_SOCKET``, then, inside
a Slurm job (``$SLURM_JOB_ID`` set), the job's socket
``$SLURM_FIBER_STATE/<jobid>/fiberd.sock`` (state dir default
``/run/slurm-fiber``), then the default socket: ``$XDG_RUNTIME_DIR/slurm-fiber/
fiberd.sock`` when that variable is set, else ``/run/slurm-fiber/fiberd.sock``.
The daemon uses the same functions to choose where to listen, so both sides
agree without configuration.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

DEFAULT_STATE_DIR = Path("/run/slurm-fiber")
SOCKET_NAME = "fiberd.sock"


def state_dir(environ: Mapping[str, str]) -> Path:
    """The node's slurm_fiber state dir: ``$SLURM_FIBER_STATE`` or /run/slurm-fiber."""
    return Path(environ.get("SLURM_FIBER_STATE") or DEFAULT_STATE_DIR)


def job_socket_path(job_id: str, environ: Mapping[str, str]) -> Path:
    """The socket of the fiberd serving Slurm job ``job_id`` on this node."""
    return state_dir(environ) / job_id / SOCKET_NAME


def default_socket_path(environ: Mapping[str, str]) -> Path:
    """The socket of a fiberd outside any job (standalone host)."""
    runtime = environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "slurm-fiber" if runtime else DEFAULT_STATE_DIR
    return base / SOCKET_NAME


def discover_socket(explicit: str | os.PathLike[str] | None = None,
                    environ: Mapping[str, str] | None = None) -> Path:
    """The socket path a client should use (see the module docstring for the order)."""
    env = os.environ if environ is None else environ
    if explicit:
        return Path(explicit)
    if env.get("FIBERD_SOCKET"):
        return Path(env["FIBERD_SOCKET"])
    if env.get("SLURM_JOB_ID"):
        return job_socket_path(env["SLURM_JOB_ID"], env)
    return default_socket_path(env)
