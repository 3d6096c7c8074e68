"""A grantdir under test: a real ``GrantDir`` on a real directory, its events made plain.

``Dir`` polls the grantdir as (kind, uid) pairs and keeps every problem it reported, so a
test asserts on what was seen and on the problem codes alone. Shared by the grantdir
tests (plain and Secret-volume mode).
"""

from __future__ import annotations

from pathlib import Path

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.homes import EventKind, GrantDir, Problem
from tests.homes.homekit import confirmed


class Dir:
    """A grantdir under test with the problems it reported."""

    def __init__(self, path: Path, clock: FakeClock, **kw: object) -> None:
        self.path = path
        self.problems: list[Problem] = []
        self.gd = GrantDir(path, clock, interval=2.0, on_problem=self.problems.append, **kw)

    def poll(self) -> list[tuple[str, str]]:
        """One poll as (kind, uid) pairs; for GRANT_ADDED the uid is the token's sub, handed
        back to the grantdir as verified (``homekit.confirmed``)."""
        out = []
        for ev in self.gd.poll_each():
            if ev.kind is EventKind.GRANT_ADDED:
                out.append(("added", confirmed(ev) or "?"))
            else:
                out.append(("removed", ev.uid))
        return out

    def codes(self) -> list[str]:
        return [p.code for p in self.problems]
