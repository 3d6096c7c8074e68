"""Who the templates and fibers of a fiberd run as (``fiber_user``).

A fiberd run by a user (a Slurm job's) runs its templates and fibers as that user:
nothing changes hands. A fiberd run by root must be told whom to run them as: the
site names an unprivileged account (``fiber_user = "name"`` or a uid), or says
``fiber_user = "root"`` explicitly. ``resolve_fiber_user`` refuses a root fiberd that
names nobody, and a non-root fiberd that names anyone but itself (it could not switch).

What a ``FiberIdentity`` guarantees once fiberd starts a template with it
(``core/templates/process.py``): the template is exec'd as its uid, gid and supplementary
groups (set by ``subprocess`` between fork and exec, so it holds no capability from
its first instruction on) and with ``no_new_privs`` set before it imports anything of
the grant's, inherited by every fiber: no setuid or file-capability program gives a
fiber back what it lost. The explicit ``root`` identity keeps root and its
capabilities (the site's choice, said in status and the start record) but still sets
``no_new_privs``. What it does not do: choose which cgroup files the uid may write
(``core/cgroups/groups.py`` hands it only the ``cgroup.procs`` of its grant's groups).
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass
from typing import Any

ROOT_OPT_IN = "root"


class IdentityRefused(Exception):
    """fiberd cannot run fibers as configured (one line naming what to set)."""


@dataclass(frozen=True)
class FiberIdentity:
    """The account a root fiberd's templates and fibers run as."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    @property
    def root(self) -> bool:
        return self.uid == 0

    def spawn_args(self) -> dict[str, Any]:
        """Keyword arguments for ``subprocess.Popen`` that start the template as this
        account (none for root: it stays as it is)."""
        if self.root:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def to_json(self) -> dict[str, object]:
        return {"user": self.name, "uid": self.uid, "gid": self.gid,
                "capabilities": "all (fiber_user = root)" if self.root else "none",
                "no_new_privs": True}


def resolve_fiber_user(value: str | None, euid: int | None = None) -> FiberIdentity | None:
    """The identity fiberd's fibers take for the ``fiber_user`` option ``value`` (a name,
    a uid, or ``root``); None when they keep fiberd's own. Raises IdentityRefused."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        if value is None or _uid_of(value) == euid:
            return None
        raise IdentityRefused(f"fiber_user {value!r}: only a root fiberd can run fibers as "
                              "another user; leave fiber_user unset")
    if value is None:
        raise IdentityRefused(
            "a root fiberd needs fiber_user: name the unprivileged user its fibers run as "
            "(fiber_user = \"root\" runs them as root, with every capability)")
    try:
        entry = pwd.getpwnam(value) if not value.isdigit() else pwd.getpwuid(int(value))
    except KeyError:
        raise IdentityRefused(f"fiber_user {value!r}: no such user on this host") from None
    if entry.pw_uid == 0 and value != ROOT_OPT_IN:
        raise IdentityRefused(f"fiber_user {value!r} is root: write fiber_user = \"root\" "
                              "to run fibers as root")
    groups = tuple(sorted(set(os.getgrouplist(entry.pw_name, entry.pw_gid))))
    return FiberIdentity(entry.pw_name, entry.pw_uid, entry.pw_gid, groups)


def _uid_of(value: str) -> int | None:
    if value.isdigit():
        return int(value)
    try:
        return pwd.getpwnam(value).pw_uid
    except KeyError:
        return None
