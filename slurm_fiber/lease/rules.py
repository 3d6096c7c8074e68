"""The claim rules: pure functions of the state document, a Gate and a time.

While a supervisor is recorded, a free lease is not permission: a session
claims only what the supervisor granted it, in the order the grants were
given, from the supervisor's start to a deliberate stop, whether its session
runs or has crashed. While an upgrade runs on the installation of the
resource's name only an upgrade-unblock grant admits a claim, in grant order.
A grant waits while its resource is held; once the resource is free its TTL
runs from the later of the grant and the last release. Nothing here reads a
clock or a file: callers pass ``now`` (Unix seconds) and what they observed.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from slurm_fiber.lease.state import Grant, Party, State, Supervisor, Upgrade
from slurm_fiber.lease.times import to_rfc3339


class Refusal(Exception):
    """Why a claim is not allowed; ``str()`` is one line.

    A claim queued behind earlier grants carries its place: ``position``
    (from 1) and ``ahead``, the grantee who claims first. Other refusals have
    position 0 and name in ``ahead`` the first pending grantee, if any.
    """

    def __init__(self, reason: str, position: int = 0, ahead: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.position = position
        self.ahead = ahead

    def __str__(self) -> str:
        return self.reason


@dataclass(frozen=True)
class Gate:
    """What a claim is checked against.

    ``supervisor`` is the recorded one (None when none is). ``restart_until``
    is set while the supervisor's process may still come back as a restart;
    ``gone`` once it stayed away longer: claims then wait for its successor.
    ``held`` is whether the resource is held right now, by anyone.
    """

    resource: str
    caller: Party
    supervisor: Supervisor | None
    now: float
    ttl: float
    held: bool = False
    restart_until: float | None = None
    gone: bool = False


def _expired(st: State, grant: Grant, held: bool, now: float, ttl: float) -> bool:
    if held:
        return False
    start = max(grant.at, st.released.get(grant.resource, grant.at))
    return now - start > ttl


def _queue(st: State, resource: str, held: bool, now: float, ttl: float) -> list[tuple[int, Grant]]:
    return [
        (i, g)
        for i, g in enumerate(st.grants)
        if g.resource == resource and not _expired(st, g, held, now, ttl)
    ]


def pending(st: State, resource: str, held: bool, now: float, ttl: float) -> list[Grant]:
    """The grants of ``resource`` still claimable at ``now``, in the order given."""
    return [g for _, g in _queue(st, resource, held, now, ttl)]


def prune(st: State, held: Collection[str], now: float, ttl: float) -> list[Grant]:
    """Drop from ``st`` the grants whose time ran out; return the dropped ones.

    ``held`` names the resources held right now: their grants wait without
    expiring.
    """
    dropped = [g for g in st.grants if _expired(st, g, g.resource in held, now, ttl)]
    st.grants = [g for g in st.grants if g not in dropped]
    return dropped


def check(st: State, gate: Gate) -> int:
    """Decide whether ``gate.caller`` may claim ``gate.resource``.

    Returns the index in ``st.grants`` of the grant that carries the claim
    (the caller consumes it), or -1 when no grant is needed (no supervisor,
    the supervisor itself, or a person without a session). Raises Refusal.
    """
    upgrade = st.upgrade_of(gate.resource, gate.now)
    queue = _queue(st, gate.resource, gate.held, gate.now, gate.ttl)
    if upgrade is not None:
        return _check_unblock(gate, upgrade, [(i, g) for i, g in queue if g.upgrade_unblock])
    sup = gate.supervisor
    if sup is None or gate.caller.same_as(sup.party) or not gate.caller.session:
        return -1
    index = _place(gate, queue, f"{gate.resource} is granted to")
    if index >= 0:
        return index
    ahead = queue[0][1].to.display() if queue else ""
    who = f"supervisor {sup.party.display()}"
    ask = f"ask for `slurm-fiber lease allot {gate.resource} --to {gate.caller.session}`"
    if gate.gone:
        reason = f"{who} is gone: a free lease is not a grant until its successor starts; {ask}"
    elif gate.restart_until is not None:
        until = to_rfc3339(gate.restart_until)
        reason = f"{who} is restarting (until {until}): a free lease is not a grant; {ask}"
    else:
        reason = f"{who} runs: a free lease is not a grant; {ask}"
    raise Refusal(reason, 0, ahead)


def _place(gate: Gate, queue: list[tuple[int, Grant]], granted_to: str) -> int:
    """The caller's grant index when it is first in ``queue``; Refusal when behind; else -1."""
    for pos, (index, grant) in enumerate(queue):
        if not grant.to.same_as(gate.caller):
            continue
        if pos > 0:
            ahead = queue[0][1].to.display()
            raise Refusal(
                f"{granted_to} {ahead} first; you are number {pos + 1} in its queue", pos + 1, ahead
            )
        return index
    return -1


def _check_unblock(gate: Gate, upgrade: Upgrade, queue: list[tuple[int, Grant]]) -> int:
    """During ``upgrade`` only the caller's upgrade-unblock grant, first in line, admits."""
    label = f"upgrade {upgrade.reason!r} runs on {gate.resource}: its unblock is granted to"
    index = _place(gate, queue, label)
    if index >= 0:
        return index
    ahead = queue[0][1].to.display() if queue else ""
    raise Refusal(
        f"upgrade {upgrade.reason!r} runs on {gate.resource} since {to_rfc3339(upgrade.at)}: "
        "claim after it ends; only work that unblocks it is admitted, by a grant with "
        "--upgrade-unblock",
        0,
        ahead,
    )


def watch_supervisor(sup: Supervisor, alive: bool, now: float, grace: float) -> None:
    """Update ``sup`` with what was seen of its process at ``now``.

    Alive clears any restart window. Seen gone, it gets ``grace`` seconds to
    come back (``restart_until``); still gone after that, it is ``gone`` and
    claims wait for a successor. The record stays until a deliberate stop.
    """
    if alive:
        sup.restart_until, sup.gone = None, False
    elif sup.restart_until is None and not sup.gone:
        sup.restart_until = now + grace
    elif sup.restart_until is not None and now >= sup.restart_until:
        sup.restart_until, sup.gone = None, True


def gate_for(
    st: State, resource: str, caller: Party, held: bool, now: float, ttl: float
) -> Gate:
    """The Gate for a claim against ``st`` as recorded (supervisor window included)."""
    sup = st.supervisor
    return Gate(
        resource=resource,
        caller=caller,
        supervisor=sup,
        now=now,
        ttl=ttl,
        held=held,
        restart_until=None if sup is None else sup.restart_until,
        gone=sup is not None and sup.gone,
    )
