"""No fiber without its audit record, and an audit log nobody else can aim or forge.

Attacks and faults (issue 13, items 3, 5 and 8): ``mallory`` plants a
symlink, a FIFO or her own file where the audit log goes; the state dir's
file system fills up (a real tmpfs) while Clones come in; a claim carries a
newline and terminal escapes into the text view of ``slurm-fiber audit``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_fiber.client.connection import FiberdClient, Missed
from slurm_fiber.core.audit.log import AuditLog, AuditUnsafe
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.trust.grant import ScopeClaim
from tests.cli.commandkit import BIN, env, flags
from tests.core.processkit import marked_procs
from tests.core.runtime.conftest import site
from tests.core.runtime.fiberdkit import Site, fiberd_in_thread
from tests.security.userkit import JobUser, as_user

__all__ = ["site"]


@pytest.mark.parametrize("plant", ["symlink", "fifo", "her file"])
def test_a_planted_audit_log_is_refused_and_its_target_untouched(
        tmp_path: Path, public: Path, mallory: JobUser, plant: str) -> None:
    secret = tmp_path / "root-only"  # a root-only file she would like root to write into
    secret.write_text("root's own data\n")
    secret.chmod(0o600)
    hers = public / "hers"
    log = hers / "audit.jsonl"
    make = {"symlink": f"ln -s {secret} {log}", "fifo": f"mkfifo -m 0666 {log}",
            "her file": f"touch {log} && chmod 0666 {log}"}[plant]
    as_user(mallory, f"mkdir -m 0777 {hers} && {make}")
    with pytest.raises(AuditUnsafe) as refused:
        AuditLog(log, "never").close()
    assert str(log) in str(refused.value) and "\n" not in str(refused.value)
    assert secret.read_text() == "root's own data\n"
    if plant == "her file":
        assert log.read_bytes() == b""


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str = "256k") -> Iterator[Path]:
    """A fresh tmpfs of ``size`` mounted (mode 0700) at ``where``; unmounted afterwards."""
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                           str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def fill(fs: Path) -> Path:
    """Write a file into ``fs`` until the file system refuses more (ENOSPC); its path."""
    filler = fs / "filler"
    with open(filler, "wb", buffering=0) as out:
        with contextlib.suppress(OSError):
            while True:
                out.write(b"\0" * 4096)
        with contextlib.suppress(OSError):
            while True:
                out.write(b"\0")
    return filler


def sleepers(mark: str) -> list[int]:
    """This test's live fibers running ``sleep``."""
    out = []
    for pid in marked_procs(mark):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == b"sleep":
                out.append(pid)
    return out


def until_sleeping(mark: str, pid: int) -> None:
    """Until the fiber ``pid`` has exec'd its ``sleep`` (a Clone answers before that)."""
    end = time.monotonic() + 20
    while pid not in sleepers(mark):
        assert time.monotonic() < end, f"fiber {pid} is not running sleep"
        time.sleep(0.02)


def clone_sleep(sock: Path) -> dict[str, object]:
    """Clone ``sleep 60`` with /dev/null as its stdio (no output files on the full disk)."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        with FiberdClient(sock) as client:
            return client.clone(grant="g1", exec={"argv": ["sleep", "60"]},
                                stdio={"stdin": null, "stdout": null, "stderr": null})
    finally:
        os.close(null)


def kill_and_wait(pid: int) -> None:
    fd = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGKILL)
        end = time.monotonic() + 20
        while pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
            assert time.monotonic() < end
            time.sleep(0.02)
    finally:
        os.close(fd)


def test_a_full_disk_starts_no_unaudited_fiber_and_fiberd_recovers(
        site: Site, tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "fs") as fs, \
            fiberd_in_thread(site, state_dir=str(fs), grantdir=str(site.grantdir)):
        sock = fs / "fiberd.sock"
        before = clone_sleep(sock)
        until_sleeping(site.mark, int(str(before["pid"])))
        filler = fill(fs)
        # The audit file's last page may still hold a few records: Clone until one cannot
        # be audited (each fiber that did get its record is killed right away).
        miss = None
        for _ in range(64):
            try:
                fiber = clone_sleep(sock)
            except Missed as err:
                miss = err
                break
            kill_and_wait(int(str(fiber["pid"])))
        assert miss is not None, "the audit log never filled up"
        assert miss.code == "audit_failed" and miss.retryable, miss.miss
        # the fiber it forked was killed, not left running; the one from before still runs
        assert sleepers(site.mark) == [int(str(before["pid"]))]
        with FiberdClient(sock) as client:  # and stopping it is never held back
            client.request("stop_fiber", fiber=before["id"], grace=0.1)
        assert sleepers(site.mark) == []
        with FiberdClient(sock) as client:
            status = client.request("status")
            assert status["fibers_running"] == 0
            assert client.request("list_fibers")["fibers"] == []

        filler.unlink()  # space returns: the same Clone now works
        fiber = clone_sleep(sock)
        until_sleeping(site.mark, int(str(fiber["pid"])))
        with FiberdClient(sock) as client:
            client.request("stop_fiber", fiber=fiber["id"], grace=0.1)
        audit = (fs / "audit.jsonl").read_bytes()

    assert audit.endswith(b"\n")
    records = [json.loads(line) for line in audit.splitlines()]  # every line whole
    seqs = [r["seq"] for r in records]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    clones = [r for r in records if r["event"] == "clone"]
    assert clones[-1]["fiber"] == fiber["id"]


def test_fiberd_refuses_to_start_on_a_full_disk_in_one_line(site: Site, tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "fs") as fs:
        fill(fs)
        argv = [str(BIN / "fiberd"),
                *flags(site, **{"state-dir": str(fs), "grantdir": str(site.grantdir)})]
        out = subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=60)
        assert out.returncode == 1, out.stderr
        assert "Traceback" not in out.stderr
        line = out.stderr.splitlines()[-1]
        assert line.startswith("fiberd: ") and "No space left on device" in line, out.stderr
        assert not (fs / "fiberd.sock").exists()


def test_control_characters_in_claims_are_escaped_in_the_text_view(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    forged = "2026-01-01T00:00:00.000Z 99      admit          root"
    log = AuditLog(path, "never", clock=FakeClock(),
                   scope=[ScopeClaim("job", "7\n" + forged)])
    log.write("admit", uid="g1\n" + forged, jti="j\x1b[2J\x1b[31m", reason="why\r\n" + forged)
    log.close()
    text = subprocess.run([str(BIN / "slurm-fiber"), "audit", "--path", str(path)],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    lines = text.splitlines()
    assert len(lines) == 2, text  # the header and the one record, nothing forged
    assert "\x1b" not in text and "\r" not in text
    assert "g1\\n2026" in lines[1] and "j\\u001b[2J" in lines[1]
    as_json = subprocess.run([str(BIN / "slurm-fiber"), "audit", "--json", "--path",
                              str(path)], capture_output=True, text=True, timeout=60,
                             check=True).stdout
    assert len(as_json.splitlines()) == 1
    assert json.loads(as_json)["uid"] == "g1\n" + forged
