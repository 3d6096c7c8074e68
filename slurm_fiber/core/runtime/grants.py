"""The admitted grants' processes and resources: devices, a grant cgroup and a warm template each.

``Grants`` provisions a grant the book admitted (its devices from the home, its cgroup
carved off the loop, a warming template), replaces its template when a renewal changes
the grant (the old one stops once its fibers have ended), publishes its readiness on
every flip between warm and not warm, and retires it (fibers and templates stopped,
devices released, cgroup removed) on its own shielded task, so a cancelled caller
leaves no template behind and ``wait_retiring`` sees it through. It keeps each grant's
enforcement record: what is expected before carving (``expected``), what carving wrote,
audited when the two differ, and under strict limits the ``unenforceable`` refusal.
One admission or retirement per grant at a time (``lock``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from slurm_fiber.core.api.service import JsonMap
from slurm_fiber.core.audit.log import AuditEvent
from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.cgroups.common import GrantCgroup
from slurm_fiber.core.cgroups.enforcement import (
    Enforcement,
    device_confinement,
    grant_enforcement,
    host_devices,
    host_enforcement,
)
from slurm_fiber.core.devices import DeviceChannel
from slurm_fiber.core.runtime.shared import Parts
from slurm_fiber.core.runtime.trail import AdmitRefused, AuditTrail
from slurm_fiber.core.seam import ReleaseDevices
from slurm_fiber.core.templates.parent import Template, TemplateState, template_env
from slurm_fiber.core.trust.grant import FiberSpec, Limits, VerifiedToken

log = logging.getLogger("slurm_fiber.core.runtime.grants")


@dataclass(eq=False)
class Grant:
    """One admitted grant's processes and resources."""

    uid: str
    spec: FiberSpec
    template: Template
    channel: DeviceChannel
    release: ReleaseDevices
    cgroup: GrantCgroup | None
    enforcement: Enforcement
    watcher: asyncio.Task[None] | None = None
    retired: list[Template] = field(default_factory=list)


