"""The Slurm home: fiberd inside a Slurm job, run as `srun --overlap fiberd-run`.

It implements ``core.seam.Home`` and every port of the seam (``LosesScope``
included) for one job on one node:

- grants: the prolog's grantdir for the job (``paths.job_paths``), polled.
- scope: cluster, job id, user, partition, node, and account and job name
  when the environment or slurmctld names them ("slurm.cluster", ...).
- health: a HealthPoll whose round is `scontrol ping` plus the job's state
  from `squeue --json` (the control plane's answer; `scontrol show job` can
  be spoofed through Comment). Every call is bounded and killed on cancel.
- scope loss: once, when the job leaves RUNNING (completing, cancelled,
  timed out, requeued, or no longer listed after it was seen). The job is
  gone, so everything of it must stop: the loss reaches the handler set
  with ``on_scope_lost`` (``LosesScope``) with ``removes_grants`` true, so
  the core bumps the epoch (ending every fence) and removes every grant.
- devices: the job's GPUs on this node (jobenv), narrowed to the grant's
  kinds, with device files from gres.conf when configured, claimed as
  leases (``DeviceLeases``) so two jobs never drive one device.
- cgroup root: see cgroup_root (delegated subtree, else its own step
  cgroup, else none with the reason in ``cgroup_reason``).
- the job's end, sooner: on a cgroup/v2 node where fiberd carves its task cgroup, the
  batch script's cgroup emptying (batchwatch), which Slurm's SIGTERM no longer tells it;
  after the scope loss has stopped every fiber, ``on_job_end`` (fiberd-run: ``end_fiberd``,
  fiberd's own SIGTERM) ends fiberd, so the step ends before Slurm's KillWait.
- readiness: a ReadyGate publishing to the job's ready file, and to the
  job's Comment when configured (readiness module: the file is authoritative).

Its settings are a ``SlurmHomeConfig`` (the site config builds it); a grant whose
devices cannot be had is refused with ``DevicesRefused`` (code and reason).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from slurm_fiber.core.book.health import SourceHealth
from slurm_fiber.core.cgroups.v2 import cgroup2_mount
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.devices import Device, DeviceChannel
from slurm_fiber.core.seam import (
    CgroupRoot,
    DeviceSource,
    GrantEvent,
    GrantSource,
    Home,
    Liveness,
    LosesScope,
    Readiness,
    ReleaseDevices,
    ScopeLostHandler,
)
from slurm_fiber.core.trust.grant import ScopeClaim, VerifiedToken
from slurm_fiber.errors import CodedError
from slurm_fiber.homes.grantdir import GrantDir
from slurm_fiber.homes.healthpoll import HealthPoll, error_message
from slurm_fiber.homes.problem import Problem, ProblemSink, log_problem
from slurm_fiber.homes.readygate import ReadyGate
from slurm_fiber.homes.scopeloss import ScopeLossQueue
from slurm_fiber.homes.slurm.batchwatch import batch_user, wait_batch_end
from slurm_fiber.homes.slurm.cgroup_root import (
    LEAF,
    CgroupChoice,
    choose_cgroup_root,
)
from slurm_fiber.homes.slurm.control import ControlPlane
from slurm_fiber.homes.slurm.jobenv import SlurmJob, job_from_env
from slurm_fiber.homes.slurm.paths import (
    DEFAULT_STATE_ROOT,
    JobPaths,
    gpu_resource,
    job_paths,
)
from slurm_fiber.homes.slurm.readiness import ReadyPublisher
from slurm_fiber.homes.slurm.scontrol import QueueJob

log = logging.getLogger("slurm_fiber.homes.slurm")

# Job states that are not a loss: the job has not started yet, or Slurm
# stopped its processes and will resume them in the same allocation.
WAITING_STATES = frozenset({"PENDING", "CONFIGURING"})
HELD_STATES = frozenset({"SUSPENDED"})
LEAVING_FLAGS = frozenset({"COMPLETING", "STAGE_OUT", "REQUEUED", "RESIZING", "SIGNALING"})


class JobNotListed(Exception):
    """slurmctld answered but does not list the job, which was never seen running."""


class SlurmDownError(Exception):
    """`scontrol ping` answered, and no controller is UP."""


class DevicesRefused(CodedError):
    """The grant's devices cannot be had: ``code`` (device_held, lease_failed) and ``reason``."""


