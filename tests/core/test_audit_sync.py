"""Group commit (core/audit_sync.py): records appended without an fsync are durable once
``durable`` returns, concurrent waiters share fsyncs, a record written during an fsync gets
the next one, and a failed fsync reaches every waiter."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from pathlib import Path

import pytest

from slurm_fiber.core.audit import AuditEvent, AuditLog, AuditWriteFailed
from slurm_fiber.core.audit_sync import GroupCommit


class CountedLog(AuditLog):
    """A real log that counts its group fsyncs and can hold the next one at a gate, after it
    has taken the records it covers (as a slow disk would)."""

    def __init__(self, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(path, "always")
        self.syncs = 0
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.fail: OSError | None = None  # what the next group fsync meets (a disk error)
        real = os.fsync

        def fsync(fd: int) -> None:
            if threading.current_thread() is not threading.main_thread():
                self.entered.set()
                if self.gate is not None:
                    assert self.gate.wait(10)
                self.syncs += 1
                if self.fail is not None:
                    raise self.fail
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)


@pytest.fixture
def gated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[CountedLog, GroupCommit]:
    """A counted log whose next group fsync waits at its gate, and its group commit."""
    log = CountedLog(tmp_path / "audit.jsonl", monkeypatch)
    log.gate = threading.Event()
    return log, GroupCommit(log)


def test_append_is_not_synced_under_always_until_sync(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl", "always")
    assert log.write(AuditEvent.ADMIT, uid="g") == log.synced == 1
    assert log.append_many([(AuditEvent.CLONE, {"fiber": "f1"})]) == 2
    assert log.synced == 1
    log.sync()
    assert log.synced == 2
    log.append_many([(AuditEvent.CLONE, {"fiber": "f2"})])
    log.write(AuditEvent.FIBER_EXIT, fiber="f1")  # an fsynced write covers what came before
    assert log.synced == log.seq == 4
    log.close()
    with pytest.raises(AuditWriteFailed, match="closed"):
        log.sync()


@pytest.mark.parametrize("policy", ["never", "interval"])
def test_append_is_as_durable_as_the_policy_asks_at_once(tmp_path: Path, policy: str) -> None:
    log = AuditLog(tmp_path / "audit.jsonl", policy)
    assert log.append_many([(AuditEvent.CLONE, {"fiber": "f1"})]) == log.synced == 1

    async def main() -> None:
        await GroupCommit(log).durable(1)  # returns at once: nothing to fsync

    asyncio.run(main())


def test_concurrent_waiters_share_fsyncs_and_all_end_durable(tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    log = CountedLog(tmp_path / "audit.jsonl", monkeypatch)
    commit = GroupCommit(log)

    async def one(i: int) -> int:
        seq = log.append_many([(AuditEvent.CLONE, {"fiber": f"f{i}"})])
        await commit.durable(seq)
        assert log.synced >= seq
        return seq

    async def main() -> list[int]:
        return await asyncio.gather(*(one(i) for i in range(50)))

    assert sorted(asyncio.run(main())) == list(range(1, 51))
    assert 1 <= log.syncs <= 2  # all 50 were written before the first fsync began
    assert log.synced == 50


def test_a_record_written_during_an_fsync_waits_for_the_next(
        gated: tuple[CountedLog, GroupCommit]) -> None:
    log, commit = gated

    async def main() -> None:
        first = asyncio.ensure_future(commit.durable(log.append_many([("a", {})])))
        await asyncio.to_thread(log.entered.wait, 10)  # the first fsync has begun
        second = asyncio.ensure_future(commit.durable(log.append_many([("b", {})])))
        await asyncio.sleep(0)
        assert not first.done() and not second.done()
        assert log.gate is not None
        log.gate.set()
        await first
        await second
        assert log.synced == 2 and log.syncs == 2

    asyncio.run(main())


def test_a_failed_fsync_reaches_every_waiter(
        gated: tuple[CountedLog, GroupCommit]) -> None:
    log, commit = gated

    async def main() -> None:
        seqs = [log.append_many([(AuditEvent.CLONE, {"fiber": f"f{i}"})]) for i in range(3)]
        waiters = [asyncio.ensure_future(commit.durable(s)) for s in seqs]
        await asyncio.to_thread(log.entered.wait, 10)
        log.fail = OSError(errno.EIO, "Input/output error")
        assert log.gate is not None
        log.gate.set()
        done = await asyncio.gather(*waiters, return_exceptions=True)
        assert all(isinstance(e, AuditWriteFailed) and "not synced" in str(e)
                   for e in done), done
        assert log.synced == 0
        log.fail = None  # the disk is back: the next waiter gets a new fsync
        await commit.durable(seqs[-1])
        assert log.synced == 3

    asyncio.run(main())
