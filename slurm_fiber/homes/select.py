"""Choosing and building fiberd's home from its configuration.

``home_defaults`` says what a home implies about fiberd's options before the
configuration is loaded (a Slurm job's state dir), ``build_home`` builds the
configured home with the audience its tokens must name, and ``close_home``
undoes what building it did (a standalone home's cgroup delegation). The
core never learns which home it runs in: every home goes through the same
``Home`` seam.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass

from slurm_fiber.config import FiberdConfig
from slurm_fiber.core.clock import Clock
from slurm_fiber.homes.problem import ProblemSink
from slurm_fiber.homes.seam import Home

STANDALONE_AUDIENCE = "standalone:{host}"


class HomeRefused(Exception):
    """The configured home cannot be built here (one line naming what is missing)."""


@dataclass
class BuiltHome:
    """A home ready to run, with the audience tokens for it must carry."""

    home: Home
    audience: str


def home_defaults(home: str, environ: Mapping[str, str]) -> dict[str, object]:
    """Options the home implies, below the file, environment and flags. Pure.

    Slurm: the job's state dir from the node's path convention, so the socket,
    grantdir and audit log land where the prolog, fiberctl and the epilog
    look. Raises HomeRefused when the environment is not a Slurm job's.
    """
    if home != "slurm":
        return {}
    from slurm_fiber.homes.slurm.jobenv import SlurmParseError, job_from_env
    from slurm_fiber.homes.slurm.paths import job_paths, state_root

    try:
        job = job_from_env(environ)
        paths = job_paths(state_root(environ), job.node, job.job_id)
    except (SlurmParseError, ValueError) as err:
        raise HomeRefused(f"--home slurm runs inside a Slurm job step (srun): {err}") from None
    return {"state_dir": str(paths.state_dir)}


async def build_home(config: FiberdConfig, clock: Clock, environ: Mapping[str, str],
                     on_problem: ProblemSink) -> BuiltHome:
    """Build the home ``config.home`` names; blocks briefly on file reads in threads.

    The audience is ``config.audience`` when set, else the home's own
    (``standalone:<host>``, ``slurm:<cluster>:<job id>``, ``k8s:<ns>:<pod>``).
    Raises HomeRefused with one line.
    """
    if config.home == "standalone":
        from slurm_fiber.homes.standalone import StandaloneHome

        home = StandaloneHome.from_config(config, clock, on_problem=on_problem)
        return BuiltHome(home, config.audience or
                         STANDALONE_AUDIENCE.format(host=socket.gethostname()))
    if config.home == "slurm":
        return await _slurm(config, clock, environ, on_problem)
    return await _kubernetes(config, clock, environ, on_problem)


async def _kubernetes(config: FiberdConfig, clock: Clock, environ: Mapping[str, str],
                      on_problem: ProblemSink) -> BuiltHome:
    from slurm_fiber.homes.kubernetes import build_kubernetes_home
    from slurm_fiber.homes.kubernetes.incluster import InClusterError

    try:
        home = await build_kubernetes_home(config, clock, environ, on_problem=on_problem)
    except InClusterError as err:
        raise HomeRefused(f"--home kubernetes runs in a grant Pod: {err}") from None
    return BuiltHome(home, config.audience or home.audience())


async def _slurm(config: FiberdConfig, clock: Clock, environ: Mapping[str, str],
                 on_problem: ProblemSink) -> BuiltHome:
    from slurm_fiber.homes.slurm.control import select_control
    from slurm_fiber.homes.slurm.home import SlurmHomeConfig, build_slurm_home
    from slurm_fiber.homes.slurm.jobenv import SlurmParseError
    from slurm_fiber.homes.slurm.paths import state_root

    control, _reason = await select_control(dict(environ))
    settings = SlurmHomeConfig(state_root=state_root(environ),
                               stale_after=config.stale_ttl,
                               grant_poll_every=config.poll_interval)
    try:
        home = await build_slurm_home(environ, clock, control, settings)
    except SlurmParseError as err:
        raise HomeRefused(f"--home slurm runs inside a Slurm job step (srun): {err}") from None
    home.on_problem = on_problem
    job = home.job
    return BuiltHome(home, config.audience or f"slurm:{job.cluster}:{job.job_id}")


async def close_home(home: Home) -> list[str]:
    """Undo what building the home did (cgroup delegation, API clients); one line per
    failure. Never raises."""
    try:
        aclose = getattr(home, "aclose", None)
        if aclose is not None:
            return list(await aclose())
        close = getattr(home, "close", None)
        return list(close()) if close is not None else []
    except Exception as err:
        return [f"closing the {home.name()} home failed: {err}"]
