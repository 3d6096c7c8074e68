"""The fiberd and fiberd-run commands as a user runs them: real processes, signals, exit codes."""

from __future__ import annotations

import signal
import subprocess

from tests.cli.commandkit import (
    BIN,
    PROCESSES,
    ROOT_OPT_IN,
    env,
    fiberd,
    flags,
    start_long_fiber,
    wait_ready,
    wait_socket,
)
from tests.core.processkit import marked_procs, wait_marked
from tests.core.runtime.fiberdkit import Site


def test_fiberd_refuses_to_start_without_trust_in_one_line(site: Site) -> None:
    out = subprocess.run([str(BIN / "fiberd"), f"--state-dir={site.state}", *ROOT_OPT_IN],
                         env=env(),
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
        # The template, its spares and the fiber (commandkit.PROCESSES).
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