class Grants:
    """The provisioned grants of one fiberd, by UID (see the module doc)."""

    def __init__(self, parts: Parts, trail: AuditTrail) -> None:
        self.parts = parts
        self.trail = trail
        self._grants: dict[str, Grant] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._retiring: set[asyncio.Future[None]] = set()  # grants being stopped
        self.unenforceable: dict[str, Miss] = {}  # strict limits: UIDs refused, not admitted

    def get(self, uid: str) -> Grant | None:
        return self._grants.get(uid)

    def __contains__(self, uid: str) -> bool:
        return uid in self._grants

    def __iter__(self) -> Iterator[Grant]:
        return iter(list(self._grants.values()))

    def uids(self) -> list[str]:
        return list(self._grants)

    def lock(self, uid: str) -> asyncio.Lock:
        return self._locks.setdefault(uid, asyncio.Lock())

    @property
    def stopping(self) -> int:
        """How many grants are being stopped now."""
        return len(self._retiring)

    # ------------------------------------------------------------ enforcement records

    def uncarved_reason(self) -> str:
        return f"no cgroup to enforce it in: {self.parts.cgroups.status.cause}"

    def expected(self, limits: Limits) -> Enforcement:
        """The enforcement record a grant with ``limits`` would get here (before carving)."""
        cgroups = self.parts.cgroups
        return grant_enforcement(limits, cgroups.predict(limits), backend=cgroups.backend,
                                 uncarved_reason=self.uncarved_reason(),
                                 devices=host_devices(cgroups.confines_devices))

    def _carved(self, cgroup: GrantCgroup | None, limits: Limits) -> Enforcement:
        """The enforcement record of a carved (or, None, uncarved) grant cgroup."""
        written, rule = (None, None) if cgroup is None else (cgroup.limits, cgroup.devices)
        return grant_enforcement(limits, written, backend=self.parts.cgroups.backend,
                                 uncarved_reason=self.uncarved_reason(),
                                 devices=device_confinement(rule))

    def _enforced(self, uid: str, cgroup: GrantCgroup | None, limits: Limits) -> Enforcement:
        """The record of what carving wrote; audited (``enforcement``) when it differs from
        what was expected at admission (a limit write the kernel refused)."""
        record = self._carved(cgroup, limits)
        if record.outcome() != self.expected(limits).outcome():
            self.trail.write(AuditEvent.ENFORCEMENT, uid=uid, enforcement=record.to_json())
        return record

    def refuse_unenforceable(self, vt: VerifiedToken, record: Enforcement) -> None:
        """Under strict limits: raise the audited ``unenforceable`` refusal when ``record``
        leaves a limit unenforced, and remember it for Clones naming the UID."""
        reason = record.refusal(vt.uid)
        if reason is None:
            return
        miss = Miss(MissCode.UNENFORCEABLE, reason,
                    detail=",".join(e.limit for e in record.unenforced()))
        self.unenforceable[vt.uid] = miss
        raise self.trail.refuse(vt, miss, enforcement=record.to_json())

    def enforcement_status(self) -> JsonMap:
        """What is enforced here: ``strict_limits``; ``host``, what a grant asking for every
        limit would get (no ``asked`` values); ``grants``, each provisioned grant's record."""
        cgroups = self.parts.cgroups
        host = host_enforcement(cgroups.predict(Limits(memory=1, pids=1, cpu=1.0)),
                                backend=cgroups.backend,
                                uncarved_reason=self.uncarved_reason(),
                                devices=host_devices(cgroups.confines_devices)).to_json()
        limits = host["limits"]
        assert isinstance(limits, dict)
        host["limits"] = {name: {k: v for k, v in entry.items() if k != "asked"}
                          for name, entry in limits.items()}
        return {"strict_limits": self.parts.settings.strict_limits, "host": host,
                "grants": {uid: g.enforcement.to_json() for uid, g in self._grants.items()}}

    # ------------------------------------------------------------ in

    async def provision(self, vt: VerifiedToken, spec: FiberSpec) -> None:
        """Devices, cgroup and a warming template for a newly admitted grant."""
        parts = self.parts
        try:
            channel, release = await parts.home.device_source.devices(vt)
        except Exception as err:
            raise self.trail.refuse(vt, Miss(MissCode.WARM_FAILED,
                                             f"devices for {vt.uid!r} refused: {err}",
                                             detail="devices_refused")) from None
        try:
            # Off the loop: its mkdirs wait on the kernel's cgroup lock, which templates
            # warming meanwhile (joining their cgroups) hold.
            cgroup = await asyncio.to_thread(parts.cgroups.carve_grant, vt.uid, spec.limits,
                                             channel.devices)
            enforcement = self._enforced(vt.uid, cgroup, spec.limits)
            if parts.settings.strict_limits:
                self.refuse_unenforceable(vt, enforcement)
            template = await self._start_template(vt.uid, spec, channel, cgroup)
        except (OSError, AdmitRefused) as err:
            await asyncio.to_thread(release)
            if isinstance(err, AdmitRefused):
                if vt.uid not in self._grants:  # nothing of the grant runs in it
                    with contextlib.suppress(OSError):
                        await parts.cgroups.remove_grant(vt.uid)
                raise
            raise self.trail.refuse(vt, Miss(MissCode.WARM_FAILED,
                                             f"cannot start the template of {vt.uid!r}: {err}",
                                             detail="template_start")) from None
        grant = Grant(vt.uid, spec, template, channel, release, cgroup, enforcement)
        self._grants[vt.uid] = grant
        grant.watcher = parts.spawn(self._watch(grant))

    async def _start_template(self, uid: str, spec: FiberSpec, channel: DeviceChannel,
                              cgroup: GrantCgroup | None) -> Template:
        settings = self.parts.settings
        env = template_env(os.environ, spec.template, channel)
        return await Template.start(uid, spec.template, env, cgroup,
                                    state_dir=settings.state_dir, clock=self.parts.clock,
                                    python=settings.python, spares=settings.spares,
                                    timeout=settings.template_timeout, spares_once_cloned=True,
                                    spares_idle=settings.spares_idle,
                                    identity=settings.identity)

    async def replace_template(self, grant: Grant, spec: FiberSpec) -> None:
        """A renewal changed the grant: write its limits again, warm a new template; the
        old one stops once its fibers have ended."""
        if grant.cgroup is not None and spec.limits != grant.spec.limits:
            grant.cgroup = await asyncio.to_thread(self.parts.cgroups.carve_grant, grant.uid,
                                                   spec.limits, grant.channel.devices)
        grant.enforcement = self._carved(grant.cgroup, spec.limits)
        old = grant.template
        grant.template = await self._start_template(grant.uid, spec, grant.channel,
                                                    grant.cgroup)
        grant.spec = spec
        grant.retired.append(old)
        if grant.watcher is not None:
            grant.watcher.cancel()
        grant.watcher = self.parts.spawn(self._watch(grant))
        self.parts.spawn(self._drain(grant, old))

    async def _drain(self, grant: Grant, old: Template) -> None:
        while old.fibers:
            await asyncio.gather(*(f.wait() for f in list(old.fibers.values())))
        await old.stop(self.parts.settings.grace)
        with contextlib.suppress(ValueError):
            grant.retired.remove(old)

    async def _watch(self, grant: Grant) -> None:
        """Publish readiness on every flip of the template between warm and not warm;
        audit a failed warm, and a template given up on (``template_lost``: it died or
        stopped answering, and is re-warmed)."""
        template, state, published = grant.template, grant.template.state, False
        while state is not TemplateState.STOPPED:
            warm = state is TemplateState.READY
            if state is TemplateState.WARM_FAILED and template.warm_error is not None:
                self.trail.write(AuditEvent.WARM_FAILED, uid=grant.uid,
                                 error=template.warm_error.error,
                                 reason=template.warm_error.message)
            if state is TemplateState.REWARMING:
                with contextlib.suppress(OSError):
                    self.trail.write(AuditEvent.TEMPLATE_LOST, uid=grant.uid, pid=template.pid,
                                     reason=template.last_fault, restarts=template.restarts)
            if warm != published:
                await self._publish(grant.uid, warm)
                published = warm
            state = await template.wait_change(state)

    async def _publish(self, uid: str, ready: bool) -> None:
        try:
            await self.parts.home.readiness.publish_ready(uid, ready)
        except Exception as err:  # the home republishes; say it once here
            log.warning("readiness of %s not published: %s", uid, err)

    # ------------------------------------------------------------ out

    async def retire(self, uid: str, cause: str) -> None:
        """Close its task windows, stop a grant's fibers and template, release its devices,
        remove its cgroup.

        The stopping runs on its own task, shielded: a caller cancelled
        midway (drive, at shutdown) leaves it running, and ``wait_retiring``
        waits for it, so no template outlives fiberd.
        """
        async with self.lock(uid):
            grant = self._grants.pop(uid, None)
            if grant is None:
                return
            if grant.watcher is not None:
                grant.watcher.cancel()
            await asyncio.gather(*(w.close(cause) for w in list(self.parts.windows.values())
                                   if w.uid == uid))
            self.trail.note_releases(list(grant.template.fibers.values()), cause)
            stopping = asyncio.ensure_future(self._stop_grant(grant))
            self._retiring.add(stopping)
            stopping.add_done_callback(self._retiring.discard)
            await asyncio.shield(stopping)

    async def wait_retiring(self) -> None:
        """Return once every grant being stopped is gone."""
        await asyncio.gather(*list(self._retiring), return_exceptions=True)

    async def _stop_grant(self, grant: Grant) -> None:
        grace = self.parts.settings.grace
        await asyncio.gather(grant.template.stop(grace),
                             *(t.stop(grace) for t in grant.retired))
        await asyncio.to_thread(grant.release)
        try:
            await self.parts.cgroups.remove_grant(grant.uid)
        except OSError as err:
            log.warning("cgroup of %s not removed: %s", grant.uid, err)
        await self._publish(grant.uid, False)

    # ------------------------------------------------------------ reports

    def list_grants(self) -> Sequence[JsonMap]:
        """Every grant the book holds, with its template, fibers, devices and enforcement."""
        out = []
        for view in self.parts.book.grants():
            grant = self._grants.get(view.uid)
            out.append({
                "uid": view.uid, "issuer": view.issuer, "jtis": list(view.jtis),
                "lease_end": view.lease_end.wall, "expired": view.expired,
                "template": grant.template.to_json() if grant else None,
                "fibers": len(grant.template.fibers) if grant else 0,
                "devices": grant.channel.to_json() if grant else [],
                "limits": _limits_json(view.spec),
                "enforcement": grant.enforcement.to_json() if grant else None,
            })
        return out

    def templates(self) -> dict[str, str]:
        """Each grant's template state."""
        return {uid: g.template.state.value for uid, g in self._grants.items()}

    def any_ready(self) -> bool:
        return any(g.template.state is TemplateState.READY for g in self._grants.values())


def _limits_json(spec: FiberSpec) -> dict[str, object]:
    limits = spec.limits
    return {k: v for k, v in (("fibers", limits.fibers), ("memory", limits.memory),
                              ("pids", limits.pids), ("cpu", limits.cpu),
                              ("seconds", limits.seconds)) if v is not None}
