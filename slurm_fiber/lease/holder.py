"""The holder record: ``<leasedir>/<resource>/holder.json``.

Field names and omit-when-empty marks are the shell lock's (see
docs/lease-format.md): ``env``, ``holder``, ``session``, ``purpose`` and
``since`` are always written; ``hostSession``, ``name``, ``person``,
``team``, ``host``, ``upgradeUnblock`` are left out when empty and
``budgetGiB`` when 0. Reading is strict: an unknown field, a missing field
or a wrong type is an error, never a guess.

The ``session`` string carries the holder's process so a stale holder can be
proved gone: ``<id>@pid:<pid>[:<start>]`` where ``<id>`` is the session id the
state's grants name (empty for a person), ``<pid>`` the holding process on
``host`` and ``<start>`` its start time in Unix seconds (psutil's
``create_time``, two decimals). A session without the ``@pid:`` suffix names
no process and can never be proved gone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from slurm_fiber.lease.records import fields
from slurm_fiber.lease.state import Party
from slurm_fiber.lease.times import parse_rfc3339

_JSON_NAMES = {
    "env": "env",
    "holder": "holder",
    "session": "session",
    "host_session": "hostSession",
    "name": "name",
    "person": "person",
    "team": "team",
    "host": "host",
    "purpose": "purpose",
    "since": "since",
    "upgrade_unblock": "upgradeUnblock",
    "budget_gib": "budgetGiB",
}
_ALWAYS = ("env", "holder", "session", "purpose", "since")
_PROCESS = re.compile(
    r"(?P<id>.*)@pid:(?P<pid>[1-9][0-9]{0,9})(?::(?P<start>[0-9]+(?:\.[0-9]+)?))?"
)


@dataclass(frozen=True)
class ProcessRef:
    """A process on a host: its pid and, when known, its start time (Unix seconds)."""

    pid: int
    start: float | None = None


def compose_session(session_id: str, process: ProcessRef | None) -> str:
    """The ``session`` string for a holder whose session is ``session_id`` run by ``process``."""
    if process is None:
        return session_id
    start = "" if process.start is None else f":{process.start:.2f}"
    return f"{session_id}@pid:{process.pid}{start}"


def split_session(session: str) -> tuple[str, ProcessRef | None]:
    """Split a ``session`` string into the session id and the process it names (if any)."""
    m = _PROCESS.fullmatch(session)
    if m is None:
        return session, None
    start = m.group("start")
    return m.group("id"), ProcessRef(int(m.group("pid")), None if start is None else float(start))


@dataclass(frozen=True)
class Holder:
    """Who holds a resource, why and since when; the record a claim writes."""

    env: str
    holder: str
    session: str
    purpose: str
    since: str
    host_session: str = ""
    name: str = ""
    person: str = ""
    team: str = ""
    host: str = ""
    upgrade_unblock: str = ""
    budget_gib: int = 0

    def label(self) -> str:
        """The resource with the budget its claim carries: ``gpu0`` or ``models (24 GiB)``."""
        return f"{self.env} ({self.budget_gib} GiB)" if self.budget_gib else self.env

    def party(self) -> Party:
        """The holder as the state names it (the session id, without its process)."""
        session_id, _ = split_session(self.session)
        return Party(session=session_id, person=self.person, team=self.team, host=self.host)

    def process(self) -> ProcessRef | None:
        """The holding process named in ``session``, None when it names none."""
        return split_session(self.session)[1]

    def since_time(self) -> float:
        """``since`` as Unix seconds; 0.0 when it is not a valid RFC 3339 time."""
        try:
            return parse_rfc3339(self.since)
        except ValueError:
            return 0.0

    def to_json(self) -> dict[str, Any]:
        """The record as written: always-present fields plus the non-empty others."""
        return {
            key: getattr(self, attr)
            for attr, key in _JSON_NAMES.items()
            if key in _ALWAYS or getattr(self, attr)
        }

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Holder:
        """Parse a record; raise ValueError naming ``where`` and the bad field."""
        kinds = {key: (int if key == "budgetGiB" else str) for key in _JSON_NAMES.values()}
        required = {k: v for k, v in kinds.items() if k in _ALWAYS}
        optional = {k: v for k, v in kinds.items() if k not in _ALWAYS}
        rec = fields(obj, where, required, optional)
        if rec.get("budgetGiB", 0) < 0:
            raise ValueError(f"{where} field 'budgetGiB' is negative")
        return cls(**{attr: rec[key] for attr, key in _JSON_NAMES.items() if key in rec})
