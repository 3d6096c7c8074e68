"""slurm-fiber-epilog: removes what a finished Slurm job left of slurm_fiber on a node.

slurmd runs it as root on every node of the job, after the job's tracked
processes are gone, with no PATH and no HOME. It reads the job from its
environment and the site config, like the prolog. Steps, each bounded by
``step_seconds`` and reported as one line (stderr and syslog) when it fails:

1. ``grants``: move the job's state dir into the node's retired area
   (epilog/statedir: the job id's name is free at once, and root reads the
   job's files only through its own 0700 area from then on) and remove the
   grantdir, so a fiberd still running sees its grants go.
2. ``processes``: SIGKILL every process of the job that survived: everything
   in the delegated cgroup and in the job's groups of Slurm's cgroup v1
   hierarchies (homes.slurm.cgroup_v1: a dead fiberd's groups below its step,
   which Slurm neither signals nor removes), thawing whatever the job froze
   there (core/cgroups/teardown.py); the fiberd of the record and its
   descendants, and orphans whose environment names the job (epilog/procscan,
   a bounded read per process); never "all processes of the user", and never
   a cgroup a user-written file names.
3. ``leases``: release the job's GPU leases and drop its unclaimed grants
   (first making the node's lease area root's, as the prolog does, when an
   older version left it shared).
4. ``cgroup``: remove the job's delegated cgroup subtree; ``cgroup_v1``: remove
   what is left of the job's v1 groups (a dead fiberd's, then Slurm's steps and
   the job's own group, which Slurm could not remove while they had children).
   Deepest first, whatever the depth, within the step's bound
   (core/cgroups/teardown.py); a group left is named.
5. ``metrics``: remove the job's file for node_exporter (homes.slurm.nodemetrics);
   ``audit``: keep fiberd's audit log: ``<state dir>/audit.jsonl`` moves to
   ``<state root>/nodes/<node>/audit/job-<id>.jsonl``.
6. ``state_dir``: remove the job's retired state dir, then what earlier
   epilogs left in the retired area, within the step's bound (what is left
   waits for the next epilog; it blocks no job).

Every step copes with a missing piece (a half-done prolog, a crashed
fiberd, a second run), so the epilog is idempotent. It exits 1, which
drains the node, when processes of the job provably survive SIGKILL (it
names them) or when the ``processes`` step could not make sure they are
gone (it failed or overran ``step_seconds``: the node does not go to the
next job with the last one's processes maybe still there); any other
problem is reported and the exit is 0.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Mapping
from pathlib import Path

from slurm_fiber.core.cgroups import teardown
from slurm_fiber.core.clock import SystemClock
from slurm_fiber.epilog import cgroup_v2, procscan, survivors
from slurm_fiber.epilog.statedir import keep_retired, remove_retired, retire_state_dir
from slurm_fiber.homes.slurm.cgroup_v1 import job_groups
from slurm_fiber.homes.slurm.fiberdrecord import read_record
from slurm_fiber.homes.slurm.jobenv import SlurmJob, SlurmParseError, job_from_env
from slurm_fiber.homes.slurm.leases import (
    moved_aside_line,
    node_leases,
    prepare_lease_area,
    release_job,
)
from slurm_fiber.homes.slurm.nodemetrics import remove_job_textfile
from slurm_fiber.homes.slurm.paths import JobPaths, job_paths
from slurm_fiber.homes.slurm.siteconfig import SiteConfig, SiteConfigError, load_site_config
from slurm_fiber.hooks.auditkeep import keep_job_audit
from slurm_fiber.hooks.cgroup import job_cgroup
from slurm_fiber.hooks.cli import hook_main
from slurm_fiber.hooks.hook import Hook

NAME = "slurm-fiber-epilog"
AUDIT_NAME = "audit.jsonl"
BUDGET_SHARE = 0.8  # of a step's time bound, spent finding, killing and waiting for processes
WORK_SHARE = 0.6  # of a step's time bound, spent removing files (the rest: a slow syscall)
MOST_STEPS = 12  # hook.step calls in one run: the whole epilog takes at most this many bounds


def _processes(hook: Hook, config: SiteConfig, state_dir: Path | None, job: SlurmJob,
               environ: Mapping[str, str], delegated: Path | None,
               v1_groups: list[Path]) -> list[str]:
    """Stop the job's surviving processes; descriptions of those that outlived SIGKILL.

    The record is the job user's: whatever is at its name (a FIFO, a link, a
    huge or junk file) is only a missing record (read_record never blocks),
    and the kill passes over the job's environment and cgroups still run. Its
    cgroup root is never used: the cgroups killed are those root derived.
    """
    record, why = (None, None) if state_dir is None else read_record(state_dir, job.uid)
    if record is None and why is not None and not why.endswith("No such file or directory"):
        hook.warn("processes", f"fiberd record ignored: {why}")
    trees = ([delegated] if delegated is not None else []) + v1_groups
    slurm_conf = environ.get("SLURM_CONF") or None

    def discover(deadline: float) -> tuple[list[procscan.Found], bool]:
        return procscan.scan(job, slurm_conf, record, deadline)

    out = survivors.stop_job_processes(discover, trees, config.step_seconds * BUDGET_SHARE)
    if out.killed:
        hook.warn("processes", f"killed {out.killed} leftover process(es): "
                  + "; ".join(out.named))
    if not out.complete:
        hook.warn("processes", "the job's processes outnumber what one pass over /proc "
                  "can look at within the step's bound; its cgroups were killed whole")
    return out.alive


def _leases(hook: Hook, config: SiteConfig, paths: JobPaths, job: SlurmJob) -> bool:
    if not paths.lease_dir.exists():
        return True
    moved = prepare_lease_area(paths)  # an area an older version shared: root's first
    if moved:
        hook.warn("leases", moved_aside_line(moved))
    released, dropped = release_job(node_leases(paths, SystemClock(), config.lease_ttl), job)
    if released or dropped:
        hook.note("leases", f"released {released}, dropped grants of {dropped}")
    return True


def _cgroup(work_s: float, *trees: Path) -> bool:
    """Remove each of ``trees`` whole, deepest first, within ``work_s`` seconds; OSError
    (EBUSY, naming what is left) when a group of them is left."""
    deadline = time.monotonic() + work_s
    left = [line for tree in trees for line in teardown.remove_tree(tree, deadline)[1]]
    if left:
        raise OSError(errno.EBUSY, "left: " + "; ".join(left[:3]), str(trees[0]))
    return True


def _v1_groups(environ: Mapping[str, str], job: SlurmJob) -> list[Path]:
    """The job's groups in Slurm's cgroup v1 hierarchies on this node (see cgroup_v1)."""
    return job_groups(environ.get("SLURM_CONF") or None, job.node, job.uid, job.job_id)


def run_epilog(environ: Mapping[str, str], hook: Hook) -> int:
    """Run every epilog step for the job in ``environ``; the exit code (see module doc).

    Blocks on file I/O and on killed processes going away, each step bounded
    by the site's ``step_seconds``. Never raises for a problem of the job,
    the node or the config.
    """
    try:
        config = load_site_config(environ)
    except SiteConfigError as err:
        hook.report("config", f"{err}; nothing cleaned up")
        return 0
    hook.step_seconds = config.step_seconds
    try:
        job = job_from_env(environ)
    except SlurmParseError as err:
        hook.report("job", err.reason)
        return 0
    hook.job = job.job_id
    paths = job_paths(config.state_root, job.node, job.job_id)
    delegated = None
    if config.delegate_cgroup:
        delegated = hook.step("cgroup", lambda: job_cgroup(config, job.node, job.job_id))
    v1_groups = hook.step("cgroup_v1", lambda: _v1_groups(environ, job)) or []
    work_s = config.step_seconds * WORK_SHARE
    retired = hook.step("grants", lambda: retire_state_dir(paths, job.job_id, work_s))
    alive = hook.step("processes", lambda: _processes(hook, config, retired, job, environ,
                                                      delegated, v1_groups))
    hook.step("leases", lambda: _leases(hook, config, paths, job))
    if delegated is not None:
        hook.step("cgroup", lambda: _cgroup(work_s, delegated))
    removed_v1 = bool(v1_groups) and hook.step("cgroup_v1",
                                               lambda: _cgroup(work_s, *v1_groups))
    if removed_v1:
        hook.note("cgroup_v1", "removed the job's cgroup v1 groups left in "
                  + ", ".join(str(g) for g in v1_groups))
    hook.step("cgroup_v2", lambda: cgroup_v2.run(hook, job, config.step_seconds * BUDGET_SHARE))
    hook.step("metrics", lambda: remove_job_textfile(config.state_root, job.node, job.job_id))
    kept = retired and hook.step(
        "audit", lambda: keep_job_audit(hook, retired, config.state_root, job))
    if kept:
        hook.note("audit", f"kept the audit log as {kept}")
    first = None if retired is None else retired.name
    if retired is not None and "audit" in hook.failed and os.path.lexists(retired / AUDIT_NAME):
        kept_dir = hook.step("state_dir", lambda: keep_retired(retired))
        hook.report("state_dir", f"kept {kept_dir or retired}: its audit log could not be moved")
        first = None
    gone = hook.step("state_dir", lambda: remove_retired(paths, first, work_s,
                                                               MOST_STEPS * config.step_seconds))
    if gone is False:
        hook.warn("state_dir", f"{retired} is not removed yet: later epilogs go on with it")
    elif gone and retired is not None:
        hook.note("state_dir", f"removed {paths.state_dir}")
    if alive:
        hook.report("processes", "survived SIGKILL: " + "; ".join(alive))
        return 1
    return 1 if "processes" in hook.failed else 0  # not shown gone: drain, as for survivors


def main() -> None:
    """The ``slurm-fiber-epilog`` console script."""
    hook_main(NAME, __doc__ or NAME, run_epilog)