@dataclass(frozen=True)
class SlurmHomeConfig:
    """Settings of the Slurm home; every field has a working default.

    ``poll_every`` is the HealthPoll interval (and each round's budget),
    ``stale_after`` the health's stale TTL, ``grant_poll_every`` the grantdir
    interval, ``publish_comment`` also writes readiness to the job's Comment,
    ``gpu_files`` maps a node GPU index to its device file (gres.gpu_files).
    """

    state_root: Path = DEFAULT_STATE_ROOT
    poll_every: float = 5.0
    stale_after: float = 30.0
    grant_poll_every: float = 1.0
    publish_comment: bool = False
    gpu_files: Mapping[int, str] = field(default_factory=dict)


def health_poll_every(stale_after: float) -> float:
    """The HealthPoll interval for a stale TTL of ``stale_after`` s: the default, or a third
    of the TTL when that is shorter, so a control plane that answers every round never reads
    stale between two rounds (one slow round is absorbed too). Pure."""
    return min(SlurmHomeConfig.poll_every, stale_after / 3)


class DeviceLeases(Protocol):
    """The node's device leases as the Slurm home uses them, for one job. Methods block."""

    def claim(self, resource: str) -> None:
        """Claim ``resource`` for the job; idempotent for the job's own claims.

        Raises DevicesRefused("device_held") naming the holder when another
        holds it, DevicesRefused("lease_failed") for anything else.
        """
        ...

    def release(self, resource: str) -> None:
        """Free the job's claim of ``resource``; a free resource is fine. Raises on I/O failure."""
        ...


def job_verdict(job_id: int, listed: QueueJob | None, seen: bool) -> tuple[bool, str | None]:
    """Judge one answer about the job: (running now, scope-loss reason or None). Pure.

    ``seen`` is whether an earlier answer showed it running. Raises
    JobNotListed when the job is not listed and was never seen.
    """
    if listed is None:
        if not seen:
            raise JobNotListed(f"slurmctld does not list job {job_id}")
        return False, f"job {job_id} is no longer listed by slurmctld"
    base, flags = listed.states[0], frozenset(listed.states[1:])
    if base == "RUNNING" and not flags & LEAVING_FLAGS:
        return True, None
    if base in HELD_STATES or (base in WAITING_STATES and not seen):
        return False, None
    return False, f"job {job_id} left RUNNING: {'+'.join(listed.states)}"


def job_scope(job: SlurmJob, listed: QueueJob | None = None) -> list[ScopeClaim]:
    """The scope claims for ``job``; account and name from ``listed`` when the env lacked them."""
    claims = [("cluster", job.cluster), ("job_id", str(job.job_id)), ("user", job.user),
              ("partition", job.partition), ("node", job.node),
              ("account", job.account or (listed.account if listed else None)),
              ("job_name", job.name or (listed.name if listed else None))]
    return [ScopeClaim(f"slurm.{key}", value) for key, value in claims if value]


