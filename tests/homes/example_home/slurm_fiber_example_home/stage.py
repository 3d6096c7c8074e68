"""The example home's grant-conform stage: its grantdir is the control plane's hand.

Delivering a grant writes ``<uid>.jwt`` by rename, removing it deletes the
file; readiness is the home's readiness log (every flip, in order). It lacks
a control plane, a scope and devices, and declares so.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from slurm_fiber.config import load_config
from slurm_fiber.conform.stage import Capability, Issuer, Launch, OpenedStage, Published
from slurm_fiber.core.devices import Device
from slurm_fiber_example_home.home import READINESS_LOG


class ExampleStage(OpenedStage):
    """Drives ``fiberd --home example``. Open it once; used on one event loop."""

    home = "example"
    lacks: Mapping[Capability, str] = {
        Capability.CONTROL_PLANE: "the example home has no control plane to silence",
        Capability.SCOPE: "the example home asserts no scope",
        Capability.DEVICES: "the example home provisions no devices",
        Capability.DEVICE_HOLDS: "the example home provisions no devices",
    }

    @property
    def state(self) -> Path:
        return self.root / "state"

    async def open(self, workdir: Path, issuer: Issuer) -> None:
        self.opened(workdir, issuer)
        (self.state / "grants").mkdir(parents=True, mode=0o700)
        self.state.chmod(0o700)

    async def close(self) -> None:
        return None

    def launch(self) -> Launch:
        return Launch(load_config(env={}, flags={
            "home": "example", "state_dir": str(self.state), "trust": self.trust,
            "poll_interval": "0.05", "grace": "0.5", "cgroup_root": "none",
            "audit_fsync": "never"}), {})

    async def deliver(self, uid: str, token: str) -> None:
        tmp = self.state / "grants" / f".{uid}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(token)
        tmp.rename(self.state / "grants" / f"{uid}.jwt")

    async def remove(self, uid: str) -> None:
        (self.state / "grants" / f"{uid}.jwt").unlink(missing_ok=True)

    async def silence(self) -> None:
        raise NotImplementedError("no control plane")

    async def restore(self) -> None:
        raise NotImplementedError("no control plane")

    async def lose_scope(self) -> None:
        raise NotImplementedError("no scope")

    def readiness(self) -> Published:
        try:
            lines = (self.state / READINESS_LOG).read_text().splitlines()
        except FileNotFoundError:
            lines = []
        history = tuple(bool(json.loads(line)["ready"]) for line in lines)
        return Published(history[-1] if history else None, history)

    def devices(self) -> tuple[Device, ...]:
        raise NotImplementedError("no devices")

    def held_devices(self) -> frozenset[Device]:
        raise NotImplementedError("no devices")
