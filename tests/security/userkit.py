"""Unprivileged accounts for the hostile tests: created once, idempotently, as a site would.

``job_user(name)`` returns the account, adding it with ``useradd --system`` when absent
(a concurrent run that wins the race is fine). ``user.spawn_args()`` is a
``preexec_fn``-free way to run a child as that account: pass it as keyword arguments
(``user=``/``group=``/``extra_groups=``/``env=``) to ``subprocess.run``; ``as_user(user,
script)`` runs a shell script that way and asserts it succeeds. Creating accounts needs
root; callers skip (or, in CI, fail) without it.
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


def as_user(user: JobUser, script: str) -> None:
    """Run ``script`` with /bin/sh as ``user`` (asserting it succeeds)."""
    subprocess.run(["/bin/sh", "-ec", script], check=True, timeout=30, **user.spawn_args())
