"""The fiberd and fiberd-run commands as a user runs them: real processes, signals, exit codes."""

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

from slurm_fiber.core.api.client import FiberdClient
from tests.core.processkit import marked_procs, wait_marked
from tests.core.runtime.fiberdkit import AUDIENCE, Site

BIN = Path(sys.executable).parent


def flags(site: Site, **over: str | None) -> list[str]:
    """fiberd's flags for ``site``; ``over`` adds or replaces options (value None: a bare
    switch such as ``strict-limits``)."""
    options = {"state-dir": str(site.state), "trust": f"site={site.jwks}",
               "audience": AUDIENCE, "poll-interval": "0.05", "grace": "0.3",
               "cgroup-root": "none", "audit-fsync": "never", **over}
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


PROCESSES = 5  # marked, once a grant has run one exec fiber (see the first test below)


def start_long_fiber(sock: Path) -> int:
    with FiberdClient(sock) as client:
        fiber = client.clone(grant="g1", exec={"argv": ["sleep", "60"]})
    return int(str(fiber["pid"]))


def test_fiberd_refuses_to_start_without_trust_in_one_line(site: Site) -> None:
    out = subprocess.run([str(BIN / "fiberd"), f"--state-dir={site.state}"], env=env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and "no issuer is trusted" in out.stderr
    bad = subprocess.run([str(BIN / "fiberd"), "--grace=soon"], env=env(),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "grace (from --grace)" in bad.stderr
    assert "Traceback" not in out.stderr + bad.stderr
    usage = subprocess.run([str(BIN / "fiberd"), "--no-such-flag"], env=env(),
                           capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2


def test_sigterm_stops_fibers_and_templates_and_removes_the_socket(site: Site) -> None:
    site.drop()
    with fiberd(site, stderr=subprocess.PIPE) as proc:
        sock = wait_socket(site, proc)
        wait_ready(sock)
        start_long_fiber(sock)
        # The template, its spare, the fiber, and since the grant has run an exec fiber, the
        # stub maker and an idle exec stub.
        assert len(wait_marked(site.mark, PROCESSES)) == PROCESSES
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not sock.exists() and not marked_procs(site.mark)
        assert "fiberd stopped: stop requested" in proc.stderr.read()  # type: ignore[union-attr]


def test_a_sigkilled_fiberd_leaves_no_template_or_fiber(site: Site) -> None:
    site.drop()
    with fiberd(site, stderr=subprocess.DEVNULL) as proc:
        sock = wait_socket(site, proc)
        wait_ready(sock)
        start_long_fiber(sock)
        assert len(wait_marked(site.mark, PROCESSES)) == PROCESSES
        proc.kill()  # fiberd alone: its templates and fibers must follow by themselves
        proc.wait(10)
        assert wait_marked(site.mark, 0, within=10) == []


def test_fiberd_run_runs_the_command_as_a_fiber_and_exits_with_its_status(site: Site) -> None:
    site.drop()
    out = subprocess.run([str(BIN / "fiberd-run"), "--home", "standalone", *flags(site), "--",
                          "sh", "-c", "echo out-$SF_TEST_MARK; exit 7"],
                         env=env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 7, out.stderr
    assert out.stdout.strip() == f"out-{site.mark}"
    assert not marked_procs(site.mark) and not (site.state / "fiberd.sock").exists()


def test_fiberd_run_without_a_grant_gives_up_after_the_warm_timeout(site: Site) -> None:
    # --standalone, the deprecated spelling of --home standalone, still works and says so
    out = subprocess.run([str(BIN / "fiberd-run"), "--standalone", "--warm-timeout=1",
                          *flags(site), "--", "true"],
                         env=env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "no grant template warmed within 1 s" in out.stderr
    assert "fiberd-run: --standalone is deprecated; use --home standalone" in out.stderr
