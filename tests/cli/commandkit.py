"""The ``fiberd`` command as a test runs it: a real process for a runtime ``Site``.

``flags`` and ``env`` give fiberd's command line and a minimal environment for a site;
``fiberd`` starts the command and SIGKILLs it (with its process group) if the test leaves
it running; ``wait_socket`` and ``wait_ready`` wait for its socket and its first warm
template; ``start_long_fiber`` starts a 60 s exec fiber under grant ``g1``. Shared by the
command tests here and the runtime and security tests that need fiberd as a process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slurm_fiber.client.connection import FiberdClient
from tests.core.runtime.fiberdkit import AUDIENCE, Site

BIN = Path(sys.executable).parent

# Marked processes once a grant has run one exec fiber (e.g. ``start_long_fiber``): the
# template, its two spares and the fiber (spawned: it took none).
PROCESSES = 4

# A root fiberd names whom fibers run as (fiber_user); on this test host, root, said so.
ROOT_FIBER_USER = {"fiber-user": "root"} if os.geteuid() == 0 else {}
ROOT_OPT_IN = [f"--{k}={v}" for k, v in ROOT_FIBER_USER.items()]


def flags(site: Site, **over: str | None) -> list[str]:
    """fiberd's flags for ``site``; ``over`` adds or replaces options (value None: a bare
    switch such as ``strict-limits``)."""
    options = {"state-dir": str(site.state), "trust": f"site={site.jwks}",
               "audience": AUDIENCE, "poll-interval": "0.05", "grace": "0.3",
               "cgroup-root": "none", "audit-fsync": "never",
               **ROOT_FIBER_USER, **over}
    return [f"--{k}" if v is None else f"--{k}={v}" for k, v in options.items()]


def env() -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}


@contextlib.contextmanager
def fiberd(site: Site, options: dict[str, str | None] | None = None,
           **popen: Any) -> Iterator[subprocess.Popen[str]]:
    """A ``fiberd`` process for ``site`` (``options``: see ``flags``); SIGKILLed (with its
    group) if a test leaves it."""
    proc = subprocess.Popen([str(BIN / "fiberd"), *flags(site, **(options or {}))], env=env(),
                            text=True, start_new_session=True, **popen)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def wait_socket(site: Site, proc: subprocess.Popen[str], within: float = 20.0) -> Path:
    sock = site.state / "fiberd.sock"
    end = time.monotonic() + within
    while not sock.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < end, "fiberd did not listen in time"
        time.sleep(0.05)
    return sock


def wait_ready(sock: Path, within: float = 20.0) -> None:
    end = time.monotonic() + within
    while True:
        with FiberdClient(sock) as client:
            if client.request("ready")["ready"]:
                return
        assert time.monotonic() < end, "no template warmed in time"
        time.sleep(0.05)


def start_long_fiber(sock: Path) -> int:
    with FiberdClient(sock) as client:
        fiber = client.clone(grant="g1", exec={"argv": ["sleep", "60"]})
    return int(str(fiber["pid"]))
