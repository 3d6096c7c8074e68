"""The audit fsync helper (core/audit_syncer.py), a real helper process: callers waiting at
once share fsyncs (one under way, the rest on the next), a failed fsync reaches each caller
of its round, a helper that dies or is closed leaves fsyncs on the loop, and it ends with
fiberd."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from slurm_fiber.core.audit.syncer import AuditSyncer
from tests.core.processkit import aio


def asks_counted(syncer: AuditSyncer) -> list[int]:
    """Count the fsyncs ``syncer`` asks its helper for."""
    asked = [0]
    ask = syncer._ask

    def counting() -> None:
        asked[0] += 1
        ask()

    syncer._ask = counting  # type: ignore[method-assign]
    return asked


@aio
async def test_callers_waiting_at_once_share_two_fsyncs(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "audit.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    syncer = AuditSyncer(fd, sys.executable)
    asked = asks_counted(syncer)
    try:
        os.write(fd, b"{}\n")
        await syncer.synced()
        assert asked[0] == 1
        await asyncio.gather(*(syncer.synced() for _ in range(20)))
        assert asked[0] == 3  # the first of them asked; the other 19 shared the next fsync
    finally:
        syncer.close()
        os.close(fd)


@aio
async def test_a_failed_fsync_reaches_its_callers(tmp_path: Path) -> None:
    read, write = os.pipe()  # fsync of a pipe fails (EINVAL)
    syncer = AuditSyncer(write, sys.executable)
    try:
        results = await asyncio.gather(syncer.synced(), syncer.synced(),
                                       return_exceptions=True)
        assert [type(r) for r in results] == [OSError, OSError]
        assert all(isinstance(r, OSError) and r.errno == errno.EINVAL for r in results)
    finally:
        syncer.close()
        os.close(read)
        os.close(write)


@contextlib.asynccontextmanager
async def helped(tmp_path: Path) -> AsyncIterator[tuple[AuditSyncer, subprocess.Popen[bytes]]]:
    """A syncer of a new log whose helper has answered once, and that helper; closed after."""
    fd = os.open(tmp_path / "audit.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    syncer = AuditSyncer(fd, sys.executable)
    try:
        await syncer.synced()
        assert syncer._proc is not None
        yield syncer, syncer._proc
    finally:
        syncer.close()
        os.close(fd)


@aio
async def test_a_dead_helper_leaves_fsyncs_on_the_loop(tmp_path: Path) -> None:
    async with helped(tmp_path) as (syncer, proc):
        proc.kill()
        proc.wait()
        await asyncio.wait_for(syncer.synced(), 10)  # its end is seen; the fsync made here
        assert syncer._proc is None
        await syncer.synced()


@aio
async def test_close_stops_the_helper_and_later_fsyncs_stay_here(tmp_path: Path) -> None:
    async with helped(tmp_path) as (syncer, proc):
        syncer.close()
        assert proc.returncode is not None
        await syncer.synced()


@aio
async def test_a_caller_waits_for_its_fsync_a_bounded_time(tmp_path: Path) -> None:
    async with helped(tmp_path) as (syncer, proc):
        os.kill(proc.pid, signal.SIGSTOP)  # a helper that stops answering (a stalled disk)
        with pytest.raises(OSError) as stalled:
            await syncer.synced(within=0.2)
        assert stalled.value.errno == errno.ETIMEDOUT
        os.kill(proc.pid, signal.SIGCONT)
        await asyncio.wait_for(syncer.synced(), 10)  # it answers again


HOLDER = """
import asyncio, os, sys
from slurm_fiber.core.audit.syncer import AuditSyncer
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
syncer = AuditSyncer(fd, sys.executable)
asyncio.run(syncer.synced())
print(syncer._proc.pid, flush=True)
os.kill(os.getpid(), 9)  # fiberd dies without closing it
"""


def test_the_helper_ends_when_fiberd_dies(tmp_path: Path) -> None:
    holder = subprocess.run([sys.executable, "-c", HOLDER, str(tmp_path / "audit.jsonl")],
                            capture_output=True, text=True, timeout=30)
    assert holder.returncode == -signal.SIGKILL, holder.stderr
    helper = int(holder.stdout.split()[0])
    for _ in range(100):
        try:
            os.kill(helper, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{helper}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return  # exited; its parent's parent reaps it
        time.sleep(0.05)
    pytest.fail(f"the fsync helper {helper} outlived its fiberd")
