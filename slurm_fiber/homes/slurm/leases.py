"""A Slurm node's GPUs (GRES) as leases: the prolog grants and claims, the epilog releases.

Built on the lease package (``slurm_fiber.lease.Leases``) over the node's
lease dir and state document (``paths.job_paths``: ``lease_dir``,
``lease_state``), with one resource per GPU (``paths.gpu_resource``).

The node's lease area is root's alone (``prepare_lease_area``): the lease
dir, its state document, lock and audit log belong to root, the dir mode
0755 and the files 0644, so no job user can rename, replace or delete
another job's lease or the node's state. An area an older version left
shared (0777 dir, 0666 files) is tightened through descriptors, and every
entry in it that root does not own (a job user's planted link, FIFO, hard
link or lease) is moved aside under a dot-name, never followed, reported in
one line and never taken as a lease. The narrow way in is the prolog:

- the prolog (root) records itself as the node's supervisor (no process to
  watch: it exits, its grants stay), grants each of the job's GPUs on this
  node to the job's party in allocation order, and claims each in the
  job's name, consuming the grant, all under one lock and one write of the
  state document (``grant_and_claim_job_gpus``): a session
  still claims only what the supervisor granted it, in order;
- fiberd (the job user) only verifies through ``NodeLeases``, the Slurm
  home's ``DeviceLeases``, and writes nothing: held by its own job, fine;
  held by another job, ``device_held``; not held, ``lease_failed``;
- the epilog (root) ``release_job``: frees every lease the job holds (one
  write of the state document) and drops the grants it never claimed.

A lease claimed by the prolog names no process (the prolog exits), so it is
never stale: it stays the job's until the job's epilog, or until root runs
``slurm-fiber lease release RES --force`` when an epilog never ran.

The job's party is its session ``slurm-job:<cluster>:<job id>``. Methods
block on the state document's lock. The host name is
``os.uname().nodename``, what ``socket.gethostname()`` returns on Linux,
without the socket module's import on every GPU job's prolog.
"""

from __future__ import annotations

import contextlib
import os
import stat

from slurm_fiber import safefs
from slurm_fiber.core.clock import Clock
from slurm_fiber.homes.slurm.home import DevicesRefused
from slurm_fiber.homes.slurm.jobenv import SlurmJob
from slurm_fiber.homes.slurm.paths import JobPaths, gpu_resource, job_paths
from slurm_fiber.homes.slurm.siteconfig import SiteConfig
from slurm_fiber.lease import Caller, Holder, LeaseError, Leases, Party, Refusal
from slurm_fiber.lease.stale import AUDIT_FILE

AREA_OWNERS = (0,)
AREA_DIR_MODE = 0o755
AREA_FILE_MODE = 0o644
UNTRUSTED_PREFIX = ".untrusted."


def job_party(job: SlurmJob) -> Party:
    """The lease party of ``job``: its session, with the job user and this host."""
    return Party(session=f"slurm-job:{job.cluster}:{job.job_id}", person=job.user,
                 host=os.uname().nodename)


def prolog_party(node: str) -> Party:
    """The node's lease supervisor: the slurm_fiber prolog of ``node``."""
    return Party(session=f"slurm-prolog:{node}", person="root", host=os.uname().nodename)


def node_leases(paths: JobPaths, clock: Clock, ttl: float) -> Leases:
    """The node's Leases; ``ttl`` is how long a grant stays claimable once its GPU is free."""
    return Leases(paths.lease_dir, paths.lease_state, clock, ttl=ttl, owners=AREA_OWNERS)


