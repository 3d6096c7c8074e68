"""Unprivileged accounts for the hostile tests: created once, idempotently, as a site would.

``job_user(name)`` returns the account, adding it with ``useradd --system`` when absent
(a concurrent run that wins the race is fine). ``as_user(user)`` is a ``preexec_fn``-free
way to run a child as that account: pass its result as ``user=``/``group=``/
``extra_groups=`` to ``subprocess.run``. Creating accounts needs root; callers skip
(or, in CI, fail) without it.
"""

from __future__ import annotations

import os
import pwd
import subprocess
from dataclasses import dataclass
from typing import Any

MALLORY = "sfmallory"  # the hostile job user
ALICE = "sfalice"      # the victim job user


@dataclass(frozen=True)
class JobUser:
    """A non-root account: name, uid, gid."""

    name: str
    uid: int
    gid: int

    def spawn_args(self) -> dict[str, Any]:
        """Keyword arguments that make ``subprocess`` run the child as this account."""
        return {"user": self.uid, "group": self.gid, "extra_groups": [],
                "env": {"PATH": "/usr/bin:/bin", "HOME": "/", "USER": self.name,
                        "LANG": "C.UTF-8"}}


def job_user(name: str) -> JobUser:
    """The account ``name``, created with useradd when absent (root only); raises on failure."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        if os.geteuid() != 0:
            raise PermissionError(f"creating the account {name} needs root") from None
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/sh",
                        "--user-group", name], capture_output=True, check=False)
        entry = pwd.getpwnam(name)
    return JobUser(entry.pw_name, entry.pw_uid, entry.pw_gid)
