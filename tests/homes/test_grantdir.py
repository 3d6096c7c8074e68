"""grantdir: real files in a real directory; every hostile case reported once, never fatal."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slurm_fiber.core.book.health import HealthState, SourceHealth
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.homes import MAX_TOKEN_BYTES, GrantDir, GrantDirRefused
from tests.homes.grantdirkit import Dir
from tests.homes.homekit import confirmed, token

NOBODY = 65534


@pytest.fixture
def d(tmp_path: Path, clock: FakeClock) -> Dir:
    tmp_path.chmod(0o755)
    return Dir(tmp_path, clock)


def test_new_changed_and_removed_files(d: Dir) -> None:
    (d.path / "a.jwt").write_bytes(token("alpha"))
    assert d.poll() == [("added", "alpha")]
    assert d.poll() == [], "unchanged: nothing"
    (d.path / "a.jwt").write_bytes(token("alpha", "j2"))  # same size, new content
    assert d.poll() == [("added", "alpha")]
    (d.path / "a.jwt").write_bytes(token("alpha", "j2"))  # same content rewritten
    assert d.poll() == []
    (d.path / "a.jwt").unlink()
    assert d.poll() == [("removed", "alpha")]
    assert d.problems == []


def test_a_uid_is_removed_only_when_no_file_holds_it(d: Dir) -> None:
    (d.path / "a.jwt").write_bytes(token("g", "1"))
    (d.path / "b.jwt").write_bytes(token("g", "2"))
    assert d.poll() == [("added", "g"), ("added", "g")]
    (d.path / "a.jwt").unlink()
    assert d.poll() == []
    (d.path / "b.jwt").write_bytes(token("h"))  # the file now holds another UID
    assert d.poll() == [("added", "h"), ("removed", "g")]
    assert d.gd.uids() == {"h"}


def test_rename_into_place_and_dot_and_foreign_names_are_never_read(d: Dir) -> None:
    tmp = d.path / ".a.jwt.tmp"
    tmp.write_bytes(token("alpha"))
    (d.path / ".hidden.jwt").write_bytes(token("hidden"))
    (d.path / "notes.txt").write_bytes(b"junk")
    assert d.poll() == []
    os.rename(tmp, d.path / "a.jwt")
    assert d.poll() == [("added", "alpha")]
    replacement = d.path / ".b"
    replacement.write_bytes(token("alpha", "j9"))
    os.rename(replacement, d.path / "a.jwt")
    assert d.poll() == [("added", "alpha")]
    assert d.problems == []


def test_junk_and_partial_files_are_reported_once_until_they_change(d: Dir) -> None:
    f = d.path / "a.jwt"
    full = token("alpha")
    f.write_bytes(full[:20])  # a write caught half-way
    assert d.poll() == []
    assert d.poll() == []
    assert d.codes() == ["junk"]
    f.write_bytes(b"\xff\xfe\x00 binary junk")
    assert d.poll() == []
    assert d.codes() == ["junk", "junk"]
    f.write_bytes(full)
    assert d.poll() == [("added", "alpha")]
    assert "JWT" in d.problems[-1].reason and d.problems[-1].subject.endswith(".jwt")
    # A JWT naming no valid UID is delivered: the grantdir reads no claims, the core's
    # verification refuses it, and the file holds no grant.
    (d.path / "nosub.jwt").write_bytes(token("", "x"))
    (d.path / "badsub.jwt").write_bytes(token("../../etc", "x"))
    assert d.poll() == [("added", "?"), ("added", "?")]
    assert d.codes() == ["junk", "junk"] and d.gd.uids() == {"alpha"}


def test_a_file_that_turns_bad_keeps_its_last_good_uid_until_deleted(d: Dir) -> None:
    f = d.path / "a.jwt"
    f.write_bytes(token("alpha"))
    assert d.poll() == [("added", "alpha")]
    f.write_bytes(b"")  # truncated by an in-place rewrite
    assert d.poll() == []
    assert d.gd.uids() == {"alpha"}
    f.unlink()
    assert d.poll() == [("removed", "alpha")]


def test_oversized_files_are_reported_not_read(d: Dir) -> None:
    big = d.path / "big.jwt"
    big.write_bytes(token("big", "x" * MAX_TOKEN_BYTES))
    assert d.poll() == []
    assert d.poll() == []
    assert d.codes() == ["oversized"]
    edge = d.path / "edge.jwt"
    body = token("edge")
    edge.write_bytes(body + b" " * (MAX_TOKEN_BYTES - len(body)))  # exactly 64 KiB
    assert d.poll() == [("added", "edge")]


def test_subdirectories_fifos_and_symlinks_are_reported_once(d: Dir, tmp_path: Path) -> None:
    (d.path / "dir.jwt").mkdir()
    os.mkfifo(d.path / "pipe.jwt")  # must not block the poll
    (d.path / "real.jwt").write_bytes(token("real"))
    (d.path / "link.jwt").symlink_to("real.jwt")
    assert d.poll() == [("added", "real")]
    assert d.poll() == []
    assert sorted(d.codes()) == ["not_a_file", "not_a_file", "symlink"]


def test_following_symlinks_refuses_ones_that_leave_the_directory(clock: FakeClock) -> None:
    with scratch_dirs(2) as (root, outside):
        (outside / "t.jwt").write_bytes(token("outside"))
        (root / "out.jwt").symlink_to(outside / "t.jwt")
        (root / "dangling.jwt").symlink_to(root / "missing")
        d = Dir(root, clock, follow_symlinks=True)
        assert d.poll() == []
        assert d.poll() == []
        assert sorted(d.codes()) == ["dangling", "symlink_escapes"]


def test_a_kubernetes_secret_rotation_yields_exactly_one_added(clock: FakeClock) -> None:
    with scratch_dirs(1) as (root,):
        def publish(stamp: str, jti: str) -> None:
            (root / stamp).mkdir()
            (root / stamp / "grant.jwt").write_bytes(token("kube", jti))
            (root / "..data_tmp").symlink_to(stamp)
            os.rename(root / "..data_tmp", root / "..data")  # the atomic swap

        publish("..2024_01", "one")
        (root / "grant.jwt").symlink_to("..data/grant.jwt")
        d = Dir(root, clock, follow_symlinks=True)
        assert d.poll() == [("added", "kube")]
        publish("..2024_02", "two")
        shutil.rmtree(root / "..2024_01")
        assert d.poll() == [("added", "kube")]
        assert d.poll() == []
        assert d.problems == []


@pytest.mark.machine_may_lack("root, to chown a file to another user")
def test_a_file_owned_by_a_stranger_is_reported(d: Dir) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to chown a file to another user")
    f = d.path / "a.jwt"
    f.write_bytes(token("alpha"))
    os.chown(f, NOBODY, NOBODY)
    assert d.poll() == []
    assert d.codes() == ["stranger"]


def test_an_unreadable_file_is_reported_once(clock: FakeClock) -> None:
    """Run as nobody when root, since root reads any file."""
    with scratch_dirs(1) as (root,):
        f = root / "a.jwt"
        f.write_bytes(token("alpha"))
        f.chmod(0)
        if os.geteuid() != 0:
            d = Dir(root, clock)
            assert d.poll() == [] and d.poll() == []
            assert d.codes() == ["unreadable"]
            return
        os.chown(root, NOBODY, NOBODY)
        os.chown(f, NOBODY, NOBODY)

        def poll_twice() -> object:
            d = Dir(root, clock)
            return d.poll() + d.poll(), d.codes()

        assert as_nobody(poll_twice) == repr(([], ["unreadable"]))


def as_nobody(work: Callable[[], object]) -> str:
    """``repr(work())`` computed in a child running as nobody (root reads anything)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child works as nobody and writes the repr of its answer back
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(write, repr(work()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as got:
        answer = got.read().decode()
    os.waitpid(pid, 0)
    return answer


def test_a_missing_or_unlistable_directory_marks_the_health_down_until_it_is_listed(
    clock: FakeClock, tmp_path: Path
) -> None:
    health = SourceHealth(clock, 60.0, control_plane=False)
    missing = Dir(tmp_path / "grants", clock, health=health)
    missing.gd.check_at_start()  # waited for, not refused
    assert missing.poll() == [] and missing.codes() == ["grantdir_missing"]
    reading = health.read()
    assert reading.state is HealthState.STALE and str(missing.path) in str(reading.down)
    missing.path.mkdir(mode=0o700)
    (missing.path / "a.jwt").write_bytes(token("alpha"))
    assert missing.poll() == [("added", "alpha")] and health.read().fresh
    if os.geteuid() != 0:
        pytest.skip("an unlistable directory needs a second user (root lists anything)")
    with scratch_dirs(1) as (root,):
        os.chown(root, NOBODY, NOBODY)
        root.chmod(0o300)  # its owner may enter and write it, not list it

        def down_then_up() -> object:
            seen = SourceHealth(clock, 60.0, control_plane=False)
            d = Dir(root, clock, health=seen)
            before = (d.poll(), d.codes(), seen.read().state.value, seen.read().down)
            root.chmod(0o700)
            return before, d.poll(), seen.read().state.value

        before, after, state = ast.literal_eval(as_nobody(down_then_up))
        assert before[:3] == ([], ["grantdir_unreadable"], "stale")
        assert "cannot be listed" in before[3] and (after, state) == ([], "fresh")


def test_a_directory_writable_by_others_is_refused(clock: FakeClock, tmp_path: Path) -> None:
    tmp_path.chmod(0o777)
    gd = GrantDir(tmp_path, clock)
    with pytest.raises(GrantDirRefused) as refused:
        gd.check()
    assert refused.value.code == "grantdir_writable"
    assert "chmod go-w" in refused.value.reason

    async def first() -> None:
        await anext(gd.events())

    with pytest.raises(GrantDirRefused):
        asyncio.run(first())
    tmp_path.chmod(0o775)
    with pytest.raises(GrantDirRefused, match="group or others"):
        gd.check()


def test_a_directory_owned_by_someone_else_or_missing_is_refused(
    clock: FakeClock, tmp_path: Path
) -> None:
    tmp_path.chmod(0o755)
    if os.geteuid() == 0:
        os.chown(tmp_path, NOBODY, NOBODY)  # root (us) or nobody's: refused
        gd = GrantDir(tmp_path, clock)
    else:
        gd = GrantDir(tmp_path, clock, owner=4242)
    with pytest.raises(GrantDirRefused) as refused:
        gd.check()
    assert refused.value.code == "grantdir_owner"
    assert "chown" in refused.value.reason
    with pytest.raises(GrantDirRefused) as missing:
        GrantDir(tmp_path / "nope", clock).check()
    assert missing.value.code == "grantdir_missing"
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(GrantDirRefused) as not_dir:
        GrantDir(tmp_path / "file", clock, owner=os.stat(tmp_path).st_uid).check()
    assert not_dir.value.code == "grantdir_not_dir"


def test_a_directory_that_turns_unsafe_is_reported_once_and_forgets_nothing(d: Dir) -> None:
    (d.path / "a.jwt").write_bytes(token("alpha"))
    assert d.poll() == [("added", "alpha")]
    d.path.chmod(0o777)
    (d.path / "a.jwt").unlink()
    assert d.poll() == [] and d.poll() == []
    assert d.codes() == ["grantdir_writable"]
    assert d.gd.uids() == {"alpha"}
    d.path.chmod(0o755)
    assert d.poll() == [("removed", "alpha")]


def test_events_poll_at_once_then_every_interval(d: Dir, clock: FakeClock) -> None:
    got: list[str] = []

    async def consume() -> None:
        async for ev in d.gd.events():
            confirmed(ev)  # as drive does once the core verified it
            got.append(ev.kind.value)

    async def main() -> None:
        (d.path / "a.jwt").write_bytes(token("alpha"))
        task = asyncio.create_task(consume())
        await clock.settle()
        assert got == ["grant_added"]
        (d.path / "a.jwt").unlink()
        await clock.advance_and_settle(1.9)
        assert got == ["grant_added"]
        await clock.advance_and_settle(0.1)
        assert got == ["grant_added", "grant_removed"]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


@contextlib.contextmanager
def scratch_dirs(n: int) -> Iterator[tuple[Path, ...]]:
    """N fresh 0755 directories outside pytest's 0700 tree (so nobody can reach them)."""
    paths = tuple(Path(tempfile.mkdtemp(prefix="grantdir-")) for _ in range(n))
    try:
        for p in paths:
            p.chmod(0o755)
        yield paths
    finally:
        for p in paths:
            shutil.rmtree(p, ignore_errors=True)
