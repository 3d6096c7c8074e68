"""GroupSync: a Clone's record is durable before its answer, with one fsync shared by the
records written before it began, run off the event loop (which goes on meanwhile); a record
written while an fsync runs waits for the next; a failed fsync reaches every waiter."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from pathlib import Path

import pytest

from slurm_fiber.core.audit import AuditLog
from slurm_fiber.core.group_sync import GroupSync
from tests.core.processkit import aio


class Disk:
    """os.fsync as the audit log calls it: counted, and held until ``release`` when
    ``hold`` is set (the loop must not be blocked meanwhile), or failing when ``fail``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.hold = False
        self.fail = False
        self.entered = threading.Event()
        self.released = threading.Event()
        real = os.fsync

        def fsync(fd: int) -> None:
            self.calls += 1
            self.entered.set()
            if self.hold:
                assert self.released.wait(10)
            if self.fail:
                raise OSError(errno.EIO, "Input/output error")
            real(fd)

        monkeypatch.setattr("slurm_fiber.core.audit.os.fsync", fsync)


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Disk:
    return Disk(monkeypatch)


def observe(log: AuditLog, n: int) -> int:
    """One record written as a Clone's is (in the file, its fsync left to GroupSync)."""
    return log.write_many([("clone", {"n": n})], durable=False)


@aio
async def test_records_written_before_an_fsync_share_it(tmp_path: Path, disk: Disk) -> None:
    log = AuditLog(tmp_path / "audit.jsonl", "always")
    group = GroupSync(log)
    last = max(observe(log, n) for n in range(3))
    assert disk.calls == 0 and log.synced_seq < last
    await asyncio.gather(group.durable(), group.durable(), group.durable())
    assert disk.calls == 1 and log.synced_seq == last and not log.unsynced
    await group.durable()  # nothing new: no fsync
    assert disk.calls == 1


@aio
async def test_the_loop_runs_while_the_fsync_does_and_a_later_record_waits_for_the_next(
        tmp_path: Path, disk: Disk) -> None:
    log = AuditLog(tmp_path / "audit.jsonl", "always")
    group = GroupSync(log)
    first = observe(log, 1)
    disk.hold = True
    waiting = asyncio.ensure_future(group.durable())
    await asyncio.get_running_loop().run_in_executor(None, disk.entered.wait, 10)
    second = observe(log, 2)  # the loop is free: it writes while the disk works
    later = asyncio.ensure_future(group.durable())
    await asyncio.sleep(0.05)
    assert not waiting.done() and not later.done() and disk.calls == 1
    disk.released.set()
    await waiting
    assert log.synced_seq >= first
    await later
    assert disk.calls == 2 and log.synced_seq == second


@aio
async def test_a_failed_fsync_reaches_every_waiter_and_the_records_still_wait(
        tmp_path: Path, disk: Disk) -> None:
    log = AuditLog(tmp_path / "audit.jsonl", "always")
    group = GroupSync(log)
    last = observe(log, 1)
    disk.fail = True
    results = await asyncio.gather(group.durable(), group.durable(), return_exceptions=True)
    assert all(isinstance(r, OSError) and r.errno == errno.EIO for r in results)
    assert disk.calls == 1 and log.unsynced and log.synced_seq < last
    disk.fail = False
    await group.durable()
    assert log.synced_seq == last and disk.calls == 2


@pytest.mark.parametrize("policy", ["never", "interval"])
@aio
async def test_other_policies_wait_for_nothing(tmp_path: Path, disk: Disk, policy: str) -> None:
    log = AuditLog(tmp_path / "audit.jsonl", policy, interval=3600)
    observe(log, 1)
    await GroupSync(log).durable()
    assert disk.calls == 0
