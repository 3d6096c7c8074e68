"""Where a client finds fiberd's socket (fiberctl, fibermap, the Executor).

A client-side policy that knows each home's layout, so it lives beside the
clients, not in the core.

Order: an explicit path (``--socket``), then ``$FIBERD_SOCKET``, then, inside
a Slurm job (``$SLURM_JOB_ID`` set), the job's socket on this node as the
node's path convention places it (``<state root>/nodes/<node>/jobs/<job id>/
fiberd.sock``; state root ``$SLURM_FIBER_STATE_ROOT``, else the site config's
(``$SLURM_FIBER_CONFIG``, where fiberd-run takes it from), else
/var/lib/slurm-fiber; node ``$SLURMD_NODENAME`` or the short host name), then a standalone fiberd's
socket: ``$FIBERD_STATE_DIR/fiberd.sock``, else /var/lib/slurm-fiber/fiberd.sock
(fiberd's own defaults, so both sides agree without configuration).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path

from slurm_fiber.defaults import SOCKET_NAME, STATE_DIR


def job_socket_path(job_id: str, environ: Mapping[str, str]) -> Path:
    """The socket of the fiberd serving Slurm job ``job_id`` on this node.

    Blocks on reading the site config's ``state_root`` (only that key). An
    unusable site config falls back to the default root; a relative
    ``$SLURM_FIBER_STATE_ROOT`` raises ValueError.
    """
    # Lazy on purpose: a client outside any Slurm job (fiberctl's start-up path)
    # never reads the site file, so it does not import its parser.
    from slurm_fiber.homes.slurm.paths import job_paths
    from slurm_fiber.homes.slurm.sitefile import site_state_root

    root = site_state_root(environ)
    node = environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    return job_paths(root, node, int(job_id)).socket


def default_socket_path(environ: Mapping[str, str]) -> Path:
    """The socket of a fiberd outside any job (standalone host)."""
    return Path(environ.get("FIBERD_STATE_DIR") or STATE_DIR) / SOCKET_NAME


def discover_socket(explicit: str | os.PathLike[str] | None = None,
                    environ: Mapping[str, str] | None = None) -> Path:
    """The socket path a client should use (see the module docstring for the order)."""
    env = os.environ if environ is None else environ
    if explicit:
        return Path(explicit)
    if env.get("FIBERD_SOCKET"):
        return Path(env["FIBERD_SOCKET"])
    if env.get("SLURM_JOB_ID", "").isdigit():
        return job_socket_path(env["SLURM_JOB_ID"], env)
    return default_socket_path(env)
