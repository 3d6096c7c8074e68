"""Device channels: the devices a grant's engine may drive, and the env that shows them.

A DeviceChannel is computed by the home (static config, Slurm GRES, a DRA
claim) and narrowed to the device kinds the grant names. ``env()`` is the
complete set of visibility variables a template and its fibers get: it names
exactly the channel's devices and, for kinds the channel holds none of, sets
each variable to that runtime's "no device" value, so a fiber never inherits
a wider view from fiberd's own environment. A grant that may drive no device
kind gets an empty channel.

"No device" per variable: CUDA reads an empty ``CUDA_VISIBLE_DEVICES`` as
none; the NVIDIA container toolkit reads ``void``. Level Zero reads an empty
``ZE_AFFINITY_MASK`` as *all* devices, and ROCm / ``GPU_DEVICE_ORDINAL`` are
not documented to read empty as none, so those get ``-1``: an index no device
has, which every one of these runtimes filters out, leaving none visible.

Visibility is not access. Where the host has a cgroup v1 devices hierarchy,
the grant's device cgroup (``core.cgroups.confine_devices``) denies every
device node but the channel's own (by each device's ``path``) and the
pseudo-devices, and the enforcement record says "cgroup v1 devices";
elsewhere (cgroup v2 has no device files; its eBPF device programs are not
used), or for a device without a node path, nothing stops a fiber from
opening another device node its uid may open, and the record says devices
are confined "env only" (``core.enforcement``), never more.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from slurm_fiber.protocol.names import GPU_VISIBILITY_VARS

# Vendor variables per device kind. "gpu" is exposed through every vendor's
# variable, since which runtime the engine uses is not known here.
VISIBILITY_VARS: dict[str, tuple[str, ...]] = {"gpu": GPU_VISIBILITY_VARS}
ALL_VISIBILITY_VARS: tuple[str, ...] = tuple(v for vs in VISIBILITY_VARS.values() for v in vs)
# The value that shows no device, where "" would not (see the module docstring).
NO_DEVICE: dict[str, str] = {
    "NVIDIA_VISIBLE_DEVICES": "void",
    "ROCR_VISIBLE_DEVICES": "-1",
    "GPU_DEVICE_ORDINAL": "-1",
    "ZE_AFFINITY_MASK": "-1",
}


@dataclass(frozen=True)
class Device:
    """One device: kind ("gpu"), index as the scheduler numbers it, node path, uuid if known,
    and ``visible``: the id the job's own steps give runtimes for it where the home knows it
    differs from ``index`` (Slurm renumbers CUDA_VISIBLE_DEVICES from 0 under
    ConstrainDevices), which the visibility variables then carry."""

    kind: str
    index: int
    path: str | None = None
    uuid: str | None = None
    visible: str | None = None


@dataclass(frozen=True)
class DeviceChannel:
    """An ordered, duplicate-free set of devices."""

    devices: tuple[Device, ...] = ()

    @classmethod
    def of(cls, devices: Iterable[Device]) -> DeviceChannel:
        seen: dict[tuple[str, int], Device] = {}
        for d in devices:
            seen.setdefault((d.kind, d.index), d)
        return cls(tuple(sorted(seen.values(), key=lambda d: (d.kind, d.index))))

    def narrowed(self, kinds: Iterable[str]) -> DeviceChannel:
        """Only the devices of the given kinds (a grant's ``devices`` claim)."""
        allowed = set(kinds)
        return DeviceChannel(tuple(d for d in self.devices if d.kind in allowed))

    def env(self) -> dict[str, str]:
        """Every visibility variable, naming exactly this channel's devices.

        A kind with no device gets each variable's "no device" value
        (``NO_DEVICE``, else ""), never an unset variable.
        """
        out: dict[str, str] = {}
        for kind, names in VISIBILITY_VARS.items():
            mine = [d for d in self.devices if d.kind == kind]
            for name in names:
                # The container toolkit reads uuids when present.
                ids = [d.uuid or str(d.index) if name == "NVIDIA_VISIBLE_DEVICES"
                       else d.visible or str(d.index) for d in mine]
                out[name] = ",".join(ids) if ids else NO_DEVICE.get(name, "")
        return out

    def to_json(self) -> list[dict[str, object]]:
        return [
            {"kind": d.kind, "index": d.index, "path": d.path, "uuid": d.uuid}
            | ({"visible": d.visible} if d.visible is not None else {})
            for d in self.devices
        ]
