"""The Kubernetes home: fiberd as the one container of a grant Pod.

It implements ``core.seam.Home``, every port of the seam and ``LosesScope``
for one Pod:

- grants: the mounted Secret directory (``FiberdConfig.grantdir``) through a
  GrantDir in Secret-volume mode, so the kubelet's atomic ``..data`` swap
  delivers each new token once and a rotation never removes a grant;
  no grant of its own.
- health: a HealthPoll whose round re-reads the projected token, then reads
  the Pod and its ResourceClaims (``reading.read_scope``); a round the API
  server does not answer leaves the health to go stale.
- a refused token fails closed: a Pod-bound token stops working when its
  Pod is deleted or replaced (the API server keeps accepting it from its
  cache for about 10 s, then answers 401). A home cut off from the API
  during those 10 s never sees the new UID; its first answer is a 401. So
  ``TOKEN_REFUSALS`` rounds in a row answered 401, each with the token just
  re-read from its file, are a Pod loss (``removes_grants``: scope loss,
  not stale-until-fenced): a 401 is an answer, and the only answer a bound
  token gets once its Pod is gone, so the grants go with the Pod and no
  Clone is admitted on the refused token from the second 401 on (within
  two poll intervals of the first). A 403 (RBAC) is not a refusal of
  identity: it only fails the round.
- scope: namespace, service account, Pod, Pod UID, node and each claim,
  from the latest reading of this Pod (from the downward API before the
  first one).
- scope loss: through a ScopeLossQueue to the handler ``on_scope_lost`` set,
  each reason once, in order. The Pod being deleted, gone or replaced (UID
  changed), or its token refused, calls ``handler(reason, True)``: the grants go with the Pod, and
  nothing after that first Pod loss is delivered. A claim deallocated,
  being deleted, gone or recreated calls ``handler(reason, False)``: an
  epoch bump, since the devices went away under running fibers.
- readiness: a ReadyGate patching the Pod status condition the readiness
  gate names (``ready_condition``), keeping the Pod's other conditions;
  failed publishes are sent again every poll interval while the Pod lives.
- devices: the static devices of the configuration when it names any (a
  cluster without DRA), else those the claims' allocations hold, narrowed
  to the grant's kinds. Neither is claimed per grant, so release is a no-op.
- cgroup root: ``cgroup_root`` as configured; ``delegate`` carves the
  container's cgroup namespace root itself (nested delegation), and a
  read-only ``/sys/fs/cgroup`` leaves fiberd uncarved with the reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Mapping

from slurm_fiber.config import FiberdConfig
from slurm_fiber.core.book.health import SourceHealth
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
from slurm_fiber.homes.cgroupdelegate import Placement, resolve_cgroup_root
from slurm_fiber.homes.grantdir import GrantDir
from slurm_fiber.homes.healthpoll import HealthPoll, error_message
from slurm_fiber.homes.kubernetes.api import ApiFailure, KubeApi
from slurm_fiber.homes.kubernetes.incluster import load_in_cluster
from slurm_fiber.homes.kubernetes.options import DEFAULT_CONDITION, READY_CONDITION
from slurm_fiber.homes.kubernetes.reading import Reading, read_scope
from slurm_fiber.homes.kubernetes.scope import ScopeLoss, ScopeTracker, identity_claims
from slurm_fiber.homes.problem import ProblemSink, log_problem
from slurm_fiber.homes.readygate import ReadyGate
from slurm_fiber.homes.scopeloss import ScopeLossQueue

NAME = "kubernetes"
FIRST_ROUND_BUDGET = 2.0  # seconds for the round before serving (a cold TLS connection)
TOKEN_REFUSALS = 2  # rounds in a row answered 401 (token re-read before each) that end the Pod
log = logging.getLogger("slurm_fiber.homes.kubernetes")


class DevicesUnknown(CodedError):
    """The claims' devices are not known yet: ``code`` devices_unknown, ``reason`` for people."""

    def __init__(self, reason: str) -> None:
        super().__init__("devices_unknown", reason)


def _release_nothing() -> None:
    """A DRA claim belongs to the Pod and static devices are shared: nothing to release."""


def condition_message(warm: list[str]) -> str:
    """The readiness condition's message for the warm grants (sorted UIDs)."""
    if not warm:
        return "no grant template is warm"
    return f"{len(warm)} warm grant template(s): {', '.join(warm)}"


