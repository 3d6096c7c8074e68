"""Problems a home notices in what it is fed, reported instead of raised.

A home (grantdir, drive) never crashes on hostile input: each thing it skips
becomes a ``Problem`` with a stable code, the subject it concerns (a file
name, a grant UID) and a one-line reason a person can act on. Whoever builds
the home decides where problems go; by default they are logged once each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("slurm_fiber.homes")


@dataclass(frozen=True)
class Problem:
    """One skipped input: ``code`` to key on, ``subject`` it concerns, ``reason`` for people."""

    code: str
    subject: str
    reason: str

    def __str__(self) -> str:
        return f"{self.code}: {self.subject}: {self.reason}"


ProblemSink = Callable[[Problem], None]


def log_problem(problem: Problem) -> None:
    """The default sink: one warning line per problem. Never raises."""
    log.warning("%s", problem)
