"""Leases: the claim/release/grant flow over one lease dir and one state document.

This is the API other code calls (the ``lease`` commands, and on a Slurm
node the prolog and epilog, as root): the prolog, acting for the
supervisor, ``grant``s a job's devices to the job's party in allocation
order and ``claim``s each in the job's name; the epilog ``release``s them
and ``revoke``s what was never claimed (homes/slurm/leases; the job's
fiberd only reads). Files are reached through lease.files (no link
followed, no FIFO blocking). Every operation that reads the rules holds the
state document's lock for its whole read-decide-write, so two claimers can
never both use one grant; the lease directory itself (mkdir) guarantees one
holder even against a plain shell lock that takes no state lock. Time comes
from the injected Clock. Errors: Refusal for a claim the rules or the
current holder refuse, LeaseError for bad input or failed I/O; both one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from slurm_fiber.core.clock import Clock
from slurm_fiber.lease.dirlease import Dir
from slurm_fiber.lease.errors import LeaseError
from slurm_fiber.lease.files import Owners
from slurm_fiber.lease.holder import Holder, ProcessRef, compose_session
from slurm_fiber.lease.names import check_purpose, check_resource
from slurm_fiber.lease.rules import Refusal, check, gate_for, pending, prune, watch_supervisor
from slurm_fiber.lease.stale import append_audit, gone_reason, holder_gone_reason
from slurm_fiber.lease.state import Grant, Party, State, Supervisor, Upgrade, load, update
from slurm_fiber.lease.times import to_rfc3339

DEFAULT_TTL = 600.0
DEFAULT_RESTART_GRACE = 120.0


@dataclass(frozen=True)
class Caller:
    """Who acts: the party, a display name, and the process that holds what it claims.

    ``process`` is what makes a holder provably gone later; None for a
    caller with no process to watch (its leases are never stale).
    """

    party: Party
    name: str = ""
    host_session: str = ""
    process: ProcessRef | None = None


class Leases:
    """The lease dir ``lease_dir`` governed by the state document ``state_path``.

    ``ttl`` is how long a grant stays claimable once its resource is free;
    ``restart_grace`` how long a vanished supervisor process may come back
    before claims wait for a successor. ``host`` is this machine's name
    (stale holders are proved only on it). ``owners`` (None: a cooperative
    area) are the uids whose lease entries, state, lock and audit files are
    trusted, root's always (lease.files). Methods block on the state lock.
    """

    def __init__(
        self,
        lease_dir: str | os.PathLike[str],
        state_path: str | os.PathLike[str],
        clock: Clock,
        ttl: float = DEFAULT_TTL,
        restart_grace: float = DEFAULT_RESTART_GRACE,
        host: str | None = None,
        owners: Owners = None,
    ) -> None:
        self.dir = Dir(lease_dir, owners)
        self.owners = self.dir.owners
        self.state_path = Path(state_path)
        self.clock = clock
        self.ttl = ttl
        self.restart_grace = restart_grace
        self.host = host or os.uname().nodename  # gethostname(), without importing socket

    def claim(
        self,
        resource: str,
        caller: Caller,
        purpose: str,
        budget_gib: int = 0,
        steal_stale: bool = False,
        grant_by: Caller | None = None,
    ) -> Holder:
        """Claim ``resource`` for ``caller``; return the holder record now on disk.

        Claiming what the caller already holds returns its record unchanged.
        With ``steal_stale`` a holder whose process is provably gone is
        removed first and the reclaim audited. With ``grant_by`` (the
        recorded supervisor, as in ``grant``) the resource is first granted
        to the caller's party, unless a grant to it is pending, in the same
        locked step; a refused claim leaves that grant queued. Raises
        Refusal (not granted, queued behind others, upgrade running, held by
        someone else) or LeaseError.
        """
        outcome = self.claim_each([resource], caller, purpose, budget_gib, steal_stale, grant_by)[0]
        if isinstance(outcome, Refusal):
            raise outcome
        return outcome

    def claim_each(
        self,
        resources: list[str],
        caller: Caller,
        purpose: str,
        budget_gib: int = 0,
        steal_stale: bool = False,
        grant_by: Caller | None = None,
    ) -> list[Holder | Refusal]:
        """``claim`` of each of ``resources``, in order, under one lock and one state write.

        One outcome per resource: the holder record now on disk, or the
        Refusal of that claim (the others still go ahead). A Slurm prolog
        claims all of a job's GPUs this way, so the state document and its
        directory are flushed once per job, not once per GPU. Raises
        LeaseError (bad input, failed I/O), and then writes no state: a
        lease directory already made for an earlier resource stays the
        caller's, and a later claim of it returns it unchanged.
        """
        for resource in resources:
            check_resource(resource)
        check_purpose(purpose)
        if budget_gib < 0:
            raise LeaseError(f"budget must be 0 or more GiB, not {budget_gib}")
        outcomes: list[Holder | Refusal] = []
        with update(self.state_path, self.owners) as st:
            for resource in resources:
                try:
                    outcomes.append(self._claim_locked(st, resource, caller, purpose, budget_gib,
                                                       steal_stale, grant_by))
                except Refusal as err:
                    outcomes.append(err)
        return outcomes

    def _claim_locked(self, st: State, resource: str, caller: Caller, purpose: str,
                      budget_gib: int, steal_stale: bool, grant_by: Caller | None) -> Holder:
        """One claim inside ``update``: the holder now on disk; raises Refusal."""
        now = self.clock.wall()
        self._watch(st, now)
        current = self.dir.get(resource)
        if current is not None and steal_stale:
            current = self._steal(resource, current, caller, now)
        if current is not None and current.party().same_as(caller.party):
            return current
        if grant_by is not None:
            self._grant_once(st, resource, caller.party, grant_by, current is not None, now)
        gate = gate_for(st, resource, caller.party, current is not None, now, self.ttl)
        index = check(st, gate)
        mine = self._holder(resource, caller, purpose, budget_gib, now, st, index)
        taken = self.dir.claim(resource, mine) if current is None else current
        if taken is not None:
            raise _held(taken)
        if index >= 0:
            del st.grants[index]  # a refused claim leaves its grant queued
        return mine

    def release(self, resource: str, caller: Caller, force: bool = False) -> Holder | None:
        """Free ``resource``; return the holder it had (None when it was free).

        Only the holder's own party releases unless ``force`` (audited); a
        lease whose record is unreadable is released only with ``force``.
        Records the release time, from which the next grant's TTL runs.
        """
        with update(self.state_path, self.owners) as st:
            return self._release_locked(st, resource, caller, force)

    def release_each(self, resources: list[str],
                     caller: Caller) -> list[Holder | LeaseError | None]:
        """``release`` (not forced) of each of ``resources``, under one lock and one state write.

        One outcome per resource: the holder it had (None when it was free),
        or the LeaseError that left it held; the others still go ahead. A
        Slurm epilog releases all of a job's GPUs this way, so the state
        document and its directory are flushed once per job, not once per
        GPU. Raises LeaseError only when the state cannot be read or written.
        """
        outcomes: list[Holder | LeaseError | None] = []
        with update(self.state_path, self.owners) as st:
            for resource in resources:
                try:
                    outcomes.append(self._release_locked(st, resource, caller, False))
                except LeaseError as err:
                    outcomes.append(err)
        return outcomes

    def _release_locked(self, st: State, resource: str, caller: Caller,
                        force: bool) -> Holder | None:
        """One release inside ``update``: the holder it had; raises LeaseError."""
        try:
            current = self.dir.get(resource)
        except LeaseError:
            if not force:
                raise
            current = None
        mine = current is not None and current.party().same_as(caller.party)
        if not force and current is not None and not mine:
            raise LeaseError(
                f"{resource} is held by {current.holder}, not by you; "
                "--force releases it (audited)"
            )
        if force and not mine:
            self._audit("force-release", resource, caller, current, "released by force")
        self.dir.release(resource)
        st.released[resource] = self.clock.wall()
        return current

    def grant(self, resource: str, to: Party, by: Caller, upgrade_unblock: str = "") -> int:
        """As the recorded supervisor, queue a grant of ``resource`` to ``to``.

        Returns the grant's place in the resource's queue (from 1). Raises
        LeaseError when no supervisor is recorded, ``by`` is not it, or
        ``to`` names no session.
        """
        check_resource(resource)
        if not to.session:
            raise LeaseError("a grant goes to a session: name its session id")
        with update(self.state_path, self.owners) as st:
            self._require_supervisor(st, by)
            now = self.clock.wall()
            st.grants.append(Grant(resource, to, by.party, now, upgrade_unblock))
            held = self.dir.get(resource) is not None
            return len(pending(st, resource, held, now, self.ttl))

    def revoke(self, to: Party, by: Caller) -> list[Grant]:
        """As the supervisor, drop every grant to ``to`` (a job ended); return them."""
        with update(self.state_path, self.owners) as st:
            self._require_supervisor(st, by)
            dropped = [g for g in st.grants if g.to.same_as(to)]
            st.grants = [g for g in st.grants if not g.to.same_as(to)]
            return dropped

    def supervise_start(self, caller: Caller) -> Supervisor:
        """Record ``caller`` as the supervisor; its grants rule claims until it stops.

        A restart of the same party keeps its start time; a successor takes
        over (grants kept) only once the recorded supervisor is gone. Raises
        LeaseError while another supervisor runs.
        """
        with update(self.state_path, self.owners) as st:
            now = self.clock.wall()
            self._watch(st, now)
            old = st.supervisor
            if old is not None and not old.party.same_as(caller.party) and not old.gone:
                raise LeaseError(
                    f"supervisor {old.party.display()} runs since {to_rfc3339(old.since)}; "
                    "it must stop first, or be gone"
                )
            same = old is not None and old.party.same_as(caller.party)
            process = caller.process or ProcessRef(0, 0.0)
            st.supervisor = Supervisor(
                party=caller.party,
                since=old.since if same and old is not None else now,
                pid=process.pid,
                pid_start=process.start or 0.0,
            )
            return st.supervisor

    def supervise_stop(self, caller: Caller, force: bool = False) -> Supervisor | None:
        """Deliberately end supervision; return the stopped record (None when none ran).

        Only the supervisor's own party stops it unless ``force`` (audited).
        """
        with update(self.state_path, self.owners) as st:
            old = st.supervisor
            if old is not None and not old.party.same_as(caller.party):
                if not force:
                    raise LeaseError(
                        f"supervisor is {old.party.display()}, not you; --force stops it (audited)"
                    )
                self._audit("force-stop-supervisor", "", caller, None, old.party.display())
            st.supervisor = None
            return old

    def upgrade_start(
        self, installation: str, reason: str, by: Caller, until: float | None = None
    ) -> None:
        """Record an upgrade running on ``installation`` (claims need unblock grants)."""
        check_resource(installation)
        with update(self.state_path, self.owners) as st:
            now = self.clock.wall()
            st.upgrades = [u for u in st.upgrades if u.installation != installation]
            st.upgrades.append(Upgrade(installation, reason, by.party, now, until))

    def upgrade_end(self, installation: str) -> bool:
        """End the upgrade on ``installation``; False when none was recorded."""
        with update(self.state_path, self.owners) as st:
            before = len(st.upgrades)
            st.upgrades = [u for u in st.upgrades if u.installation != installation]
            return len(st.upgrades) != before

    def prune(self) -> list[Grant]:
        """Drop the grants whose time ran out (those of held resources wait); return them."""
        with update(self.state_path, self.owners) as st:
            held = {h.env for h in self.dir.list()}
            return prune(st, held, self.clock.wall(), self.ttl)

    def state(self) -> State:
        """The state document as it is now (no lock taken)."""
        return load(self.state_path, self.owners)

    def _watch(self, st: State, now: float) -> None:
        sup = st.supervisor
        if sup is not None and sup.pid:
            alive = gone_reason(ProcessRef(sup.pid, sup.pid_start or None)) is None
            watch_supervisor(sup, alive, now, self.restart_grace)

    def _grant_once(self, st: State, resource: str, to: Party, by: Caller, held: bool,
                    now: float) -> None:
        if not to.session:
            raise LeaseError("a grant goes to a session: name its session id")
        self._require_supervisor(st, by)
        if not any(g.to.same_as(to) for g in pending(st, resource, held, now, self.ttl)):
            st.grants.append(Grant(resource, to, by.party, now))

    def _require_supervisor(self, st: State, by: Caller) -> None:
        if st.supervisor is None:
            raise LeaseError("no supervisor is recorded; run `slurm-fiber lease supervise start`")
        if not st.supervisor.party.same_as(by.party):
            raise LeaseError(f"only the supervisor {st.supervisor.party.display()} grants")

    def _holder(
        self, resource: str, caller: Caller, purpose: str, budget: int, now: float, st: State,
        index: int,
    ) -> Holder:
        party = caller.party
        return Holder(
            env=resource,
            holder=caller.name or _holder_label(party),
            session=compose_session(party.session, caller.process),
            purpose=purpose,
            since=to_rfc3339(now),
            host_session=caller.host_session,
            name=caller.name,
            person=party.person,
            team=party.team,
            host=party.host,
            upgrade_unblock=st.grants[index].upgrade_unblock if index >= 0 else "",
            budget_gib=budget,
        )

    def _steal(self, resource: str, current: Holder, caller: Caller, now: float) -> Holder | None:
        reason = holder_gone_reason(current, self.host)
        if reason is None:
            return current
        self._audit("steal-stale", resource, caller, current, reason)
        self.dir.release(resource)
        return None

    def _audit(
        self, action: str, resource: str, caller: Caller, holder: Holder | None, reason: str
    ) -> None:
        append_audit(
            self.dir.path,
            self.owners,
            {
                "at": to_rfc3339(self.clock.wall()),
                "action": action,
                "resource": resource,
                "by": caller.party.to_json(),
                "holder": holder.to_json() if holder is not None else None,
                "reason": reason,
            },
        )


def _holder_label(party: Party) -> str:
    """The shell lock's free-text ``holder``: the person, with the session when there is one."""
    if party.person and party.session:
        return f"{party.person} ({party.session})"
    return party.person or party.session or "?"


def _held(holder: Holder) -> Refusal:
    return Refusal(
        f"{holder.label()} is held by {holder.holder} since {holder.since or '?'} "
        f"for {holder.purpose!r}",
        0,
        holder.holder,
    )