class SlurmHome(Home, GrantSource, Liveness, Readiness, DeviceSource, CgroupRoot, LosesScope):
    """The Home of one Slurm job on one node. Use on fiberd's event loop.

    Build it with ``SlurmHome(job, clock, control, config, cgroup=...)`` or,
    in fiberd-run, ``build_slurm_home`` (which also decides the cgroup root).
    ``leases`` claims the job's GPUs; None claims nothing (a node without
    lease state). ``on_problem`` receives grantdir and release problems.
    """

    def __init__(self, job: SlurmJob, clock: Clock, control: ControlPlane,
                 config: SlurmHomeConfig | None = None, *, cgroup: CgroupChoice,
                 leases: DeviceLeases | None = None,
                 on_problem: ProblemSink = log_problem,
                 on_job_end: Callable[[str], None] | None = None) -> None:
        self.job = job
        self.on_job_end = on_job_end
        self.config = config or SlurmHomeConfig()
        self.paths: JobPaths = job_paths(self.config.state_root, job.node, job.job_id)
        self.clock = clock
        self.control = control
        self.leases = leases
        self.cgroup = cgroup
        self.on_problem = on_problem
        self.scope_loss = ScopeLossQueue()
        self._health = SourceHealth(clock, self.config.stale_after, control_plane=True)
        self.poll = HealthPoll(self._health, self.config.poll_every, clock, self._round,
                               on_error=self._poll_failed, on_recovered=self._poll_recovered)
        comment = control if self.config.publish_comment else None
        self.gate = ReadyGate(ReadyPublisher(job.job_id, self.paths.ready_file, clock, comment))
        self._seen = False
        self._lost: str | None = None
        self._listed: QueueJob | None = None
        self._claims: dict[str, int] = {}  # resource -> grants using it
        self._claims_lock = threading.Lock()

    # ---- Home

    def name(self) -> str:
        return "slurm"

    async def grants(self) -> AsyncIterator[GrantEvent] | None:
        """The job's grantdir, polled; raises GrantDirRefused when it cannot be trusted.

        A missing one is waited for, the health stale meanwhile (see grantdir).
        """
        return GrantDir(self.paths.grantdir, self.clock, self.config.grant_poll_every,
                        on_problem=self.on_problem, owner=self.job.uid,
                        health=self._health).deliveries()

    def health(self) -> SourceHealth:
        return self._health

    def on_scope_lost(self, handler: ScopeLostHandler) -> None:
        """Deliver the job's end to ``handler(reason, True)``: its grants go with it; once it
        returned (every fiber stopped), ``on_job_end(reason)`` when set (fiberd-run's:
        ``end_fiberd``, since Slurm's SIGTERM may no longer reach fiberd)."""

        async def deliver(reason: str) -> None:
            await handler(reason, True)
            if self.on_job_end is not None:  # every fiber stopped: now fiberd itself
                self.on_job_end(reason)

        self.scope_loss.on_scope_lost(deliver)

    def cgroup_root(self) -> str | None:
        return None if self.cgroup.path is None else str(self.cgroup.path)

    def cgroup_reason(self) -> str:
        """Why ``cgroup_root`` is what it is (one line)."""
        return self.cgroup.reason

    async def publish_ready(self, grant_uid: str, ready: bool) -> None:
        await self.gate.publish_ready(grant_uid, ready)

    def scope(self) -> list[ScopeClaim]:
        return job_scope(self.job, self._listed)

    async def devices(self, grant: VerifiedToken) -> tuple[DeviceChannel, ReleaseDevices]:
        """The job's GPUs on this node, narrowed to the grant's kinds and claimed as leases.

        Blocks on the lease state (in a thread). Raises DevicesRefused,
        having released whatever this call claimed, when one cannot be had.
        """
        visible = dict(zip(self.job.gpus, self.job.gpu_visible, strict=False))
        gpus = [Device("gpu", i, path=self.config.gpu_files.get(i), visible=visible.get(i))
                for i in self.job.gpus]
        channel = DeviceChannel.of(gpus).narrowed(grant.spec.devices)
        resources = [gpu_resource(self.job.node, d.index) for d in channel.devices]
        taken: list[str] = []
        try:
            for resource in resources:
                await asyncio.to_thread(self._hold, resource)
                taken.append(resource)
        except BaseException:
            await asyncio.to_thread(self._drop_all, taken)
            raise
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._drop_all(taken)

        return channel, release

    async def run(self) -> None:
        """Run the health poll, scope-loss delivery and readiness retries until cancelled."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.poll.run())
            tasks.create_task(self.scope_loss.run())
            tasks.create_task(self._republish_forever())
            batch = batch_user(self.cgroup.path)
            if batch is not None:
                tasks.create_task(self._watch_batch(batch))

    async def _watch_batch(self, batch: Path) -> None:
        """Lose the scope as soon as the batch script's cgroup empties (batchwatch)."""
        reason = await wait_batch_end(batch, self.clock)
        if self._lost is None:
            self._lost = f"job {self.job.job_id}: {reason}"
            if self.scope_loss.lose(self._lost):
                log.warning("slurm home: scope lost: %s", self._lost)

    # ---- health rounds

    async def _round(self) -> None:
        ping = await self.control.ping()
        if not ping.up:
            hosts = ", ".join(f"{c.role} {c.host}" for c in ping.controllers)
            raise SlurmDownError(f"slurmctld is DOWN ({hosts})")
        listed = await self.control.job(self.job.job_id)
        running, reason = job_verdict(self.job.job_id, listed, self._seen)
        if listed is not None:
            self._listed = listed
        self._seen = self._seen or running
        if reason is not None and self._lost is None:
            self._lost = reason
            if self.scope_loss.lose(reason):
                log.warning("slurm home: scope lost: %s", reason)

    @property
    def lost(self) -> str | None:
        """The scope-loss reason once the job has left RUNNING, else None."""
        return self._lost

    def _poll_failed(self, err: BaseException) -> None:
        log.warning("slurm home: control plane round failed: %s", error_message(err))

    def _poll_recovered(self) -> None:
        log.info("slurm home: control plane answers again")

    async def _republish_forever(self) -> None:
        while True:
            await self.clock.sleep(self.config.poll_every)
            changed, err = await self.gate.republish()
            if changed:
                if err is None:
                    log.info("slurm home: readiness published again")
                else:
                    log.warning("slurm home: readiness publish failed: %s", error_message(err))

    # ---- device leases (called in threads)

    def held_resources(self) -> frozenset[str]:
        """The GPU resources (``gpu:<node>:<index>``) some grant of this fiberd holds now.

        fiberd's own record of its holds: the node's lease of each GPU is the
        job's for the whole job (the prolog's claim), whether a grant uses it
        or not. Thread-safe; never blocks on the lease state.
        """
        with self._claims_lock:
            return frozenset(self._claims)

    def _hold(self, resource: str) -> None:
        with self._claims_lock:
            if self._claims.get(resource, 0) == 0 and self.leases is not None:
                self.leases.claim(resource)
            self._claims[resource] = self._claims.get(resource, 0) + 1

    def _drop_all(self, resources: list[str]) -> None:
        with self._claims_lock:
            for resource in resources:
                self._drop(resource)

    def _drop(self, resource: str) -> None:
        left = self._claims.get(resource, 0) - 1
        if left > 0:
            self._claims[resource] = left
            return
        self._claims.pop(resource, None)
        if self.leases is None:
            return
        try:
            self.leases.release(resource)
        except Exception as err:
            self.on_problem(Problem("release_failed", resource, error_message(err)))


