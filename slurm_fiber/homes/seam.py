"""The seam's names where homes have always imported them from.

The seam (``Home``, its ports, ``GrantEvent`` and the rest) is the core's own
interface and lives in ``slurm_fiber.core.seam``, so the core imports nothing
of the homes; this module only re-exports it for homes written against the old
path.
"""

from slurm_fiber.core.seam import (
    CgroupRoot,
    DeviceSource,
    EventKind,
    GrantEvent,
    GrantSource,
    Home,
    Liveness,
    LosesScope,
    Readiness,
    ReleaseDevices,
    ScopeLostHandler,
)

__all__ = ["CgroupRoot", "DeviceSource", "EventKind", "GrantEvent", "GrantSource", "Home",
           "Liveness", "LosesScope", "Readiness", "ReleaseDevices", "ScopeLostHandler"]