def prepare_lease_area(paths: JobPaths) -> list[str]:
    """Create the node's lease area root-only, or tighten one an older version shared.

    Root only; idempotent. The node dir above must already be root's and
    writable by no one else (the prolog makes it with statedir.check_parent). Acts
    through descriptors: the lease dir becomes root:root 0755; the state
    document, its lock and the audit log root's 0644 files. Every entry
    root does not own, and a lock, audit or state file that is not a
    regular file of one link, is renamed to ``.untrusted.<name>.<random>``
    (never followed, opened or chmodded; names starting with "." are never
    leases). Returns one line per entry moved aside. Raises OSError
    (UnsafePath) when the area cannot be made safe.
    """
    node_fd = safefs.open_dir(paths.lease_dir.parent, trusted_owners=AREA_OWNERS)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(paths.lease_dir.name, AREA_DIR_MODE, dir_fd=node_fd)
        try:
            area = os.open(paths.lease_dir.name, safefs.DIR_FLAGS, dir_fd=node_fd)
        except OSError as err:
            raise safefs.UnsafePath(f"{paths.lease_dir}: not a directory root can use "
                                    f"({err.strerror})") from None
    finally:
        os.close(node_fd)
    try:
        os.fchown(area, 0, 0)
        os.fchmod(area, AREA_DIR_MODE)
        moved = _move_aside_untrusted(area, paths)
        lock = paths.lease_state.name + ".lock"
        for name, flags in ((lock, os.O_RDWR | os.O_CREAT), (AUDIT_FILE, os.O_WRONLY | os.O_CREAT),
                            (paths.lease_state.name, os.O_RDONLY)):
            moved += _root_file(area, name, flags)
    finally:
        os.close(area)
    return moved


def moved_aside_line(moved: list[str]) -> str:
    """One report line for what ``prepare_lease_area`` moved aside (the first five named)."""
    entries = "entry" if len(moved) == 1 else "entries"
    return (f"moved aside {len(moved)} untrusted {entries} of the root-only lease area: "
            + "; ".join(moved[:5]))


def _aside(area: int, name: str, why: str) -> str:
    os.rename(name, f"{UNTRUSTED_PREFIX}{name}.{os.urandom(4).hex()}",
              src_dir_fd=area, dst_dir_fd=area)
    return why


def _move_aside_untrusted(area: int, paths: JobPaths) -> list[str]:
    """Rename aside every entry of ``area`` not owned by root (names with a leading "." are
    never looked at: they are other prologs' temporaries and what was moved aside before).

    An entry that goes away between the listing and its stat or rename (another prolog's
    state temporary, a job user removing what they planted) is gone, not an error.
    """
    moved: list[str] = []
    with os.scandir(area) as entries:
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                if st.st_uid in AREA_OWNERS:
                    continue
                kind = next((k for test, k in _KINDS if test(st.st_mode)), "a file")
                where = paths.lease_dir / entry.name
                moved.append(_aside(area, entry.name, f"{where} is {kind} of uid {st.st_uid}"))
            except FileNotFoundError:
                continue
    return moved


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISDIR, "a directory"))


def _root_file(area: int, name: str, flags: int) -> list[str]:
    """Make ``name`` a root 0644 regular file of one link (created when ``flags`` say so)."""
    try:
        fd = safefs.open_file(area, name, flags, mode=AREA_FILE_MODE, owners=AREA_OWNERS)
    except FileNotFoundError:
        return []
    except safefs.UnsafePath as err:
        moved = [_aside(area, name, str(err))]
        if flags & os.O_CREAT:  # nobody but root can plant a new one now
            fd = safefs.open_file(area, name, flags | os.O_EXCL, mode=AREA_FILE_MODE)
            os.close(fd)
        return moved
    try:
        os.fchmod(fd, AREA_FILE_MODE)
    finally:
        os.close(fd)
    return []


def grant_and_claim_job_gpus(leases: Leases, job: SlurmJob) -> tuple[list[str], list[str]]:
    """As the node's supervisor, grant the job's GPUs on this node to the job and claim them
    in its name; (the job's resources, one line per GPU that could not be claimed).

    Root only (the lease area is root's). Idempotent: a GPU the job holds is
    left as it is, one granted to it already is not granted again. A GPU
    held by another job keeps the grant queued and is reported (the job's
    fiberd then refuses it as ``device_held``). Raises LeaseError when the
    state cannot be read or written, or another supervisor runs on the node.
    """
    if not job.gpus:
        return [], []
    by = Caller(prolog_party(job.node), name=f"slurm-fiber prolog on {job.node}")
    supervisor = leases.state().supervisor
    if supervisor is None or supervisor.gone or not supervisor.party.same_as(by.party):
        leases.supervise_start(by)  # recorded once per node: every prolog is the same party
    claimer = Caller(job_party(job), name=job_holder_name(job))
    resources = [gpu_resource(job.node, index) for index in job.gpus]
    # One locked step for all the job's GPUs (one state write): a GPU held by the job already
    # is left unchanged, any other is granted and claimed.
    outcomes = leases.claim_each(resources, claimer, f"slurm job {job.job_id}",
                                 steal_stale=True, grant_by=by)
    refused = [f"{resource}: {outcome.reason}" for resource, outcome
               in zip(resources, outcomes, strict=True) if isinstance(outcome, Refusal)]
    return resources, refused