def end_fiberd(reason: str) -> None:
    """fiberd's own SIGTERM at its job's end: the shutdown Slurm's SIGTERM would start, which
    no longer reaches a fiberd that moved into a leaf of its task cgroup (Slurm signals only
    what is listed directly in a task cgroup). Its fibers are stopped already."""
    log.warning("slurm home: the job has ended (%s): fiberd stops", reason)
    os.kill(os.getpid(), signal.SIGTERM)


async def build_slurm_home(env: Mapping[str, str], clock: Clock, control: ControlPlane,
                           config: SlurmHomeConfig | None = None, *,
                           leases: DeviceLeases | None = None, pid: int | None = None,
                           proc: Path = Path("/proc"),
                           on_job_end: Callable[[str], None] | None = None) -> SlurmHome:
    """The Slurm home of the `srun fiberd-run` step whose environment is ``env``.

    ``on_job_end`` is kept only when the process moved itself into its task cgroup's leaf
    (Slurm's SIGTERM then misses it); a home built elsewhere (conform) never gets it.

    Reads the job (jobenv), decides the cgroup root for process ``pid``
    (default: this one), moving it into its leaf when it carves its own
    cgroup. Blocks on small file I/O (in a thread). Raises SlurmParseError
    when ``env`` is not a Slurm job's.
    """
    job = job_from_env(env)
    config = config or SlurmHomeConfig()
    paths = job_paths(config.state_root, job.node, job.job_id)

    def decide() -> CgroupChoice:
        try:
            mount = cgroup2_mount((proc / "self" / "mountinfo").read_text())
        except OSError as err:
            return CgroupChoice(None, f"{proc}/self/mountinfo: {err.strerror}")
        return choose_cgroup_root(paths.cgroup_file, mount, job.job_id,
                                  os.getpid() if pid is None else pid, proc, job.sluid)

    cgroup = await asyncio.to_thread(decide)
    me = os.getpid() if pid is None else pid
    in_leaf = await asyncio.to_thread(_in_leaf, cgroup.path, me)
    return SlurmHome(job, clock, control, config, cgroup=cgroup, leases=leases,
                     on_job_end=on_job_end if in_leaf else None)


def _in_leaf(root: Path | None, pid: int) -> bool:
    """Whether ``pid`` moved itself into the leaf of its own task cgroup ``root`` (where
    Slurm's SIGTERM misses it); only then does the home end fiberd at the job's end."""
    if root is None:
        return False
    try:
        return str(pid) in (root / LEAF / "cgroup.procs").read_text().split()
    except OSError:
        return False
