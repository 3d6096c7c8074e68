"""grantdir under churn: a concurrent writer thread adds, replaces and removes 1,000 files.

What "lost" means for a poller. A poller cannot see a content that lives
entirely between two polls, so the contract is: (1) every file content that
stays in place for at least one whole poll is delivered as GRANT_ADDED;
(2) GRANT_REMOVED only names a UID that was delivered and that no file holds
any more, so the delivered stream, replayed, never removes what is held;
(3) once the writer stops, one poll later the UIDs the stream leaves held
equal the UIDs the directory's files name, and nothing delivered names a UID
that was never written. Partial in-place writes may be reported as junk;
nothing else may be reported, and nothing crashes.
"""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

from slurm_fiber.core.clock import FakeClock
from slurm_fiber.homes import EventKind, GrantDir, GrantEvent, Problem
from tests.homes.homekit import confirmed, token, unverified_uid

OPS = 1000
NAMES = [f"f{i:03d}.jwt" for i in range(150)]
UIDS = [f"grant-{i:03d}" for i in range(80)]
STABLE_EVERY = 10  # every 10th write is held for two polls and must be delivered


class Polls:
    """A poll counter the writer can wait on."""

    def __init__(self) -> None:
        self.count = 0
        self.cond = threading.Condition()

    def done_one(self) -> None:
        with self.cond:
            self.count += 1
            self.cond.notify_all()

    def wait_two_more(self) -> None:
        with self.cond:
            target = self.count + 2  # the second one began after the write ended
            assert self.cond.wait_for(lambda: self.count >= target, timeout=30)


def write_in_place(path: Path, content: bytes, *, truncate: bool) -> None:
    """Write in two halves through one fd, so a poll can see the file half-written."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0)
    fd = os.open(path, flags, 0o644)
    try:
        half = len(content) // 2
        os.write(fd, content[:half])
        os.write(fd, content[half:])
    finally:
        os.close(fd)


def write_by_rename(path: Path, content: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(content)
    os.rename(tmp, path)


class Writer(threading.Thread):
    def __init__(self, root: Path, polls: Polls, seed: int) -> None:
        super().__init__(name="churn-writer")
        self.root = root
        self.polls = polls
        self.rng = random.Random(seed)
        self.present: dict[str, str] = {}  # name -> uid it holds
        self.must_deliver: list[bytes] = []
        self.written_uids: set[str] = set()
        self.counts = {"added": 0, "replaced": 0, "removed": 0}
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for op in range(OPS):
                content = self.step(op)
                if content is not None and op % STABLE_EVERY == 0:
                    self.polls.wait_two_more()
                    self.must_deliver.append(content)
        except BaseException as err:  # surfaced by the test
            self.error = err

    def step(self, op: int) -> bytes | None:
        name = self.rng.choice(NAMES)
        path = self.root / name
        if name in self.present and self.rng.random() < 0.35:
            path.unlink()
            del self.present[name]
            self.counts["removed"] += 1
            return None
        self.counts["replaced" if name in self.present else "added"] += 1
        same_size = name in self.present and self.rng.random() < 0.3
        uid = self.present[name] if same_size else self.rng.choice(UIDS)
        content = token(uid, f"op{op:06d}")  # same uid + same-width jti: same size
        if same_size:
            write_in_place(path, content, truncate=False)
        elif self.rng.random() < 0.5:
            write_by_rename(path, content)
        else:
            write_in_place(path, content, truncate=True)
        self.present[name] = uid
        self.written_uids.add(uid)
        return content


def test_churn_of_a_thousand_files_loses_nothing(tmp_path: Path, clock: FakeClock) -> None:
    tmp_path.chmod(0o755)
    problems: list[Problem] = []
    gd = GrantDir(tmp_path, clock, on_problem=problems.append)
    polls = Polls()
    writer = Writer(tmp_path, polls, seed=20261107)
    delivered: list[GrantEvent] = []
    held: set[str] = set()

    def poll() -> None:
        for event in gd.poll_each():
            delivered.append(event)
            if event.kind is EventKind.GRANT_ADDED:
                uid = confirmed(event)
                assert uid is not None
                held.add(uid)
            else:
                assert event.uid in held, f"removed {event.uid}, which was never delivered"
                held.discard(event.uid)
        polls.done_one()

    writer.start()
    while writer.is_alive():
        poll()
    writer.join()
    assert writer.error is None, writer.error
    poll()

    on_disk = {unverified_uid(p.read_bytes()) for p in tmp_path.glob("*.jwt")}
    assert on_disk == set(writer.present.values())
    assert held == on_disk == gd.uids(), "the final state equals the directory's"

    added = {e.token for e in delivered if e.kind is EventKind.GRANT_ADDED}
    missing = [c for c in writer.must_deliver if c not in added]
    assert not missing, f"{len(missing)} contents that stayed for a poll were never delivered"
    assert len(writer.must_deliver) >= OPS // STABLE_EVERY // 2

    named = {unverified_uid(e.token) for e in delivered if e.kind is EventKind.GRANT_ADDED}
    assert named <= writer.written_uids, "nothing delivered names a UID never written"
    assert {p.code for p in problems} <= {"junk"}, problems[:3]
    assert sum(writer.counts.values()) == OPS
    assert min(writer.counts.values()) > 100, writer.counts
    assert any(e.kind is EventKind.GRANT_REMOVED for e in delivered)
