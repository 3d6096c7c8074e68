"""The grant book's state file: atomic, 0600, reloads to the same decisions, refuses corruption."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from slurm_fiber.core.book.decisions import GrantBook, Start, TemplateView
from slurm_fiber.core.book.health import SourceHealth
from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.book.state import StateCorrupt, StateFile
from slurm_fiber.core.clock import FakeClock
from tests.core.bookkit import token

WARM = TemplateView.warm()


def new_book(clock: FakeClock, path: Path, boot: str = "boot-1") -> GrantBook:
    health = SourceHealth(clock, stale_after=10.0, control_plane=False)
    return GrantBook(clock, health, fence_ttl=None, store=StateFile(path, boot_id=boot))


def test_restart_changes_no_decision(tmp_path, clock):
    path = tmp_path / "state.json"
    book = new_book(clock, path)
    book.admit(token(clock, uid="kept", ttl=300, seconds=30))
    book.admit(token(clock, uid="gone", ttl=900))
    book.remove("gone")
    book.bump_epoch("test")
    again = new_book(clock, path)
    assert again.epoch == 1
    for uid in ("kept", "gone", "never"):
        assert again.decide_clone(uid, WARM, 0) == book.decide_clone(uid, WARM, 0)
    assert again.grants() == book.grants()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]  # no temp left


def test_epochs_are_never_reused_across_restarts(tmp_path, clock):
    path = tmp_path / "state.json"
    assert new_book(clock, path).bump_epoch("a") == 1
    assert new_book(clock, path).bump_epoch("b") == 2
    assert new_book(clock, path).epoch == 2


def test_a_denial_survives_a_restart(tmp_path, clock):
    path = tmp_path / "state.json"
    book = new_book(clock, path)
    book.admit(token(clock, ttl=900))
    book.remove("g1")
    outcome = new_book(clock, path).decide_clone("g1", WARM, 0)
    assert isinstance(outcome, Miss) and outcome.code is MissCode.DENIED


def test_another_boot_rebases_deadlines_from_unix_time(tmp_path, clock):
    path = tmp_path / "state.json"
    new_book(clock, path).admit(token(clock, ttl=300))
    after_reboot = FakeClock(wall=clock.wall() + 100, mono=5.0)  # boottime restarted
    book = new_book(after_reboot, path, boot="boot-2")
    assert book.grants()[0].lease_end.mono == 5.0 + 200
    s = book.decide_clone("g1", WARM, 0)
    assert isinstance(s, Start) and s.deadline.at == 205.0


@pytest.mark.parametrize("content", [
    b"", b"{not json", b"[]", b'{"format": "other"}',
    b'{"format": "slurm_fiber.grantbook/1", "epoch": -1}',
    b'{"format": "slurm_fiber.grantbook/1", "epoch": 1, "epoch_reason": "", "tokens": '
    b'{"u": [{"jti": "j", "iss": "i", "iat": 0, "expiry": [1, 2], "fiber": {"x": 1}}]}, '
    b'"denials": {}, "seen": {}}',
    b'{"format": "slurm_fiber.grantbook/1", "epoch": 1, "epoch_reason": "", "tokens": {}, '
    b'"denials": {"u": "soon"}, "seen": {}}',
])
def test_a_corrupt_state_file_refuses_to_start_naming_the_file(tmp_path, clock, content):
    path = tmp_path / "state.json"
    path.write_bytes(content)
    with pytest.raises(StateCorrupt) as err:
        new_book(clock, path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert path.read_bytes() == content  # never reset


def test_a_failed_save_makes_no_change(tmp_path, clock):
    book = new_book(clock, tmp_path / "state.json")
    book.bump_epoch("ok")
    book.store.path = tmp_path / "missing-dir" / "state.json"  # type: ignore[union-attr]
    with pytest.raises(OSError):
        book.bump_epoch("lost")
    with pytest.raises(OSError):
        book.admit(token(clock))
    assert book.epoch == 1 and book.grants() == []


def test_state_document_is_plain_json(tmp_path, clock):
    path = tmp_path / "state.json"
    new_book(clock, path).admit(token(clock, jti="j1"))
    doc = json.loads(path.read_text())
    assert doc["format"] == "slurm_fiber.grantbook/1" and doc["tokens"]["g1"][0]["jti"] == "j1"


def test_deferred_admissions_are_saved_together_and_not_before(tmp_path, clock):
    path = tmp_path / "state.json"
    book = new_book(clock, path)
    book.bump_epoch("start")  # a file to compare against
    for uid in ("a", "b", "c"):
        book.admit(token(clock, uid=uid, ttl=900), defer_save=True)
    assert book.unsaved and new_book(clock, path).grants() == []
    stamp, state = book.store.stamp(), book.take_unsaved()
    assert state is not None and not book.unsaved and book.take_unsaved() is None
    book.store.write(stamp, state)
    assert [g.uid for g in new_book(clock, path).grants()] == ["a", "b", "c"]


def test_a_failed_deferred_save_leaves_the_admission_unsaved(tmp_path, clock):
    book = new_book(clock, tmp_path / "gone" / "state.json")  # its directory is missing
    book.admit(token(clock, uid="a", ttl=900), defer_save=True)
    stamp, state = book.store.stamp(), book.take_unsaved()
    with pytest.raises(OSError):
        book.store.write(stamp, state)
    book.unsave()
    assert book.unsaved


def test_a_synchronous_save_carries_deferred_admissions(tmp_path, clock):
    path = tmp_path / "state.json"
    book = new_book(clock, path)
    book.admit(token(clock, uid="a", ttl=900), defer_save=True)
    book.bump_epoch("now")
    assert not book.unsaved
    assert [g.uid for g in new_book(clock, path).grants()] == ["a"]


def test_an_older_stamp_never_replaces_a_newer_state(tmp_path, clock):
    path = tmp_path / "state.json"
    book = new_book(clock, path)
    book.admit(token(clock, uid="a", ttl=900), defer_save=True)
    stamp, old = book.store.stamp(), book.take_unsaved()  # a worker thread's save, late
    book.remove("a")  # saved now, on the loop
    book.store.write(stamp, old)
    outcome = new_book(clock, path).decide_clone("a", WARM, 0)
    assert isinstance(outcome, Miss) and outcome.code is MissCode.DENIED
