"""A DRA allocation becomes container-local devices of the right kind."""

from __future__ import annotations

from slurm_fiber.homes.kubernetes.claimdevices import claim_devices, device_kind
from slurm_fiber.homes.kubernetes.views import claim_view
from slurm_fiber.testing.kubernetes.fake import Allocated, resource_claim


def claim(name: str, *devices: Allocated) -> object:
    doc = resource_claim(name, "ns", devices)
    doc["metadata"]["uid"] = f"uid-{name}"
    return claim_view(doc)


def test_kinds_from_driver_names() -> None:
    assert device_kind("gpu.nvidia.com") == "gpu"
    assert device_kind("gpu.example.com") == "gpu"
    assert device_kind("fpga.acme.io") == "fpga"
    assert device_kind("weird.acme.io", {"weird.acme.io": "gpu"}) == "gpu"


def test_devices_numbered_per_kind_in_allocation_order_with_uuids() -> None:
    first = claim("a", Allocated("r", "gpu.nvidia.com", "n1", "gpu-5", uuid="GPU-5"),
                  Allocated("r", "fpga.acme.io", "n1", "f-0"))
    second = claim("b", Allocated("r", "gpu.nvidia.com", "n1", "gpu-2"),
                   Allocated("r", "gpu.nvidia.com", "n1", "gpu-5", uuid="GPU-5"))
    channel = claim_devices([first, second])
    got = [(d.kind, d.index, d.uuid) for d in channel.devices]
    assert got == [("fpga", 0, None), ("gpu", 0, "GPU-5"), ("gpu", 1, None)]
    assert channel.narrowed(["gpu"]).env()["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert channel.narrowed(["gpu"]).env()["NVIDIA_VISIBLE_DEVICES"] == "GPU-5,1"


def test_an_unallocated_claim_gives_no_devices() -> None:
    assert claim_devices([claim("empty")]).devices == ()
