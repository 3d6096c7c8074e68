"""Choosing and building fiberd's home from its configuration.

``home_defaults`` says what a home implies about fiberd's options before the
configuration is loaded (a Slurm job's state dir), ``build_home`` builds the
configured home with the audience its tokens must name, and ``close_home``
undoes what building it did (a standalone home's cgroup delegation). The
core never learns which home it runs in: every home goes through the same
``Home`` seam.

Each home's modules are imported inside the function that builds it, on
purpose: fiberd loads only the home it runs (the Kubernetes home pulls in
its API client, the Slurm home its site config), and this module stays
importable by the option parser of every fiberd start.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_fiber.config import FiberdConfig
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.seam import Home
from slurm_fiber.homes.problem import ProblemSink

if TYPE_CHECKING:
    from slurm_fiber.homes.slurm.jobenv import SlurmJob
    from slurm_fiber.homes.slurm.siteconfig import SiteConfig

STANDALONE_AUDIENCE = "standalone:{host}"


class HomeRefused(Exception):
    """The configured home cannot be built here (one line naming what is missing)."""


def _nothing(*_: object) -> None:
    """For homes that announce nothing."""


@dataclass
class BuiltHome:
    """A home ready to run, with the audience tokens for it must carry.

    ``announce(socket)`` is called once fiberd listens (the Slurm home leaves
    its record for fiberctl and the epilog), ``withdraw()`` when it stops.
    """

    home: Home
    audience: str
    announce: Callable[[Path], None] = _nothing
    withdraw: Callable[[], None] = _nothing


def home_defaults(home: str, environ: Mapping[str, str]) -> dict[str, object]:
    """Options the home implies, below the file, environment and flags. Pure.

    Slurm: the job's state dir from the node's path convention (so the
    socket, grantdir and audit log land where the prolog, fiberctl and the
    epilog look) and the site's trust table. Blocks on reading the site
    config. Raises HomeRefused when the environment is not a Slurm job's or
    the site config is unusable.
    """
    if home != "slurm":
        return {}
    from slurm_fiber.homes.slurm.paths import job_paths

    site, job = _site_and_job(environ)
    defaults: dict[str, object] = {
        "state_dir": str(job_paths(site.state_root, job.node, job.job_id).state_dir)}
    if site.trust:
        defaults["trust"] = ",".join(f"{iss}={path}" for iss, path in site.trust.items())
    return defaults


def _site_and_job(environ: Mapping[str, str]) -> tuple[SiteConfig, SlurmJob]:
    from slurm_fiber.homes.slurm.jobenv import SlurmParseError, job_from_env
    from slurm_fiber.homes.slurm.siteconfig import SiteConfigError, load_site_config

    try:
        return load_site_config(environ), job_from_env(environ)
    except SiteConfigError as err:
        raise HomeRefused(f"site config: {err}") from None
    except SlurmParseError as err:
        raise HomeRefused(f"--home slurm runs inside a Slurm job step (srun): {err}") from None


async def build_home(config: FiberdConfig, clock: Clock, environ: Mapping[str, str],
                     on_problem: ProblemSink) -> BuiltHome:
    """Build the home ``config.home`` names; blocks briefly on file reads in threads.

    The audience is ``config.audience`` when set, else the home's own
    (``standalone:<host>``, ``slurm:<cluster>:<job id>``, ``k8s:<ns>:<pod>``).
    Raises HomeRefused with one line.
    """
    if config.home == "standalone":
        from slurm_fiber.homes.standalone import StandaloneHome

        home = StandaloneHome.from_config(config, clock, on_problem=on_problem,
                                          environ=environ)
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
    """The job's home: site settings, GPU leases held by this process, the fiberd record."""
    from slurm_fiber.homes.slurm import fiberdrecord
    from slurm_fiber.homes.slurm.control import select_control
    from slurm_fiber.homes.slurm.home import build_slurm_home
    from slurm_fiber.homes.slurm.hometypes import health_poll_every
    from slurm_fiber.homes.slurm.leases import NodeLeases
    from slurm_fiber.homes.slurm.siteconfig import SiteConfigError, home_config

    site, job = _site_and_job(environ)
    try:
        settings = home_config(site, job.node, stale_after=config.stale_ttl,
                               poll_every=health_poll_every(config.stale_ttl),
                               grant_poll_every=config.poll_interval)
    except SiteConfigError as err:
        raise HomeRefused(f"site config: {err}") from None
    leases = NodeLeases.for_job(site, job, clock)  # verifies the prolog's claims, writes nothing
    control, _reason = await select_control(dict(environ))
    home = await build_slurm_home(environ, clock, control, settings, leases=leases)
    home.on_problem = on_problem
    state_dir = home.paths.state_dir

    def announce(sock: Path) -> None:
        root = home.cgroup_root()
        fiberdrecord.write_record(state_dir, fiberdrecord.this_process(
            sock, Path(root) if root else None))

    return BuiltHome(home, config.audience or f"slurm:{job.cluster}:{job.job_id}",
                     announce=announce,
                     withdraw=lambda: fiberdrecord.remove_record(state_dir))


async def close_home(built: BuiltHome) -> list[str]:
    """Withdraw the announcement and undo what building the home did (cgroup delegation,
    API clients); one line per failure. Never raises."""
    home = built.home
    try:
        built.withdraw()
        aclose = getattr(home, "aclose", None)
        if aclose is not None:
            return list(await aclose())
        close = getattr(home, "close", None)
        return list(close()) if close is not None else []
    except Exception as err:
        return [f"closing the {home.name()} home failed: {err}"]