class KubernetesHome(Home, GrantSource, Liveness, Readiness, DeviceSource, CgroupRoot, LosesScope):
    """The Home of one grant Pod. Build it with ``build_kubernetes_home``; use one event loop.

    ``api`` is the client for this Pod (its identity is ``api.pod``).
    ``grantdir`` is the Secret's mount directory; ``poll_interval`` paces
    the grantdir, the API rounds (each gets one interval) and readiness
    retries; ``stale_after`` is the health's stale TTL; ``devices`` the
    static devices (empty: the claims'); ``cgroup`` the ``cgroup_root``
    setting; ``condition_type`` the readiness gate's condition.
    """

    def __init__(
        self,
        api: KubeApi,
        clock: Clock,
        *,
        grantdir: str,
        poll_interval: float = 1.0,
        stale_after: float = 60.0,
        devices: Iterable[Device] = (),
        cgroup: str | None = None,
        condition_type: str = DEFAULT_CONDITION,
        on_problem: ProblemSink = log_problem,
    ) -> None:
        self.api = api
        self.identity = api.pod
        self.condition_type = condition_type
        self._clock = clock
        self._interval = poll_interval
        self._health = SourceHealth(clock, stale_after, control_plane=True)
        self._grantdir = GrantDir(grantdir, clock, poll_interval, on_problem=on_problem,
                                  secret_volume=True, health=self._health)
        self.poll = HealthPoll(self._health, poll_interval, clock, self._round,
                               on_error=self._poll_failed, on_recovered=self._poll_recovered)
        self.scope_loss = ScopeLossQueue()
        self.gate = ReadyGate(self._publish)
        self._tracker = ScopeTracker(self.identity)
        self._removes: dict[str, bool] = {}  # queued reason -> removes_grants
        self._pod_over = False
        self._refusals = 0  # rounds in a row the API server answered 401
        self._reading: Reading | None = None
        self._scope = identity_claims(self.identity)
        self._static = DeviceChannel.of(devices)
        self._cgroup_setting = cgroup
        self._placement: Placement | None = None

    # ---- Home

    def name(self) -> str:
        """Always "kubernetes"."""
        return NAME

    def audience(self) -> str:
        """The ``aud`` this Pod's grants name when the configuration sets none."""
        return f"k8s:{self.identity.namespace}:{self.identity.name}"

    async def grants(self) -> AsyncIterator[GrantEvent]:
        """The Secret volume's deliveries; raises GrantDirRefused when it cannot be trusted
        (a missing one is waited for, the health stale meanwhile)."""
        return self._grantdir.deliveries()

    def health(self) -> SourceHealth:
        """Fresh while the API server answers the Pod rounds; stale after ``stale_after``."""
        return self._health

    def on_scope_lost(self, handler: ScopeLostHandler) -> None:
        """Deliver each loss to ``handler(reason, removes_grants)``, once, on ``run``'s task."""

        async def deliver(reason: str) -> None:
            await handler(reason, self._removes[reason])

        self.scope_loss.on_scope_lost(deliver)

    def cgroup_root(self) -> str | None:
        """The subtree fiberd may carve, resolved on the first call (see the module text)."""
        return self.placement().root

    def cgroup_reason(self) -> str:
        """One line on where the cgroup root came from, or why there is none."""
        return self.placement().reason

    def placement(self) -> Placement:
        """The resolved cgroup placement (resolving it on first use). Never raises."""
        if self._placement is None:
            self._placement = resolve_cgroup_root(self._cgroup_setting, root_is_ours=True)
        return self._placement

    async def publish_ready(self, grant_uid: str, ready: bool) -> None:
        """Record a template's readiness; on a flip, patch the Pod condition. Raises ApiFailure."""
        await self.gate.publish_ready(grant_uid, ready)

    def ready(self) -> bool:
        """Whether any grant's template is warm (the newest decided state)."""
        return self.gate.ready()

    def scope(self) -> list[ScopeClaim]:
        """The scope of this Pod's latest reading (the downward API's before the first)."""
        return list(self._scope)

    async def devices(self, grant: VerifiedToken) -> tuple[DeviceChannel, ReleaseDevices]:
        """The static devices, else the claims' allocated ones, of the grant's kinds.

        Raises DevicesUnknown when the devices come from claims and the API
        server has not answered a round yet. Does not block.
        """
        if self._static.devices:
            channel = self._static
        elif self._reading is None:
            raise DevicesUnknown("the Pod's ResourceClaims have not been read yet")
        else:
            channel = self._reading.devices
        return channel.narrowed(grant.spec.devices), _release_nothing

    async def run(self) -> None:
        """Run the API rounds, scope-loss delivery and readiness retries until cancelled."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.poll.run())
            tasks.create_task(self.scope_loss.run())
            tasks.create_task(self._republish_forever())

    async def aclose(self) -> list[str]:
        """Close the API client and undo cgroup delegation. Call it last; never raises.

        Returns one line per step that failed. Idempotent.
        """
        await self.api.aclose()
        placement = self._placement
        if placement is None or placement.delegation is None:
            return []
        return placement.delegation.undo()

    # ---- the API rounds

    @property
    def pod_over(self) -> bool:
        """Whether the Pod was seen deleting, gone or replaced (its grants are removed)."""
        return self._pod_over

    async def first_round(self, budget: float) -> BaseException | None:
        """One round given ``budget`` seconds, marking the health when it answers; its error.

        A HealthPoll of its own paces it (the same health, round and logging),
        so it is judged exactly as the poll's rounds are.
        """
        first = HealthPoll(self._health, budget, self._clock, self._round,
                           on_error=self._poll_failed, on_recovered=self._poll_recovered)
        return await first.once()

    async def _round(self) -> None:
        self.api.reload_token()
        try:
            reading = await read_scope(self.api, self._tracker)
        except ApiFailure as failure:
            self._refusals = self._refusals + 1 if failure.code == 401 else 0
            if self._refusals >= TOKEN_REFUSALS:
                self._lose(self._tracker.token_refused())
            raise
        self._refusals = 0
        self._reading = reading
        if reading.pod is not None and reading.pod.uid == self.identity.uid and not self._pod_over:
            self._scope = reading.scope
        for loss in reading.losses:
            self._lose(loss)

    def _lose(self, loss: ScopeLoss) -> None:
        if self._pod_over:
            return  # the grants went with the Pod: nothing left to bump or remove
        if loss.removes_grants:
            self._pod_over = True
        self._removes.setdefault(loss.reason, loss.removes_grants)
        if self.scope_loss.lose(loss.reason):
            log.warning("kubernetes home: scope lost: %s", loss.reason)

    def _poll_failed(self, err: BaseException) -> None:
        log.warning("kubernetes home: API round failed: %s", error_message(err))

    def _poll_recovered(self) -> None:
        log.info("kubernetes home: the API server answers again")

    # ---- readiness

    async def _publish(self, warm: list[str]) -> None:
        ready = bool(warm)
        await self.api.set_condition(
            self.condition_type,
            ready,
            reason="TemplateWarm" if ready else "NoTemplateWarm",
            message=condition_message(warm),
        )

    async def _republish_forever(self) -> None:
        while True:
            await self._clock.sleep(self._interval)
            if self._pod_over:
                continue  # no Pod left to publish to
            changed, err = await self.gate.republish()
            if changed:
                if err is None:
                    log.info("kubernetes home: readiness published again")
                else:
                    log.warning("kubernetes home: readiness not published: %s",
                                error_message(err))


async def build_kubernetes_home(
    config: FiberdConfig, clock: Clock, environ: Mapping[str, str], *,
    on_problem: ProblemSink = log_problem,
) -> KubernetesHome:
    """The home of the grant Pod whose container environment is ``environ``.

    Reads the in-cluster configuration (``incluster``: service account,
    downward API, and the ``SLURM_FIBER_KUBE_*`` overrides) and takes the
    rest from ``config``: grantdir (the Secret's mount), poll_interval,
    stale_ttl, devices, cgroup_root and ready_condition; ``on_problem`` gets
    the Secret volume's problems. Runs one API round at once, so scope and
    devices are known before fiberd serves when the API server answers; one
    that does not answer only leaves the health unmarked. That round gets
    ``FIRST_ROUND_BUDGET`` (at least one poll interval), not one interval: its
    TLS connection is new, and on a loaded node a handshake plus the first
    read can overrun 50 ms, after which every grant already in the Secret
    would be refused for unknown devices. Blocks on small file reads (in a
    thread) and at most that budget. Raises InClusterError when the
    environment is not a usable grant Pod's.
    """
    in_cluster = await asyncio.to_thread(load_in_cluster, environ)
    home = KubernetesHome(
        KubeApi(in_cluster, clock=clock),
        clock,
        grantdir=config.grantdir,
        poll_interval=config.poll_interval,
        stale_after=config.stale_ttl,
        devices=config.devices,
        cgroup=config.cgroup_root,
        condition_type=config.home_options.get(READY_CONDITION, DEFAULT_CONDITION),
        on_problem=on_problem,
    )
    await home.first_round(max(config.poll_interval, FIRST_ROUND_BUDGET))
    return home
