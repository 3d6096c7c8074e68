"""The seam's names where homes have always imported them from.

The seam (``Home``, ``GrantEvent`` and the rest) is the core's own interface
and lives in ``slurm_fiber.core.seam``, so the core imports nothing of the
homes; this module only re-exports it for homes written against the old path.
"""

from slurm_fiber.core.seam import (
    EventKind,
    GrantEvent,
    Home,
    LosesScope,
    ReleaseDevices,
    ScopeLostHandler,
)

__all__ = ["EventKind", "GrantEvent", "Home", "LosesScope", "ReleaseDevices", "ScopeLostHandler"]
