"""slurm-fiber-prolog: prepares a Slurm job's slurm_fiber state on a node, at allocation.

slurmd runs it as root on every allocated node (``PrologFlags=Alloc``),
with no PATH and no HOME; it reads the job from its environment only (no
slurmctld calls) and the site config (siteconfig). Steps, each bounded by
``step_seconds`` and reported as one line (stderr and syslog) when it fails:

1. ``config``: load the site config; a broken one stops the prolog here.
2. ``job``: the job from the environment (jobenv).
3. ``state_dir``: the job's state dir and grantdir, new and root's (statedir;
   whatever an earlier run left at the name is moved aside first); the steps
   below write into them through root's directory fds.
4. ``tokens``: mint the job's token with the site key (grants).
5. ``spool``: import the job's spooled tokens that verify (grants).
6. ``cgroup``: with ``delegate_cgroup``, a cgroup subtree delegated to the
   job user, recorded in the state dir (cgroup).
7. ``state_dir`` again (the hand-over): the grantdir, then the state dir,
   become the job user's, mode 0700. Root writes nothing below them after
   this (the threat model's rule 1).
8. ``leases``: make the node's lease area root-only (moving aside, in one
   line, what a job user planted there), then grant the job's GPUs on this
   node to the job and claim them in its name (homes/slurm/leases).

Exit status: 0, unless a failed step is one the site lists in ``fatal``
(then 1, and slurmd drains the node). Running it again for the same job
gives the job new dirs (the earlier ones are moved aside, never reused).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from slurm_fiber.core.cgroups.v2 import delegate
from slurm_fiber.core.clock import SystemClock
from slurm_fiber.homes.slurm.jobenv import SlurmJob, SlurmParseError, job_from_env
from slurm_fiber.homes.slurm.leases import (
    grant_and_claim_job_gpus,
    moved_aside_line,
    node_leases,
    prepare_lease_area,
)
from slurm_fiber.homes.slurm.paths import JobPaths, job_paths
from slurm_fiber.homes.slurm.siteconfig import (
    SiteConfig,
    SiteConfigError,
    fatal_checks,
    load_site_config,
)
from slurm_fiber.hooks.cgroup import job_cgroup
from slurm_fiber.hooks.cli import hook_main
from slurm_fiber.hooks.hook import Hook
from slurm_fiber.lease import LeaseError
from slurm_fiber.prolog.grants import TokenFile, mint_job_token, spooled_tokens
from slurm_fiber.prolog.statedir import (
    JobDirs,
    check_parent,
    hand_over,
    make_job_dirs,
    write_file,
)

NAME = "slurm-fiber-prolog"
GRANT_FILE_MODE = 0o600
RECORD_FILE_MODE = 0o644


def _place(hook: Hook, paths: JobPaths, dirs: JobDirs, job: SlurmJob,
           files: list[TokenFile]) -> None:
    for token in files:
        write_file(dirs.grant_fd, token.name, token.data, uid=job.uid, gid=job.gid,
                   mode=GRANT_FILE_MODE)
        hook.note("tokens", f"placed {paths.grantdir / token.name}")


def _mint(hook: Hook, config: SiteConfig, paths: JobPaths, dirs: JobDirs,
          job: SlurmJob) -> bool:
    _place(hook, paths, dirs, job, [mint_job_token(config, job, SystemClock())])
    return True


def _spool(hook: Hook, config: SiteConfig, paths: JobPaths, dirs: JobDirs,
           job: SlurmJob) -> bool:
    found, problems = spooled_tokens(config, job, SystemClock())
    for problem in problems:
        hook.warn("spool", problem)
    _place(hook, paths, dirs, job, found)
    return True


def _cgroup(hook: Hook, config: SiteConfig, paths: JobPaths, dirs: JobDirs,
            job: SlurmJob) -> bool:
    path = job_cgroup(config, job.node, job.job_id)
    if path is None:
        raise OSError(2, "no cgroup2 mount on this node to delegate from")
    delegate(path, job.uid, job.gid)
    write_file(dirs.state_fd, paths.cgroup_file.name, f"{path}\n".encode(), uid=0, gid=0,
               mode=RECORD_FILE_MODE)
    hook.note("cgroup", f"delegated {path} to uid {job.uid}")
    return True


def _leases(hook: Hook, config: SiteConfig, paths: JobPaths, job: SlurmJob) -> bool:
    os.close(check_parent(paths.lease_dir.parent))  # the node dir, if state_dir failed
    moved = prepare_lease_area(paths)
    if moved:
        hook.warn("leases", moved_aside_line(moved))
    resources, refused = grant_and_claim_job_gpus(
        node_leases(paths, SystemClock(), config.lease_ttl), job)
    if refused:
        raise LeaseError("not claimed for the job: " + "; ".join(refused))
    hook.note("leases", f"granted and claimed {' '.join(resources)} for the job")
    return True


def run_prolog(environ: Mapping[str, str], hook: Hook) -> int:
    """Run every prolog step for the job in ``environ``; the exit code (see module doc).

    Blocks on file I/O, each step bounded by the site's ``step_seconds``.
    Never raises for a problem of the job, the node or the config.
    """
    try:
        config = load_site_config(environ)
    except SiteConfigError as err:
        hook.report("config", str(err))
        return 1 if "config" in fatal_checks(environ) else 0
    hook.step_seconds = config.step_seconds
    try:
        job = job_from_env(environ)
    except SlurmParseError as err:
        hook.report("job", err.reason)
        return 1 if config.is_fatal("job") else 0
    hook.job = job.job_id
    paths = job_paths(config.state_root, job.node, job.job_id)

    dirs = hook.step("state_dir", lambda: make_job_dirs(paths, job.job_id))
    if dirs is not None:
        try:
            if dirs.retired is not None:
                hook.warn("state_dir", f"moved what was left at {paths.state_dir} aside "
                          f"(retired/{dirs.retired}); the job starts with new dirs")
            if config.issuer_key is not None:
                hook.step("tokens", lambda: _mint(hook, config, paths, dirs, job))
            if config.spool_dir is not None:
                hook.step("spool", lambda: _spool(hook, config, paths, dirs, job))
            if config.delegate_cgroup:
                hook.step("cgroup", lambda: _cgroup(hook, config, paths, dirs, job))
            hook.step("state_dir", lambda: hand_over(dirs, job.uid, job.gid))
        finally:
            dirs.close()
    if job.gpus:
        hook.step("leases", lambda: _leases(hook, config, paths, job))
    return 1 if any(config.is_fatal(step) for step in hook.failed) else 0


def main() -> None:
    """The ``slurm-fiber-prolog`` console script."""
    hook_main(NAME, __doc__ or NAME, run_prolog)
