"""A Slurm node's GPUs (GRES) as leases: the prolog grants, fiberd claims, the epilog releases.

Built on the lease package (``slurm_fiber.lease.Leases``) over the node's
lease dir and state document (``paths.job_paths``: ``lease_dir``,
``lease_state``), with one resource per GPU (``paths.gpu_resource``):

- the prolog (root) records itself as the node's supervisor (no process to
  watch: it exits, its grants stay) and ``grant_job_gpus`` grants each of
  the job's GPUs on this node to the job's party, in allocation order;
- fiberd (the job user) claims them through ``NodeLeases``, the Slurm home's
  ``DeviceLeases``: a claim is admitted only by the job's grant, and refused
  while another job holds the GPU, so two jobs never hold one GPU;
- the epilog (root) ``release_job``: frees every lease the job holds and
  drops the grants it never claimed.

The job's party is its session ``slurm-job:<cluster>:<job id>``. The lease
area is cooperative, like the shell lock the lease format comes from: the
prolog makes it writable by job users (``prepare_lease_area``), because
fiberd claims as the job user; device confinement proper is Slurm's
(ConstrainDevices). Methods block on the state document's lock. The host
name is ``os.uname().nodename``, what ``socket.gethostname()`` returns on
Linux, without the socket module's import on every GPU job's prolog.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from slurm_fiber.core.clock import Clock
from slurm_fiber.homes.slurm.jobenv import SlurmJob
from slurm_fiber.homes.slurm.paths import JobPaths, gpu_resource, job_paths
from slurm_fiber.homes.slurm.siteconfig import SiteConfig
from slurm_fiber.lease import Caller, LeaseError, Leases, Party, ProcessRef, Refusal
from slurm_fiber.lease.stale import AUDIT_FILE

SHARED_DIR_MODE = 0o777
SHARED_FILE_MODE = 0o666


def job_party(job: SlurmJob) -> Party:
    """The lease party of ``job``: its session, with the job user and this host."""
    return Party(session=f"slurm-job:{job.cluster}:{job.job_id}", person=job.user,
                 host=os.uname().nodename)


def prolog_party(node: str) -> Party:
    """The node's lease supervisor: the slurm_fiber prolog of ``node``."""
    return Party(session=f"slurm-prolog:{node}", person="root", host=os.uname().nodename)


def node_leases(paths: JobPaths, clock: Clock, ttl: float) -> Leases:
    """The node's Leases; ``ttl`` is how long a grant stays claimable once its GPU is free."""
    return Leases(paths.lease_dir, paths.lease_state, clock, ttl=ttl)


def prepare_lease_area(paths: JobPaths) -> None:
    """Create the lease dir and its lock and audit files writable by job users (root only).

    Idempotent. The dir is writable by everyone, so a lock or audit file that
    is anything but a regular file (a planted symlink) is replaced, never
    followed. Raises OSError when the area cannot be created.
    """
    lease_dir: Path = paths.lease_dir
    lease_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(lease_dir, SHARED_DIR_MODE)
    lock = paths.lease_state.with_name(paths.lease_state.name + ".lock")
    for shared in (lock, lease_dir / AUDIT_FILE):
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(os.lstat(shared).st_mode):
                os.unlink(shared)
        fd = os.open(shared, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK,
                     SHARED_FILE_MODE)
        try:
            os.fchmod(fd, SHARED_FILE_MODE)
        finally:
            os.close(fd)


def grant_job_gpus(leases: Leases, job: SlurmJob) -> list[str]:
    """As the node's supervisor, grant the job's GPUs on this node to the job; the resources.

    Idempotent: a GPU already granted to (or held by) the job is not granted
    again. Raises LeaseError when the state cannot be read or written, or
    another supervisor runs on the node.
    """
    if not job.gpus:
        return []
    by = Caller(prolog_party(job.node), name=f"slurm-fiber prolog on {job.node}")
    leases.supervise_start(by)
    party = job_party(job)
    granted = {g.resource for g in leases.state().grants if g.to.same_as(party)}
    held = {h.env for h in leases.dir.list() if h.party().same_as(party)}
    resources = [gpu_resource(job.node, index) for index in job.gpus]
    for resource in resources:
        if resource not in granted | held:
            leases.grant(resource, party, by)
    return resources


def release_job(leases: Leases, job: SlurmJob) -> tuple[list[str], list[str]]:
    """Free every lease ``job`` holds on the node and drop its unclaimed grants.

    Returns (released resources, resources whose grants were dropped).
    Idempotent. Raises LeaseError when the lease state cannot be read or
    written; a lease that cannot be released is left for the next try.
    """
    party = job_party(job)
    caller = Caller(party, name=f"slurm-fiber epilog for job {job.job_id}")
    released = [h.env for h in leases.dir.list() if h.party().same_as(party)]
    for resource in released:
        leases.release(resource, caller)
    state = leases.state()
    dropped: list[str] = []
    if state.supervisor is not None and any(g.to.same_as(party) for g in state.grants):
        by = Caller(state.supervisor.party)
        dropped = [g.resource for g in leases.revoke(party, by)]
    return released, dropped


class NodeLeases:
    """The Slurm home's DeviceLeases for one job on this node (see home.DeviceLeases).

    ``process`` is the claiming fiberd (so a holder that died without its
    epilog can be proved gone and reclaimed); None names no process.
    Methods block on the lease state; safe to call from threads.
    """

    def __init__(self, paths: JobPaths, job: SlurmJob, clock: Clock, *, ttl: float,
                 process: ProcessRef | None = None) -> None:
        self.job = job
        self.leases = node_leases(paths, clock, ttl)
        self.caller = Caller(job_party(job), name=f"slurm job {job.job_id} ({job.user})",
                             process=process)

    @classmethod
    def for_job(cls, config: SiteConfig, job: SlurmJob, clock: Clock,
                process: ProcessRef | None) -> NodeLeases:
        """The job's leases on its node under the site's state root and lease TTL."""
        return cls(job_paths(config.state_root, job.node, job.job_id), job, clock,
                   ttl=config.lease_ttl, process=process)

    def claim(self, resource: str) -> None:
        """Claim ``resource`` for the job (idempotent); DevicesRefused when it cannot be had."""
        # Imported here: home.py pulls in asyncio and jwt, which the prolog (this module's
        # other user, on every job start) does not need.
        from slurm_fiber.homes.slurm.home import DevicesRefused

        try:
            self.leases.claim(resource, self.caller, f"fiberd of slurm job {self.job.job_id}",
                              steal_stale=True)
        except Refusal as err:
            holder = None
            with contextlib.suppress(LeaseError):
                holder = self.leases.dir.get(resource)
            code = "device_held" if holder is not None else "lease_failed"
            raise DevicesRefused(code, f"{resource}: {err.reason}") from None
        except LeaseError as err:
            raise DevicesRefused("lease_failed", f"{resource}: {err}") from None

    def release(self, resource: str) -> None:
        """Free the job's claim of ``resource`` and give it back to the job's pool.

        The GPU stays the job's until its epilog: freeing the lease would
        leave it claimable by nobody (a claim uses up its grant), so the
        grant is queued again for the job, on behalf of the node's
        supervisor, and the next grant naming the GPU can claim it. Free, or
        held by another, is a no-op. Raises LeaseError when the lease or the
        state cannot be read or written.
        """
        holder = self.leases.dir.get(resource)
        if holder is None or not holder.party().same_as(self.caller.party):
            return
        self.leases.release(resource, self.caller)
        supervisor = self.leases.state().supervisor
        if supervisor is not None:
            self.leases.grant(resource, self.caller.party, Caller(supervisor.party))
