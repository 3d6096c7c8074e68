"""Finding (issue 38, low): ``ready.json`` said ``ready: true`` after fiberd was SIGKILLed.

Anyone who may signal fiberd (its own user, root, the OOM killer) leaves a readiness
file that lies: a killed fiberd cannot take "ready" back. The file now names its
writer (pid, start time, boot) and ``read_ready`` (homes/readyfile.py), the reader for
this host, reads a document whose writer is gone as ``ready: false`` with ``stale``.
A real standalone fiberd process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

from slurm_fiber.homes.readyfile import read_ready
from tests.cli.commandkit import fiberd, wait_ready, wait_socket
from tests.core.runtime.fiberdkit import Site


def test_hostile_ready_after_sigkill_reads_not_ready(tmp_path: Path) -> None:
    site = Site(tmp_path, uuid.uuid4().hex)
    site.drop()
    ready = site.state / "ready.json"
    with fiberd(site, {"ready-file": str(ready)}, stderr=subprocess.DEVNULL) as proc:
        wait_ready(wait_socket(site, proc))
        end = time.monotonic() + 20
        while not json.loads(ready.read_text())["ready"]:
            assert time.monotonic() < end, "fiberd never published ready"
            time.sleep(0.05)
        alive = read_ready(ready)
        assert alive["ready"] is True and alive["pid"] == proc.pid, alive
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert json.loads(ready.read_text())["ready"] is True  # what the killed writer left
    seen = read_ready(ready)
    assert seen["ready"] is False, seen
    assert seen["stale"] == f"its writer (pid {proc.pid}) is gone"
