"""The standalone home's stage: a grantdir, a static device set, a ready file and sd_notify.

The "control plane" of a plain host is whoever writes the grantdir: the
stage delivers a grant by writing ``<uid>.jwt`` atomically (by rename) and
removes it by deleting the file. Readiness is what the home publishes: the
ready file is the current state, and a notify socket the stage binds (and
names in fiberd's ``NOTIFY_SOCKET``, as systemd would) receives
every state the home sends, so the history has every flip. Devices are two
static GPUs from configuration.

Declared lacks: no control plane (health never goes stale), no scope, and
no device holds (static devices are never claimed, so there is nothing to
release). fiberd runs uncarved (``cgroup_root = none``) so a conformance
run never moves the calling process between cgroups.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Mapping
from pathlib import Path

from slurm_fiber.config import load_config
from slurm_fiber.conform.stage import Capability, Issuer, Launch, OpenedStage, Published
from slurm_fiber.core.devices import Device
from slurm_fiber.homes.sdnotify import NOTIFY_ENV
from slurm_fiber.safefs import replace_file

DEVICES = (Device("gpu", 0, None, "GPU-conform-0"), Device("gpu", 1, None, "GPU-conform-1"))
POLL_INTERVAL = 0.05  # seconds between grantdir polls: fast, so clauses settle quickly


def _device_flag(d: Device) -> str:
    return f"{d.kind}:{d.index}:{d.path or ''}:{d.uuid or ''}"


class StandaloneStage(OpenedStage):
    """Drives ``fiberd --home standalone``. Open it once; used on one event loop."""

    home = "standalone"
    lacks: Mapping[Capability, str] = {
        Capability.CONTROL_PLANE: "a plain host has no control plane; its health is always "
                                  "fresh",
        Capability.SCOPE: "a plain host asserts no scope, so it has none to lose",
        Capability.DEVICE_HOLDS: "static devices are never claimed, so no hold is released",
    }

    def __init__(self) -> None:
        super().__init__()
        self._notify: socket.socket | None = None
        self._history: list[bool] = []

    @property
    def grantdir(self) -> Path:
        return self.root / "state" / "grants"

    async def open(self, workdir: Path, issuer: Issuer) -> None:
        """Make the state dir and grantdir (0700) and bind the notify socket."""
        self.opened(workdir, issuer)
        self.grantdir.mkdir(parents=True, mode=0o700)
        (workdir / "state").chmod(0o700)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        sock.bind(str(workdir / "notify.sock"))
        sock.setblocking(False)
        asyncio.get_running_loop().add_reader(sock.fileno(), self._receive)
        self._notify = sock

    async def close(self) -> None:
        """Stop listening. Never raises."""
        if self._notify is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._notify.fileno())
            self._notify.close()
            self._notify = None

    def flags(self) -> dict[str, object]:
        """fiberd's flags for this stage: its state dir, the harness's issuer, two GPUs."""
        return {
            "home": "standalone", "state_dir": str(self.root / "state"),
            "trust": self.trust,
            "poll_interval": str(POLL_INTERVAL), "grace": "0.5", "cgroup_root": "none",
            "audit_fsync": "never", "devices": ",".join(_device_flag(d) for d in DEVICES),
        }

    def launch(self) -> Launch:
        """fiberd configured from ``flags()`` with the notify socket in its environment, the
        home built as ``fiberd`` builds it."""
        return Launch(load_config(env={}, flags=self.flags()),
                      {NOTIFY_ENV: str(self.root / "notify.sock")})

    async def deliver(self, uid: str, token: str) -> None:
        """Write ``<uid>.jwt`` (0600) by rename, as a careful admin tool would."""
        replace_file(self.grantdir / f"{uid}.jwt", token.encode(), mode=0o600)

    async def remove(self, uid: str) -> None:
        """Delete ``<uid>.jwt``."""
        (self.grantdir / f"{uid}.jwt").unlink(missing_ok=True)

    async def silence(self) -> None:
        raise NotImplementedError("standalone has no control plane")

    async def restore(self) -> None:
        raise NotImplementedError("standalone has no control plane")

    async def lose_scope(self) -> None:
        raise NotImplementedError("standalone has no scope")

    def readiness(self) -> Published:
        """The ready file's state now, and every state sent to the notify socket so far."""
        self._receive()  # datagrams already sent count, even before the loop reads them
        try:
            current = json.loads((self.root / "state" / "ready.json").read_text())["ready"]
        except (OSError, ValueError, KeyError, TypeError):
            current = None
        return Published(current if isinstance(current, bool) else None, tuple(self._history))

    def devices(self) -> tuple[Device, ...]:
        """The two static GPUs fiberd is configured with."""
        return DEVICES

    def held_devices(self) -> frozenset[Device]:
        raise NotImplementedError("static devices are never claimed")

    def _receive(self) -> None:
        """Read every queued datagram: READY=1 is up, any other state message is down."""
        if self._notify is None:
            return
        while True:
            try:
                data = self._notify.recv(4096)
            except BlockingIOError:
                return
            lines = data.decode(errors="replace").splitlines()
            self._history.append("READY=1" in lines)
