"""The homes slurm_fiber ships, as registry entries: standalone, slurm and kubernetes.

The one module that knows every built-in home (homes.select looks them up
here). Each home's own modules are imported inside the functions below, on
purpose: fiberd loads only the home it runs, and listing the homes (for
``--help``, conform) imports none of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from slurm_fiber.homes.select import BuiltHome, HomeEntry, HomeRefused

if TYPE_CHECKING:
    from slurm_fiber.config import FiberdConfig
    from slurm_fiber.core.clock import Clock
    from slurm_fiber.homes.problem import ProblemSink
    from slurm_fiber.homes.slurm.jobenv import SlurmJob
    from slurm_fiber.homes.slurm.siteconfig import SiteConfig

STANDALONE_AUDIENCE = "standalone:{host}"


# ---- standalone


async def _build_standalone(config: FiberdConfig, clock: Clock, environ: Mapping[str, str],
                            on_problem: ProblemSink) -> BuiltHome:
    from slurm_fiber.homes.standalone import StandaloneHome

    home = StandaloneHome.from_config(config, clock, on_problem=on_problem, environ=environ)

    async def close() -> list[str]:
        return home.close()

    return BuiltHome(home, config.audience or
                     STANDALONE_AUDIENCE.format(host=os.uname().nodename),
                     close=close, cgroup_reason=home.cgroup_reason)


# ---- slurm


def _site_and_job(environ: Mapping[str, str]) -> tuple[SiteConfig, SlurmJob]:
    from slurm_fiber.homes.slurm.jobenv import SlurmParseError, job_from_env
    from slurm_fiber.homes.slurm.siteconfig import SiteConfigError, load_site_config

    try:
        return load_site_config(environ), job_from_env(environ)
    except SiteConfigError as err:
        raise HomeRefused(f"site config: {err}") from None
    except SlurmParseError as err:
        raise HomeRefused(f"--home slurm runs inside a Slurm job step (srun): {err}") from None


def _slurm_defaults(environ: Mapping[str, str]) -> dict[str, object]:
    """The job's state dir from the node's path convention (so the socket, grantdir and
    audit log land where the prolog, fiberctl and the epilog look) and the site's trust
    table. Blocks on reading the site config; raises HomeRefused outside a Slurm job or
    on an unusable site config."""
    from slurm_fiber.homes.slurm.paths import job_paths

    site, job = _site_and_job(environ)
    defaults: dict[str, object] = {
        "state_dir": str(job_paths(site.state_root, job.node, job.job_id).state_dir)}
    if site.trust:
        defaults["trust"] = ",".join(f"{iss}={path}" for iss, path in site.trust.items())
    return defaults


def _in_slurm_job(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SLURM_JOB_ID"))


async def _build_slurm(config: FiberdConfig, clock: Clock, environ: Mapping[str, str],
                       on_problem: ProblemSink) -> BuiltHome:
    """The job's home: site settings, GPU leases held by this process, the fiberd record."""
    from slurm_fiber.homes.slurm import fiberdrecord
    from slurm_fiber.homes.slurm.control import CliControl
    from slurm_fiber.homes.slurm.home import build_slurm_home, end_fiberd, health_poll_every
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
    control = CliControl(dict(environ))
    home = await build_slurm_home(environ, clock, control, settings, leases=leases,
                                  on_job_end=end_fiberd)
    home.on_problem = on_problem
    state_dir = home.paths.state_dir

    def announce(sock: Path) -> None:
        root = home.cgroup_root()
        fiberdrecord.write_record(state_dir, fiberdrecord.this_process(
            sock, Path(root) if root else None))

    return BuiltHome(home, config.audience or f"slurm:{job.cluster}:{job.job_id}",
                     announce=announce,
                     withdraw=lambda: fiberdrecord.remove_record(state_dir),
                     cgroup_reason=home.cgroup_reason)


# ---- kubernetes


async def _build_kubernetes(config: FiberdConfig, clock: Clock, environ: Mapping[str, str],
                            on_problem: ProblemSink) -> BuiltHome:
    from slurm_fiber.homes.kubernetes.home import build_kubernetes_home
    from slurm_fiber.homes.kubernetes.incluster import InClusterError

    try:
        home = await build_kubernetes_home(config, clock, environ, on_problem=on_problem)
    except InClusterError as err:
        raise HomeRefused(f"--home kubernetes runs in a grant Pod: {err}") from None
    return BuiltHome(home, config.audience or home.audience(), close=home.aclose,
                     cgroup_reason=home.cgroup_reason)


STANDALONE = HomeEntry(
    "standalone", "a plain host, grants from a directory", _build_standalone,
    options=("grantdir", "poll_interval", "stale_ttl", "devices", "ready_file", "cgroup_root"),
    stage="slurm_fiber.conform.standalone:StandaloneStage")
SLURM = HomeEntry(
    "slurm", "inside a job step, run it as `srun --overlap fiberd-run`", _build_slurm,
    options=("poll_interval", "stale_ttl"), defaults=_slurm_defaults, claims=_in_slurm_job,
    stage="slurm_fiber.conform.slurm:SlurmStage")
KUBERNETES = HomeEntry(
    "kubernetes", "the grant Pod", _build_kubernetes,
    options=("grantdir", "poll_interval", "stale_ttl", "devices", "cgroup_root",
             "ready_condition"),
    own_options="slurm_fiber.homes.kubernetes.options:OPTIONS",
    stage="slurm_fiber.conform.kubernetes:KubernetesStage")
BUILTIN = (STANDALONE, SLURM, KUBERNETES)
