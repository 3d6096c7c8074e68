"""Where a client finds fiberd's socket (fiberctl, fibermap, the Executor).

A client-side policy: each home says where its fiberd's socket is from a
client's environment (``HomeEntry.socket`` in the home registry), so this
module knows no home's layout.

Order: an explicit path (``--socket``), then ``$FIBERD_SOCKET``, then the
first built-in home that places a socket from the environment (the Slurm
home inside a job: the job's socket on this node; homes.builtin says how),
then a standalone fiberd's socket: ``$FIBERD_STATE_DIR/fiberd.sock``, else
/var/lib/slurm-fiber/fiberd.sock (fiberd's own defaults, so both sides agree
without configuration). Installed homes are not asked: reading the package
metadata would add about 50 ms to every client command; their clients give
``$FIBERD_SOCKET``. Paths are strings, as the homes give them: pathlib would
add about 3 ms to each fiberctl started per task.
"""

from __future__ import annotations

import os

from slurm_fiber.defaults import SOCKET_NAME, STATE_DIR

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (fiberctl imports this)
if TYPE_CHECKING:
    from collections.abc import Mapping


def home_socket_path(environ: Mapping[str, str]) -> str | None:
    """The socket the first built-in home places from ``environ``, None when none does.

    Blocks on what that home reads (the Slurm home: the site config's ``state_root``);
    raises ValueError for a relative ``$SLURM_FIBER_STATE_ROOT``.
    """
    # Imported here: a client given its socket (--socket, $FIBERD_SOCKET) never pays for
    # the registry's imports.
    from slurm_fiber.homes.select import builtin_entries

    for entry in builtin_entries():
        path = entry.socket(environ)
        if path is not None:
            return path
    return None


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
    return home_socket_path(env) or default_socket_path(env)
