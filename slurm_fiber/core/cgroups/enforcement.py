"""Which of a grant's limits are enforced, by what, and how its devices are confined.

A grant's limits are kept by different parts of the system: ``memory``,
``pids`` and ``cpu`` by the kernel through the grant's cgroup, and only
where that controller is enabled for the carving root (v2: "cgroup v2") or
has a cgroup v1 hierarchy ("cgroup v1 memory", "cgroup v1 pids", "cgroup v1
cpu": the outcome's own ``backend``); ``fibers`` (concurrent fibers) and
``seconds`` (each fiber's wall time) by fiberd itself (the book's
``capacity`` miss and the fiber's deadline). Devices are confined by a v1
device cgroup where the host has one ("cgroup v1 devices": deny all, allow
the grant's own nodes and the pseudo-devices), else by visibility variables
only ("env only": ``devices.DeviceChannel.env``), where nothing keeps a
fiber from opening another device node it has permission for.

``Enforcement`` is the per-grant record of that: for each of the five
limits the value asked for, what enforces it or, when it is asked for and
nothing does, why not; and how devices are confined. status, list_grants
and the admit audit record carry it (``to_json``), and ``--strict-limits``
refuses a grant whose record has an unenforced limit. It never claims
more than is done: a limit is "enforced" only once its cgroup file was
written (or, before carving, when its controller is enabled). A backend
that enforces more (a cgroup v1 backend, a device cgroup) fills the same
record with its own names.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from slurm_fiber.core.cgroups.common import CONTROLLERS, LimitOutcome
from slurm_fiber.core.cgroups.devices import DeviceRule
from slurm_fiber.core.trust.grant import Limits

LIMITS: tuple[str, ...] = ("memory", "pids", "cpu", "seconds", "fibers")
BY_FIBERD = "fiberd"
DEVICES_ENV_ONLY = "env only"
DEVICES_CGROUP = "cgroup v1 devices"
HOST_DEVICES_REASON = ("each grant's device cgroup denies all devices ('devices.deny a') but "
                       "its own nodes and the pseudo-devices (null, zero, full, random, "
                       "urandom, tty, ptmx, pts)")
ENV_ONLY_REASON = ("devices are named to the fiber by visibility variables only; no device "
                   "cgroup keeps it from opening other device nodes it has permission for")
_NOT_ENFORCED = "not enforced: "


@dataclass(frozen=True)
class LimitEnforcement:
    """One limit: the value asked for (None: not set), what enforces it (None: nothing),
    and why not when it is asked for and nothing does."""

    limit: str
    asked: float | None
    by: str | None
    reason: str = ""

    @property
    def unenforced(self) -> bool:
        """Asked for, and nothing enforces it."""
        return self.asked is not None and self.by is None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"asked": self.asked, "enforced_by": self.by}
        if self.unenforced:
            out["not_enforced"] = self.reason
        return out


@dataclass(frozen=True)
class DeviceConfinement:
    """How a grant's devices are kept to it: "cgroup" or "env only", and what that means."""

    by: str
    reason: str

    def to_json(self) -> dict[str, object]:
        return {"confined_by": self.by, "reason": self.reason}


ENV_ONLY = DeviceConfinement(DEVICES_ENV_ONLY, ENV_ONLY_REASON)


def device_confinement(rule: DeviceRule | None) -> DeviceConfinement:
    """A carved grant's confinement: its v1 device rule's when it holds, else env only
    (with why the rule does not hold)."""
    if rule is None:
        return ENV_ONLY
    if rule.confined:
        return DeviceConfinement(DEVICES_CGROUP, rule.reason)
    return DeviceConfinement(DEVICES_ENV_ONLY, f"{ENV_ONLY_REASON} ({rule.reason})")


def host_devices(confines: bool) -> DeviceConfinement:
    """What a grant's devices get here: a v1 device cgroup (``confines``) or env only."""
    return DeviceConfinement(DEVICES_CGROUP, HOST_DEVICES_REASON) if confines else ENV_ONLY