def job_holder_name(job: SlurmJob) -> str:
    """The ``holder`` text of the job's leases: ``slurm job <id> (<user>)``."""
    return f"slurm job {job.job_id} ({job.user})"


def release_job(leases: Leases, job: SlurmJob) -> tuple[list[str], list[str]]:
    """Free every lease ``job`` holds on the node and drop its unclaimed grants.

    Returns (released resources, resources whose grants were dropped).
    Idempotent. The job's leases are released under one lock and one write
    of the state document. Raises LeaseError when the lease state cannot be
    read or written, and, once the others are released and the grants
    dropped, naming each lease that could not be released (left for the
    next try).
    """
    party = job_party(job)
    caller = Caller(party, name=f"slurm-fiber epilog for job {job.job_id}")
    held = [h.env for h in leases.dir.list() if h.party().same_as(party)]
    outcomes = leases.release_each(held, caller) if held else []
    failed = [f"{resource}: {outcome}" for resource, outcome
              in zip(held, outcomes, strict=True) if isinstance(outcome, LeaseError)]
    released = [resource for resource, outcome in zip(held, outcomes, strict=True)
                if not isinstance(outcome, LeaseError)]
    state = leases.state()
    dropped: list[str] = []
    if state.supervisor is not None and any(g.to.same_as(party) for g in state.grants):
        by = Caller(state.supervisor.party)
        dropped = [g.resource for g in leases.revoke(party, by)]
    if failed:
        raise LeaseError("not released: " + "; ".join(failed))
    return released, dropped


class NodeLeases:
    """The Slurm home's DeviceLeases for one job on this node (see home.DeviceLeases).

    Runs as the job user and writes nothing: the prolog claimed the job's
    GPUs in its name, and the lease area is root's. Reads the job's lease
    records (root's, 0644) without following links or blocking on a FIFO.
    Safe to call from threads; never blocks on the state lock.
    """

    def __init__(self, paths: JobPaths, job: SlurmJob, clock: Clock, *, ttl: float) -> None:
        self.job = job
        self.leases = node_leases(paths, clock, ttl)
        self.party = job_party(job)

    @classmethod
    def for_job(cls, config: SiteConfig, job: SlurmJob, clock: Clock) -> NodeLeases:
        """The job's leases on its node under the site's state root and lease TTL."""
        return cls(job_paths(config.state_root, job.node, job.job_id), job, clock,
                   ttl=config.lease_ttl)

    def claim(self, resource: str) -> None:
        """Verify that ``resource`` is held for the job (idempotent); writes nothing.

        Raises DevicesRefused("device_held") naming the holder when another
        party holds it, DevicesRefused("lease_failed") when nobody does (the
        prolog did not claim it) or its record cannot be read.
        """
        try:
            holder: Holder | None = self.leases.dir.get(resource)
        except LeaseError as err:
            raise DevicesRefused("lease_failed", f"{resource}: {err}") from None
        if holder is None:
            raise DevicesRefused(
                "lease_failed",
                f"{resource} is not claimed for slurm job {self.job.job_id}: the prolog did "
                "not claim it (see its log line); fiberd cannot claim on a root-only lease area")
        if not holder.party().same_as(self.party):
            raise DevicesRefused(
                "device_held",
                f"{holder.label()} is held by {holder.holder} since {holder.since or '?'} "
                f"for {holder.purpose!r}")

    def release(self, resource: str) -> None:
        """Nothing to do: the GPU stays the job's until its epilog releases it.

        fiberd never writes the root-only lease area; dropping a grant's
        device (or every grant) leaves the job's lease in place, so the job
        can use the GPU again. Never raises.
        """
