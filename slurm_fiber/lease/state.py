"""The state document: the supervisor, its grants in order, running upgrades.

One JSON file (path chosen by the caller) read by anyone and rewritten only
inside :func:`update`, which holds an exclusive ``flock`` on ``<path>.lock``
for the read-modify-write and replaces the file atomically (both opened
relative to their directory's fd through lease.files: never a link, never
a FIFO, never a hard-linked lock), so concurrent
writers lose no update and a reader never sees half a document. Top-level
fields this version does not know are kept and written back unchanged (a
newer writer's data survives an older one); inside the known records an
unknown field is refused, because rewriting would silently drop it. A
document that cannot be read is never overwritten: every reader and writer
refuses with a one-line LeaseError until a person fixes or removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_fiber.lease.errors import LeaseError, io_failure
from slurm_fiber.lease.files import Owners, open_area, open_regular, read_json, write_atomic
from slurm_fiber.lease.names import check_resource
from slurm_fiber.lease.records import NUMBER, fields
from slurm_fiber.lease.times import parse_rfc3339, to_rfc3339

MAX_STATE_BYTES = 16 * 1024 * 1024

STATE_DIR = "the state document's dir (--state, by default --dir)"


@dataclass(frozen=True)
class Party:
    """A session (``session`` set) or a person (no session) as the state names it.

    Two parties are the same when their sessions are equal and non-empty or,
    both without a session, when person, team and host are equal and the
    person is named.
    """

    session: str = ""
    person: str = ""
    team: str = ""
    host: str = ""

    def same_as(self, other: Party) -> bool:
        """Whether ``self`` and ``other`` name the same session or person."""
        if self.session or other.session:
            return self.session == other.session
        return bool(self.person) and (self.person, self.team, self.host) == (
            other.person,
            other.team,
            other.host,
        )

    def display(self) -> str:
        """A short name for tables and refusals: the session, else person@host."""
        if self.session:
            return self.session
        return f"{self.person or '?'}@{self.host}" if self.host else self.person or "?"

    def to_json(self) -> dict[str, str]:
        """The record with empty fields left out."""
        return {k: v for k, v in vars(self).items() if v}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Party:
        """Parse a party record; raise ValueError naming ``where`` when malformed."""
        keys = dict.fromkeys(("session", "person", "team", "host"), str)
        return cls(**fields(obj, where, {}, keys))


@dataclass
class Supervisor:
    """The recorded supervisor: from its ``supervise start`` to a deliberate stop.

    ``pid``/``pid_start`` identify its process on this host (0 when it has
    none to watch). ``restart_until`` is set while a vanished process may
    still come back as a restart; ``gone`` once it stayed away longer.
    """

    party: Party
    since: float
    pid: int = 0
    pid_start: float = 0.0
    restart_until: float | None = None
    gone: bool = False


@dataclass(frozen=True)
class Grant:
    """The supervisor's word that ``to`` may claim ``resource``; queued in order given.

    ``upgrade_unblock`` is why the grant admits a claim during an upgrade
    (the work that unblocks it); empty for an ordinary grant.
    """

    resource: str
    to: Party
    by: Party
    at: float
    upgrade_unblock: str = ""


@dataclass(frozen=True)
class Upgrade:
    """An upgrade running on the installation named ``installation`` until ended or ``until``."""

    installation: str
    reason: str
    by: Party
    at: float
    until: float | None = None

    def running(self, now: float) -> bool:
        """Whether the upgrade still holds at ``now``."""
        return self.until is None or now < self.until


@dataclass
class State:
    """The whole document. ``released`` maps a resource to its last release time."""

    supervisor: Supervisor | None = None
    grants: list[Grant] = field(default_factory=list)
    released: dict[str, float] = field(default_factory=dict)
    upgrades: list[Upgrade] = field(default_factory=list)
    unknown: dict[str, Any] = field(default_factory=dict)

    def upgrade_of(self, resource: str, now: float) -> Upgrade | None:
        """The upgrade running at ``now`` on the installation named ``resource``, if any."""
        running = (u for u in self.upgrades if u.installation == resource and u.running(now))
        return next(running, None)


def _time(rec: dict[str, Any], key: str) -> float | None:
    return parse_rfc3339(rec[key]) if key in rec else None


def _supervisor_from(obj: Any) -> Supervisor:
    where = "supervisor"
    rec = fields(
        obj,
        where,
        {"party": dict, "since": str},
        {"pid": int, "pidStart": NUMBER, "restartUntil": str, "gone": bool},
    )
    return Supervisor(
        party=Party.from_json(rec["party"], f"{where}.party"),
        since=parse_rfc3339(rec["since"]),
        pid=rec.get("pid", 0),
        pid_start=float(rec.get("pidStart", 0.0)),
        restart_until=_time(rec, "restartUntil"),
        gone=rec.get("gone", False),
    )


def _grant_from(obj: Any, i: int) -> Grant:
    where = f"grants[{i}]"
    rec = fields(
        obj,
        where,
        {"resource": str, "to": dict, "by": dict, "at": str},
        {"upgradeUnblock": str},
    )
    check_resource(rec["resource"])
    return Grant(
        resource=rec["resource"],
        to=Party.from_json(rec["to"], f"{where}.to"),
        by=Party.from_json(rec["by"], f"{where}.by"),
        at=parse_rfc3339(rec["at"]),
        upgrade_unblock=rec.get("upgradeUnblock", ""),
    )


def _upgrade_from(obj: Any, i: int) -> Upgrade:
    where = f"upgrades[{i}]"
    rec = fields(
        obj,
        where,
        {"installation": str, "reason": str, "by": dict, "at": str},
        {"until": str},
    )
    return Upgrade(
        installation=rec["installation"],
        reason=rec["reason"],
        by=Party.from_json(rec["by"], f"{where}.by"),
        at=parse_rfc3339(rec["at"]),
        until=_time(rec, "until"),
    )


def _list(obj: dict[str, Any], key: str) -> list[Any]:
    value = obj.get(key, [])
    if not isinstance(value, list):
        raise ValueError(f"field {key!r} is not a list")
    return value


def state_from_json(obj: Any) -> State:
    """Build a State from a decoded document; raise ValueError naming the bad field."""
    if not isinstance(obj, dict):
        raise ValueError("the document is not a JSON object")
    released = obj.get("released", {})
    if not isinstance(released, dict) or not all(isinstance(v, str) for v in released.values()):
        raise ValueError("field 'released' is not an object of time strings")
    known = {"supervisor", "grants", "released", "upgrades"}
    sup = obj.get("supervisor")
    return State(
        supervisor=None if sup is None else _supervisor_from(sup),
        grants=[_grant_from(g, i) for i, g in enumerate(_list(obj, "grants"))],
        released={check_resource(k): parse_rfc3339(v) for k, v in released.items()},
        upgrades=[_upgrade_from(u, i) for i, u in enumerate(_list(obj, "upgrades"))],
        unknown={k: v for k, v in obj.items() if k not in known},
    )


def state_to_json(st: State) -> dict[str, Any]:
    """The document for ``st``, unknown top-level fields included, empty parts left out."""
    out: dict[str, Any] = dict(st.unknown)
    if st.supervisor is not None:
        sup = st.supervisor
        rec: dict[str, Any] = {"party": sup.party.to_json(), "since": to_rfc3339(sup.since)}
        if sup.pid:
            rec |= {"pid": sup.pid, "pidStart": sup.pid_start}
        if sup.restart_until is not None:
            rec["restartUntil"] = to_rfc3339(sup.restart_until)
        if sup.gone:
            rec["gone"] = True
        out["supervisor"] = rec
    if st.grants:
        out["grants"] = [_grant_json(g) for g in st.grants]
    if st.released:
        out["released"] = {k: to_rfc3339(v) for k, v in st.released.items()}
    if st.upgrades:
        out["upgrades"] = [_upgrade_json(u) for u in st.upgrades]
    return out


def _grant_json(g: Grant) -> dict[str, Any]:
    rec = {"resource": g.resource, "to": g.to.to_json(), "by": g.by.to_json()}
    rec["at"] = to_rfc3339(g.at)
    return rec | ({"upgradeUnblock": g.upgrade_unblock} if g.upgrade_unblock else {})


def _upgrade_json(u: Upgrade) -> dict[str, Any]:
    rec = {"installation": u.installation, "reason": u.reason, "by": u.by.to_json()}
    rec["at"] = to_rfc3339(u.at)
    return rec | ({"until": to_rfc3339(u.until)} if u.until is not None else {})


def _load_at(dir_fd: int, path: Path, owners: Owners) -> State:
    try:
        obj = read_json(dir_fd, path.name, MAX_STATE_BYTES, "state document", path, owners)
    except FileNotFoundError:
        return State()
    try:
        return state_from_json(obj)
    except (ValueError, LeaseError) as err:
        raise LeaseError(f"state document {path}: {err}; fix or move it aside") from None


def load(path: Path, owners: Owners = None) -> State:
    """Read the state document without locking; a missing file is an empty State.

    Safe against concurrent writers (they replace the file atomically).
    ``owners`` as in lease.files (None: a cooperative area). Raises
    LeaseError with one line when the document is unreadable or untrusted.
    """
    try:
        dir_fd = open_area(path.parent, owners, what=STATE_DIR)
    except FileNotFoundError:
        return State()
    try:
        return _load_at(dir_fd, path, owners)
    finally:
        os.close(dir_fd)


@contextlib.contextmanager
def update(path: Path, owners: Owners = None) -> Iterator[State]:
    """Lock, read, let the caller change, and atomically rewrite the state document.

    Blocks while another writer holds the lock. The document is written only
    when the ``with`` body finishes without an exception; a body that raises
    (a Refusal, say) leaves the file untouched. The lock and the document
    are opened relative to their directory's fd, never through a link or a
    FIFO. Raises LeaseError when the lock or the document cannot be read or
    written (for an owned area, also when it is missing: its owner prepares it).
    """
    try:
        dir_fd = open_area(path.parent, owners, create=owners is None, what=STATE_DIR)
    except FileNotFoundError as err:
        raise io_failure(f"open the state's directory {path.parent}", err) from None
    try:
        lock = open_regular(dir_fd, path.name + ".lock", os.O_RDWR | os.O_CREAT, "state lock",
                            path.with_name(path.name + ".lock"), owners)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            st = _load_at(dir_fd, path, owners)
            yield st
            data = json.dumps(state_to_json(st), indent=1, sort_keys=True).encode() + b"\n"
            write_atomic(dir_fd, path.name, data, path)
        finally:
            os.close(lock)
    finally:
        os.close(dir_fd)