@dataclass(frozen=True)
class Enforcement:
    """A grant's enforcement record: one entry per limit in ``LIMITS`` order, and devices."""

    limits: tuple[LimitEnforcement, ...]
    devices: DeviceConfinement = ENV_ONLY

    def outcome(self) -> tuple[tuple[str, str | None], ...]:
        """(limit, enforced by) per limit: what two records must share to say the same."""
        return tuple((e.limit, e.by) for e in self.limits)

    def unenforced(self) -> list[LimitEnforcement]:
        """The limits asked for that nothing enforces."""
        return [entry for entry in self.limits if entry.unenforced]

    def refusal(self, uid: str) -> str | None:
        """The one-line reason to refuse ``uid`` under strict limits; None when all are kept."""
        missing = self.unenforced()
        if not missing:
            return None
        names = ", ".join(entry.limit for entry in missing)
        return (f"grant {uid!r} asks for limits fiberd cannot enforce here ({names}): "
                f"{missing[0].reason}")

    def summary(self) -> str:
        """One short line for people: what is enforced by what, what is not, and devices."""
        kept = [f"{e.limit} ({e.by})" for e in self.limits if e.asked is not None and e.by]
        parts = [f"enforced: {', '.join(kept)}"] if kept else []
        missing = self.unenforced()
        if missing:
            parts.append(f"NOT enforced: {', '.join(e.limit for e in missing)}")
        if not kept and not missing:
            parts.append("no limits asked")
        parts.append(f"devices: {self.devices.by}")
        return "; ".join(parts)

    def to_json(self) -> dict[str, object]:
        return {"limits": {e.limit: e.to_json() for e in self.limits},
                "unenforced": [e.limit for e in self.unenforced()],
                "devices": self.devices.to_json()}


def asked(limits: Limits) -> dict[str, float | None]:
    """The value each of ``LIMITS`` asks for (None: not set)."""
    return {name: getattr(limits, name) for name in LIMITS}


def grant_enforcement(limits: Limits, outcomes: Sequence[LimitOutcome] | None, *,
                      backend: str, uncarved_reason: str,
                      devices: DeviceConfinement = ENV_ONLY) -> Enforcement:
    """The record of a grant with ``limits`` whose cgroup limits fared as ``outcomes``.

    ``outcomes`` is what ``CgroupManager.carve_grant`` wrote (or ``predict``
    expects), None when fiberd runs uncarved (then every cgroup limit asked
    for is "not enforced" with ``uncarved_reason``). ``backend`` names what
    enforces a written limit. Pure.
    """
    by_limit = {o.limit: o for o in outcomes or ()}
    entries: list[LimitEnforcement] = []
    for name, value in asked(limits).items():
        if value is None:
            entries.append(LimitEnforcement(name, None, None))
        elif name not in CONTROLLERS:
            entries.append(LimitEnforcement(name, value, BY_FIBERD))
        elif outcomes is None:
            entries.append(LimitEnforcement(name, value, None, uncarved_reason))
        else:
            outcome = by_limit.get(name)
            if outcome is not None and outcome.enforced:
                entries.append(LimitEnforcement(name, value, outcome.backend or backend))
            else:
                why = outcome.reason if outcome is not None else "no cgroup file keeps it"
                entries.append(LimitEnforcement(name, value, None, _strip(why)))
    return Enforcement(tuple(entries), devices)


def host_enforcement(outcomes: Iterable[LimitOutcome] | None, *, backend: str,
                     uncarved_reason: str, devices: DeviceConfinement = ENV_ONLY
                     ) -> Enforcement:
    """What a grant asking for every limit would get here (``outcomes``: the cgroup
    manager's prediction for such a grant, None when uncarved); ``asked`` is 1 for each."""
    every = Limits(fibers=1, memory=1, pids=1, cpu=1.0, seconds=1.0)
    return grant_enforcement(every, None if outcomes is None else tuple(outcomes),
                             backend=backend, uncarved_reason=uncarved_reason,
                             devices=devices)


def _strip(reason: str) -> str:
    return reason[len(_NOT_ENFORCED):] if reason.startswith(_NOT_ENFORCED) else reason


__all__ = [
    "BY_FIBERD", "DEVICES_CGROUP", "DEVICES_ENV_ONLY", "ENV_ONLY", "LIMITS", "DeviceConfinement",
    "Enforcement", "LimitEnforcement", "asked", "device_confinement", "grant_enforcement",
    "host_devices", "host_enforcement",
]
