"""A DRA allocation as the core's devices: which devices the grant Pod's container may drive.

A DRA driver injects exactly the allocated devices into the container (CDI),
so inside the Pod they are numbered from 0 in allocation order; that
container-local ordinal is the ``index`` a visibility variable such as
``CUDA_VISIBLE_DEVICES`` needs. The device kind comes from the driver name:
an explicit map first, else the driver name's first DNS label
(``gpu.nvidia.com`` → ``gpu``). Pure functions; the grant's ``devices``
claim narrows the result later (``DeviceChannel.narrowed``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from slurm_fiber.core.devices import Device, DeviceChannel
from slurm_fiber.homes.kubernetes.views import ClaimView

DRIVER_KINDS: dict[str, str] = {
    "gpu.nvidia.com": "gpu",
    "gpu.amd.com": "gpu",
    "gpu.intel.com": "gpu",
}


def device_kind(driver: str, kinds: Mapping[str, str] = DRIVER_KINDS) -> str:
    """The device kind a driver's devices are (``gpu`` for the GPU drivers)."""
    return kinds.get(driver) or driver.split(".", 1)[0]


def claim_devices(
    claims: Iterable[ClaimView], kinds: Mapping[str, str] = DRIVER_KINDS
) -> DeviceChannel:
    """The devices allocated to ``claims`` (in order; duplicates once), numbered per kind from 0."""
    seen: set[tuple[str, str, str]] = set()
    next_index: dict[str, int] = {}
    out: list[Device] = []
    for claim in claims:
        for allocated in claim.devices:
            key = (allocated.driver, allocated.pool, allocated.device)
            if key in seen:
                continue
            seen.add(key)
            kind = device_kind(allocated.driver, kinds)
            index = next_index.get(kind, 0)
            next_index[kind] = index + 1
            out.append(Device(kind=kind, index=index, uuid=allocated.uuid))
    return DeviceChannel.of(out)
