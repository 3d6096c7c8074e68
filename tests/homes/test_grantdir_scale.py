"""A grantdir of 5,000 files (mostly junk, some valid grants) at scale: delivered
completely, each junk file refused once with its code and never read again while it
stays the same, and the scan gives the event loop a turn between its slices (a ticker
task on the loop advances while the scan runs). bench/grantdir.py prints the loop's lag.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.seam import EventKind
from slurm_fiber.homes import Problem
from slurm_fiber.homes import grantdir as grantdir_module
from slurm_fiber.homes.grantdir import SLICE, GrantDir
from tests.homes.homekit import confirmed, token

FILES = 5000
VALID_EVERY = 50  # every 50th file holds a valid grant: 100 grants, 4,900 junk files


def fill(root: Path) -> set[str]:
    """Write the 5,000 files, dated an hour ago (written earlier, settled); the valid UIDs."""
    root.chmod(0o700)
    past = time.time() - 3600
    uids: set[str] = set()
    for i in range(FILES):
        path = root / f"f{i:05d}.jwt"
        if i % VALID_EVERY == 0:
            path.write_bytes(token(f"g{i}"))
            uids.add(f"g{i}")
        else:
            path.write_bytes(b"not a token " * (i % 40 + 1))
        os.utime(path, (past, past))
    return uids


class Opens:
    """Counts the files of ``root`` opened for reading (it wraps the real os.open)."""

    def __init__(self, root: Path, real: Callable[..., int]) -> None:
        self.root, self.real, self.count = str(root), real, 0

    def __call__(self, path: str, *args: object, **kwargs: object) -> int:
        if str(path).startswith(self.root):
            self.count += 1
        return self.real(path, *args, **kwargs)


async def scan_with_ticker(gd: GrantDir) -> tuple[list[tuple[str, str]], int]:
    """One scan while a ticker task takes every turn the loop gives it; (events, ticks)."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    running = asyncio.ensure_future(ticker())
    await asyncio.sleep(0)
    before = ticks
    events = await gd.scan()
    during = ticks - before
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    return [(e.kind.value, e.uid or confirmed(e) or "") for e in events], during


def test_a_5000_file_grantdir_is_delivered_in_slices_and_junk_is_read_once(
        tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "grants"
    root.mkdir()
    uids = fill(root)
    problems: list[Problem] = []
    gd = GrantDir(root, clock, 1.0, on_problem=problems.append)
    opens = Opens(root, os.open)
    monkeypatch.setattr(grantdir_module.os, "open", opens)

    async def main() -> None:
        events, ticks = await scan_with_ticker(gd)
        assert sorted(events) == sorted(("grant_added", uid) for uid in uids)
        assert Counter(p.code for p in problems) == {"junk": FILES - len(uids)}
        assert len({p.subject for p in problems}) == FILES - len(uids)  # once per file
        assert opens.count == FILES
        # the loop ran other work between every two slices of the scan
        assert ticks >= FILES // SLICE - 1

        for _ in range(2):  # unchanged: nothing delivered, reported or read again
            again, _ = await scan_with_ticker(gd)
            assert again == []
        assert len(problems) == FILES - len(uids) and opens.count == FILES

        (root / "f00001.jwt").write_bytes(token("late"))  # junk turned into a grant
        (root / "f00000.jwt").unlink()  # a grant withdrawn
        changed, _ = await scan_with_ticker(gd)
        assert sorted(changed) == [("grant_added", "late"), ("grant_removed", "g0")]
        assert opens.count == FILES + 1 and len(problems) == FILES - len(uids)

    asyncio.run(main())


def test_a_same_size_rewrite_that_keeps_its_mtime_is_read_again(
        tmp_path: Path, clock: FakeClock) -> None:
    """Remembering a file's stat signature never hides a rewrite: the new content of a
    same-size rewrite whose mtime is set back (touch -r) is delivered."""
    root = tmp_path / "grants"
    root.mkdir(mode=0o700)
    path = root / "a.jwt"
    path.write_bytes(token("alpha", jti="j1"))
    gd = GrantDir(root, clock, 1.0, on_problem=lambda p: None)
    assert [e.kind for e in gd.poll()] == [EventKind.GRANT_ADDED]
    stamp = path.stat().st_mtime_ns
    path.write_bytes(token("alpha", jti="j2"))  # same size, new content
    os.utime(path, ns=(stamp, stamp))
    assert [e.kind for e in gd.poll()] == [EventKind.GRANT_ADDED]
