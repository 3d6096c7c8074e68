"""Device confinement by a cgroup v1 devices group: the allow list a grant's devices need.

``confine_devices`` denies every device to a group with no children yet and allows the
pseudo-devices (``PSEUDO_DEVICES``, runc's default list) and the grant's own (their
device nodes' numbers; an NVIDIA GPU brings nvidiactl, modeset and nvidia-uvm), then
reads ``devices.list`` back: ``DeviceRule.confined`` only when the kernel holds that
list. ``kept_rule`` reads back the rule of a group re-carved with children (v1 refuses
``deny a`` there). A device that cannot be listed leaves the grant not confined, and
the rule says why. cgroup v2 confines devices by BPF programs, which fiberd does not
load: there the manager reports devices as not confined.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from slurm_fiber.core.devices import Device

# The pseudo-devices every process may open under a v1 device rule (null, zero, full,
# random, urandom, tty, ptmx and the pts terminals), as runc's default allow list.
PSEUDO_DEVICES: tuple[str, ...] = ("c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm",
                                   "c 1:9 rwm", "c 5:0 rwm", "c 5:2 rwm", "c 136:* rwm")


NVIDIA_MAJOR = 195  # /dev/nvidia<N>; a granted one also needs nvidiactl (255), modeset (254)


_NVIDIA_UVM = ("nvidia-uvm",)  # /proc/devices names whose every minor a granted NVIDIA GPU needs


@dataclass(frozen=True)
class DeviceRule:
    """How a grant's device cgroup fared: ``confined`` when ``devices.deny a`` and the
    allow list hold (read back from ``devices.list``), else ``reason`` says why not."""

    confined: bool
    allowed: tuple[str, ...]
    reason: str


def device_rules(devices: Iterable[Device]) -> tuple[tuple[str, ...], str | None]:
    """The v1 allow rules for a grant's devices (besides ``PSEUDO_DEVICES``), or a reason
    they cannot be listed (a device without a node path, a path that is no device)."""
    rules: list[str] = []
    for device in devices:
        if not device.path:
            return (), f"{device.kind} {device.index} has no device node path to allow"
        try:
            st = os.stat(device.path)
        except OSError as e:
            return (), f"cannot stat {device.path}: {e.strerror}"
        kind = "c" if stat.S_ISCHR(st.st_mode) else "b" if stat.S_ISBLK(st.st_mode) else None
        if kind is None:
            return (), f"{device.path} is not a device node"
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        rules.append(f"{kind} {major}:{minor} rwm")
        if kind == "c" and major == NVIDIA_MAJOR and "/dev/" in device.path:
            rules += [f"c {NVIDIA_MAJOR}:255 rwm", f"c {NVIDIA_MAJOR}:254 rwm"]
            rules += [f"c {m}:* rwm" for m in _char_majors(_NVIDIA_UVM)]
    return tuple(dict.fromkeys(rules)), None


def _char_majors(names: tuple[str, ...]) -> list[int]:
    try:
        text = Path("/proc/devices").read_text().partition("Block devices:")[0]
    except OSError:
        return []
    return [int(m) for m, n in re.findall(r"^\s*(\d+) (\S+)$", text, re.M) if n in names]


def confine_devices(group: Path, devices: Iterable[Device]) -> DeviceRule:
    """``devices.deny a``, then allow the pseudo-devices and the grant's own, on a group
    with no children yet (v1 refuses ``deny a`` below one); read back ``devices.list``."""
    extra, why = device_rules(devices)
    if why is not None:
        return DeviceRule(False, (), f"not confined: {why}")
    allowed = PSEUDO_DEVICES + extra
    try:
        (group / "devices.deny").write_text("a\n")
        for rule in allowed:
            (group / "devices.allow").write_text(rule + "\n")
        listed = set((group / "devices.list").read_text().split("\n"))
    except OSError as e:
        return DeviceRule(False, (), f"not confined: writing {group}/devices.* failed: "
                                     f"{e.strerror}")
    if "a *:* rwm" in listed or not set(allowed) <= listed:
        return DeviceRule(False, (), f"not confined: {group}/devices.list reads "
                                     f"{' | '.join(sorted(listed - {''}))}")
    return DeviceRule(True, allowed, f"devices.deny a; allowed: {', '.join(allowed)}")


def kept_rule(group: Path, devices: Iterable[Device]) -> DeviceRule:
    """The rule a re-carved grant (a renewal) keeps: the one written at admission, as it
    reads back (v1 refuses ``deny a`` on a group with children)."""
    extra, why = device_rules(devices)
    try:
        listed = set((group / "devices.list").read_text().split("\n")) - {""}
    except OSError as e:
        return DeviceRule(False, (), f"not confined: {group}/devices.list: {e.strerror}")
    if why is not None or "a *:* rwm" in listed:
        return DeviceRule(False, (), f"not confined: {why or 'everything is allowed'}")
    return DeviceRule(True, PSEUDO_DEVICES + extra,
                      f"devices.deny a; allowed: {', '.join(sorted(listed))}")
