"""The standalone home: fiberd on a plain host, with no scheduler and no kubelet.

Grants arrive from a grantdir (``*.jwt`` files an admin or a tool drops in a
directory). Devices are a static set from configuration. Scope is empty.
Readiness goes to a JSON file (replaced atomically) and, when
``NOTIFY_SOCKET`` is set, to systemd (``READY=1`` when a template turns
warm, ``STATUS=`` always). The cgroup root is configured, delegated from
fiberd's own cgroup, or absent with a stated reason.

"No control plane" means:

* **health** is ``SourceHealth(control_plane=False)``: fresh, except while
  the grantdir is missing, unreadable or refused: then it is stale (the
  grantdir marks it down) and a Clone for a grant not delivered yet misses
  with the retryable ``source_stale``, until the directory appears and its
  grants load;
* **miss codes**: a Clone for a UID that was never admitted misses with
  ``unknown_grant`` (a final "no") while the grantdir is readable, because
  nobody else could know better; a removed grant misses with ``denied``;
* **fences** never end by silence: a fiber runs until its lease, its own
  time limit, an epoch bump or its grant's removal (a deleted grant file).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import TYPE_CHECKING

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
    Readiness,
    ReleaseDevices,
)
from slurm_fiber.core.trust.grant import ScopeClaim, VerifiedToken
from slurm_fiber.homes.cgroupdelegate import Placement, resolve_cgroup_root
from slurm_fiber.homes.grantdir import GrantDir
from slurm_fiber.homes.healthpoll import error_message
from slurm_fiber.homes.problem import ProblemSink, log_problem
from slurm_fiber.homes.readyfile import write_ready_file
from slurm_fiber.homes.readygate import ReadyGate
from slurm_fiber.homes.sdnotify import notify_socket_from_env, sd_notify

if TYPE_CHECKING:
    from slurm_fiber.config import FiberdConfig

NAME = "standalone"
log = logging.getLogger("slurm_fiber.homes.standalone")


def notify_message(warm: list[str]) -> str:
    """The sd_notify datagram for a readiness state: READY=1 only when a template is warm."""
    if not warm:
        return "STATUS=not ready: no grant template is warm"
    return f"READY=1\nSTATUS=ready: {len(warm)} warm grant template(s): {', '.join(warm)}"


def _release_nothing() -> None:
    """Static devices are never claimed, so there is nothing to release."""


class StandaloneHome(Home, GrantSource, Liveness, Readiness, DeviceSource, CgroupRoot):
    """The ``Home`` of a plain host. Build one per fiberd; use it on one event loop.

    ``grantdir`` is polled every ``poll_interval`` seconds of ``clock``.
    ``devices`` is the host's static device set. ``ready_file`` (None: no
    file) and ``notify_socket`` (default: ``NOTIFY_SOCKET`` from the
    environment; None: no notification) receive readiness. ``cgroup`` is the
    ``cgroup_root`` setting: a path, ``"delegate"`` or None.
    """

    def __init__(
        self,
        grantdir: str,
        clock: Clock,
        *,
        poll_interval: float = 1.0,
        stale_after: float = 60.0,
        devices: Iterable[Device] = (),
        ready_file: str | None = None,
        notify_socket: str | None = None,
        cgroup: str | None = None,
        on_problem: ProblemSink = log_problem,
    ) -> None:
        self._clock = clock
        self._health = SourceHealth(clock, stale_after, control_plane=False)
        self._grantdir = GrantDir(grantdir, clock, poll_interval, on_problem=on_problem,
                                  health=self._health)
        self._devices = DeviceChannel.of(devices)
        self._ready_file = ready_file
        self._notify_socket = notify_socket
        self._cgroup_setting = cgroup
        self._placement: Placement | None = None
        self._gate = ReadyGate(self._publish)

    @classmethod
    def from_config(
        cls, config: FiberdConfig, clock: Clock, *, on_problem: ProblemSink = log_problem,
        environ: Mapping[str, str] | None = None,
    ) -> StandaloneHome:
        """The home fiberd's configuration describes; NOTIFY_SOCKET is read from ``environ``
        (default: this process's environment)."""
        return cls(
            config.grantdir,
            clock,
            poll_interval=config.poll_interval,
            stale_after=config.stale_ttl,
            devices=config.devices,
            ready_file=config.ready_file,
            notify_socket=notify_socket_from_env(environ),
            cgroup=config.cgroup_root,
            on_problem=on_problem,
        )

    def name(self) -> str:
        """Always "standalone"."""
        return NAME

    async def grants(self) -> AsyncIterator[GrantEvent]:
        """The grantdir's deliveries; raises GrantDirRefused when the directory is refused.

        A missing grantdir is waited for (health stale meanwhile, see grantdir).
        """
        return self._grantdir.deliveries()

    def health(self) -> SourceHealth:
        """Fresh (no control plane to fall silent) unless the grantdir is down."""
        return self._health

    def cgroup_root(self) -> str | None:
        """The subtree fiberd may carve, resolved on the first call; None when there is none.

        With ``"delegate"`` the first call moves this process into a leaf
        cgroup (see cgroupdelegate). ``cgroup_reason()`` says why the answer
        is what it is. Never raises.
        """
        return self.placement().root

    def cgroup_reason(self) -> str:
        """One line on where the cgroup root came from, or why there is none."""
        return self.placement().reason

    def placement(self) -> Placement:
        """The resolved cgroup placement (resolving it on first use). Never raises."""
        if self._placement is None:
            self._placement = resolve_cgroup_root(self._cgroup_setting)
        return self._placement

    async def publish_ready(self, grant_uid: str, ready: bool) -> None:
        """Record a template's readiness; on a flip, write the file and notify systemd.

        Raises the publish error (an unwritable file, a dead notify socket);
        ``run`` sends the state again until it succeeds.
        """
        await self._gate.publish_ready(grant_uid, ready)

    def ready(self) -> bool:
        """Whether any grant's template is warm."""
        return self._gate.ready()

    def scope(self) -> list[ScopeClaim]:
        """Empty: a plain host asserts nothing about where it runs."""
        return []

    async def devices(self, grant: VerifiedToken) -> tuple[DeviceChannel, ReleaseDevices]:
        """The static devices of the kinds the grant names; release does nothing.

        Static devices are not claimed (no lease, no allocation), so two
        grants naming the same kind share them. Never raises.
        """
        return self._devices.narrowed(grant.spec.devices), _release_nothing

    async def run(self) -> None:
        """Republish readiness every poll interval until it is accepted; runs until cancelled.

        Each distinct publish failure, and the recovery, is logged once.
        """
        while True:
            await self._clock.sleep(self._grantdir.interval)
            changed, err = await self._gate.republish()
            if not changed:
                continue
            if err is None:
                log.info("readiness published again")
            else:
                log.warning("readiness not published: %s", error_message(err))

    def close(self) -> list[str]:
        """Undo cgroup delegation (move back, remove created dirs). Call it last at shutdown.

        Never raises; returns one line per step that failed. Idempotent.
        """
        placement = self._placement
        if placement is None or placement.delegation is None:
            return []
        return placement.delegation.undo()

    async def _publish(self, warm: list[str]) -> None:
        """ReadyGate's publish: the file first, then systemd. Raises the first failure."""
        if self._ready_file is not None:
            await asyncio.to_thread(write_ready_file, self._ready_file, warm, self._clock.wall())
        if self._notify_socket is not None:
            sd_notify(notify_message(warm), self._notify_socket)
