"""Where a client finds fiberd's socket (fiberctl, fibermap, the Executor).

Order: an explicit path (``--socket``), then ``$FIBERD_SOCKET``, then, inside a
Slurm job (``$SLURM_JOB_ID``), the job's socket on this node as the node's path
convention places it (defaults.job_socket_of: ``<state root>/nodes/<node>/jobs/
<job id>/fiberd.sock``, the state root as client.siteroot reads it, the node
``$SLURMD_NODENAME`` or the short host name), then a standalone fiberd's socket:
``$FIBERD_STATE_DIR/fiberd.sock``, else /var/lib/slurm-fiber/fiberd.sock
(fiberd's own defaults, so both sides agree without configuration). Other homes'
clients give ``$FIBERD_SOCKET``. Paths are strings (the client's budget).
"""

from __future__ import annotations

import os

from slurm_fiber.client.siteroot import site_state_root
from slurm_fiber.defaults import SOCKET_NAME, STATE_DIR, job_socket_of

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the client's budget)
if TYPE_CHECKING:
    from collections.abc import Mapping


def job_socket_path(environ: Mapping[str, str]) -> str | None:
    """Inside a Slurm job, the job's socket on this node; None outside one.

    Blocks on reading the site file's ``state_root``; raises ValueError for a relative
    ``$SLURM_FIBER_STATE_ROOT`` or a node name that is not one.
    """
    job_id = environ.get("SLURM_JOB_ID", "")
    if not job_id.isdigit():
        return None
    # the host name as gethostname(2) gives it, without importing socket
    node = environ.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0]
    return job_socket_of(site_state_root(environ), node, int(job_id))


def default_socket_path(environ: Mapping[str, str]) -> str:
    """The socket of a fiberd outside any job (standalone host)."""
    return os.path.join(environ.get("FIBERD_STATE_DIR") or STATE_DIR, SOCKET_NAME)


def discover_socket(explicit: str | os.PathLike[str] | None = None,
                    environ: Mapping[str, str] | None = None) -> str:
    """The socket path a client should use (see the module docstring for the order)."""
    env = os.environ if environ is None else environ
    if explicit:
        return os.fspath(explicit)
    if env.get("FIBERD_SOCKET"):
        return env["FIBERD_SOCKET"]
    return job_socket_path(env) or default_socket_path(env)
