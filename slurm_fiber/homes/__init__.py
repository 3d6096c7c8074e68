"""The homes seam and the pieces every home is built from.

``Home`` is the seam between the core and its environment; ``drive`` feeds a
home's deliveries into the core; ``HealthPoll``, ``ReadyGate`` and
``ScopeLossQueue`` are the seed's building blocks for control-plane health,
readiness and scope loss; ``GrantDir`` delivers grants from a polled
directory. The concrete homes live in sub-modules.
"""

from __future__ import annotations

from slurm_fiber.core.seam import (
    EventKind,
    GrantEvent,
    Home,
    LosesScope,
    ReleaseDevices,
    ScopeLostHandler,
)
from slurm_fiber.homes.delivery import Admitter, deliver, drive
from slurm_fiber.homes.grantdir import MAX_TOKEN_BYTES, GrantDir, GrantDirRefused
from slurm_fiber.homes.healthpoll import ErrRoundTimeout, HealthPoll, RoundTimeout
from slurm_fiber.homes.problem import Problem, ProblemSink, log_problem
from slurm_fiber.homes.readygate import ReadyGate
from slurm_fiber.homes.scopeloss import ScopeLossQueue

__all__ = [
    "MAX_TOKEN_BYTES",
    "Admitter",
    "ErrRoundTimeout",
    "EventKind",
    "GrantDir",
    "GrantDirRefused",
    "GrantEvent",
    "HealthPoll",
    "Home",
    "LosesScope",
    "Problem",
    "ProblemSink",
    "ReadyGate",
    "ReleaseDevices",
    "RoundTimeout",
    "ScopeLossQueue",
    "ScopeLostHandler",
    "deliver",
    "drive",
    "log_problem",
]
