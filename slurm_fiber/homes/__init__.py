"""The homes seam and the pieces every home is built from.

``Home`` is the seam between the core and its environment; ``drive`` feeds a
home's deliveries into the core; ``HealthPoll``, ``ReadyGate`` and
``ScopeLossQueue`` are the seed's building blocks for control-plane health,
readiness and scope loss; ``GrantDir`` delivers grants from a polled
directory. The concrete homes live in sub-modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# The names are loaded on first use (PEP 562), so importing one home module
# (the Slurm prolog reads slurm_fiber.homes.slurm.jobenv) does not pay for
# asyncio, jwt and the rest of the seam. No exported name may also be a
# submodule's name: once that submodule is imported, the package attribute
# is the module and shadows the lazy name (hence ``drive`` lives in delivery).
_WHERE = {
    "delivery": ("Admitter", "deliver", "drive"),
    "grantdir": ("MAX_TOKEN_BYTES", "GrantDir", "GrantDirRefused"),
    "healthpoll": ("ErrRoundTimeout", "HealthPoll", "RoundTimeout"),
    "problem": ("Problem", "ProblemSink", "log_problem"),
    "readygate": ("ReadyGate",),
    "scopeloss": ("ScopeLossQueue",),
    "seam": ("EventKind", "GrantEvent", "Home", "LosesScope", "ReleaseDevices",
             "ScopeLostHandler"),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


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
