"""Recorded Slurm output replayed by real `scontrol` and `squeue` processes.

``Replay`` writes two small shell scripts into a bin directory and serves the
files a test chooses (fixtures recorded from 22.05, hand-written later
formats) through them, so the CLI backend runs real subprocesses, parses
real output and hits real timeouts. Every call's arguments are logged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from slurm_fiber.homes.slurm.home import SlurmHome

FIXTURES = Path(__file__).resolve().parent / "fixtures"

SCONTROL = """#!/bin/sh
printf '%s\\n' "$*" >> "$REPLAY_DIR/calls"
case "$1" in
  ping) if [ -f "$REPLAY_DIR/hang" ]; then
          echo $$ > "$REPLAY_DIR/.pid" && mv "$REPLAY_DIR/.pid" "$REPLAY_DIR/hang.pid"
          exec sleep 60
        fi
        cat "$REPLAY_DIR/ping.txt"; exit "$(cat "$REPLAY_DIR/ping.rc")" ;;
  update) [ -f "$REPLAY_DIR/refuse" ] && { echo "Access/permission denied" >&2; exit 1; }
          exit 0 ;;
  --version) echo "slurm-wlm 22.05.8"; exit 0 ;;
esac
exit 2
"""

SQUEUE = """#!/bin/sh
printf 'squeue %s\\n' "$*" >> "$REPLAY_DIR/calls"
cat "$REPLAY_DIR/squeue.json"
"""


class Replay:
    """A bin dir whose scontrol/squeue answer with the files this object is told to serve."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir(parents=True)
        for name, text in (("scontrol", SCONTROL), ("squeue", SQUEUE)):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        self.env = {"PATH": f"{self.bin}:/usr/bin:/bin", "REPLAY_DIR": str(root)}
        self.ping("scontrol_ping_22.05_up.txt")
        self.squeue("squeue_22.05_running_and_done.json")

    def ping(self, fixture: str, rc: int | None = None) -> None:
        """Serve ``fixture`` for `scontrol ping` (rc 1 for a DOWN fixture unless given)."""
        text = (FIXTURES / fixture).read_text()
        (self.root / "ping.txt").write_text(text)
        (self.root / "ping.rc").write_text(str(rc if rc is not None else int("DOWN" in text)))

    def squeue(self, fixture: str | None = None, text: str | None = None) -> None:
        """Serve a fixture (or ``text``) for `squeue --json`."""
        body = text if text is not None else (FIXTURES / str(fixture)).read_text()
        (self.root / "squeue.json").write_text(body)

    def hang(self, on: bool = True) -> None:
        """Make `scontrol ping` hang (a slurmctld that never answers)."""
        flag = self.root / "hang"
        flag.touch() if on else flag.unlink(missing_ok=True)

    def refuse_updates(self) -> None:
        (self.root / "refuse").touch()

    def hung_pid(self) -> int:
        """The pid of the last hung `scontrol ping`."""
        return int((self.root / "hang.pid").read_text())

    def calls(self) -> list[str]:
        path = self.root / "calls"
        return path.read_text().splitlines() if path.exists() else []


def env_file(name: str) -> dict[str, str]:
    """A recorded job environment (KEY=VALUE lines) from the fixtures."""
    lines = (FIXTURES / name).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@contextlib.asynccontextmanager
async def losses(home: SlurmHome) -> AsyncIterator[list[str]]:
    """The reasons ``home`` delivers to its scope-loss handler while the block runs.

    Delivery runs on its own task; every loss of a Slurm job must remove its grants.
    """
    delivered: list[str] = []

    async def on_lost(reason: str, removes_grants: bool) -> None:
        assert removes_grants, "a Slurm job's end must remove its grants"
        delivered.append(reason)

    home.on_scope_lost(on_lost)
    delivery = asyncio.create_task(home.scope_loss.run())
    try:
        yield delivered
    finally:
        for _ in range(20):
            await asyncio.sleep(0)
        delivery.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await delivery
