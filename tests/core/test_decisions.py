"""GrantBook decisions on a fake clock: every miss row, leases, denials, epochs, fences."""

from __future__ import annotations

import pytest

from slurm_fiber.core.book.decisions import (
    Admitted,
    DeadlineCause,
    GrantBook,
    Start,
    TemplateView,
    closed_miss,
    invalid_token_miss,
)
from slurm_fiber.core.book.health import SourceHealth
from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.clock import FakeClock
from slurm_fiber.core.trust.tokens import TokenReason, TokenRefused
from tests.core.bookkit import token

WARM = TemplateView.warm()


@pytest.fixture
def health(clock: FakeClock) -> SourceHealth:
    h = SourceHealth(clock, stale_after=10.0)
    h.mark_sync()
    return h


@pytest.fixture
def book(clock: FakeClock, health: SourceHealth) -> GrantBook:
    return GrantBook(clock, health, fence_ttl=60.0)


def miss(outcome: Start | Miss, code: MissCode) -> Miss:
    assert isinstance(outcome, Miss), outcome
    assert outcome.code is code, outcome
    assert outcome.reason and "\n" not in outcome.reason
    return outcome


def start(outcome: Start | Miss) -> Start:
    assert isinstance(outcome, Start), outcome
    return outcome


def test_admit_then_clone_starts_under_the_lease(book, clock):
    admitted = book.admit(token(clock, ttl=30))
    assert isinstance(admitted, Admitted) and admitted.new_grant
    s = start(book.decide_clone("g1", WARM, running=0))
    assert (s.uid, s.epoch, s.started) == ("g1", 0, clock.mono())
    assert s.deadline.at == clock.mono() + 30 and s.deadline.cause is DeadlineCause.LEASE


def test_row_denied_until_every_seen_token_expired(book, clock):
    book.admit(token(clock, ttl=100, jti="a"))
    book.admit(token(clock, ttl=500, jti="b"))
    removed = book.remove("g1")
    assert removed.jtis == ("a", "b") and removed.until == clock.wall() + 500
    m = miss(book.decide_clone("g1", WARM, 0), MissCode.DENIED)
    assert m.until == clock.wall() + 500 and m.retryable and m.retry_after == 500
    clock.advance(499)
    miss(book.decide_clone("g1", WARM, 0), MissCode.DENIED)
    clock.advance(1)
    book.health.mark_sync()
    miss(book.decide_clone("g1", WARM, 0), MissCode.UNKNOWN_GRANT)


def test_a_token_offered_while_denied_is_refused_and_stretches_the_denial(book, clock):
    book.admit(token(clock, ttl=100, jti="a"))
    book.remove("g1")
    m = miss(book.admit(token(clock, ttl=900, jti="late")), MissCode.DENIED)
    assert m.until == clock.wall() + 900
    assert book.denied_until("g1").wall == clock.wall() + 900  # type: ignore[union-attr]


def test_lift_on_redelivery(book, clock):
    book.admit(token(clock, jti="a"))
    book.remove("g1")
    assert book.lift("g1") is True and book.lift("g1") is False
    assert isinstance(book.admit(token(clock, jti="a")), Admitted)
    start(book.decide_clone("g1", WARM, 0))


def test_remove_without_live_tokens_denies_nothing(book, clock):
    removed = book.remove("never-seen")
    assert removed.until is None and removed.jtis == ()


def test_row_unknown_grant_vs_source_stale(clock):
    health = SourceHealth(clock, stale_after=10.0)
    book = GrantBook(clock, health)
    m = miss(book.decide_clone("nope", WARM, 0), MissCode.SOURCE_STALE)  # never synced
    assert m.retryable and m.retry_after
    health.mark_sync()
    assert not miss(book.decide_clone("nope", WARM, 0), MissCode.UNKNOWN_GRANT).retryable
    clock.advance(10)
    miss(book.decide_clone("nope", WARM, 0), MissCode.SOURCE_STALE)


def test_row_expired(book, clock, health):
    book.admit(token(clock, ttl=30))
    clock.advance(29)
    health.mark_sync()
    start(book.decide_clone("g1", WARM, 0))
    clock.advance(1)
    assert not miss(book.decide_clone("g1", WARM, 0), MissCode.EXPIRED).retryable
    assert book.expired_uids() == ["g1"]


def test_row_fenced_by_control_plane_silence(book, clock, health):
    book.admit(token(clock, ttl=3600))
    s = start(book.decide_clone("g1", WARM, 0))
    assert s.deadline.at == clock.mono() + 60 and s.deadline.cause is DeadlineCause.FENCE
    clock.advance(59)
    start(book.decide_clone("g1", WARM, 0))
    clock.advance(1)
    assert miss(book.decide_clone("g1", WARM, 0), MissCode.FENCED).retryable
    health.mark_sync()  # the control plane answers again: the fence moves on
    assert start(book.decide_clone("g1", WARM, 0)).deadline.at == clock.mono() + 60


def test_never_synced_control_plane_fences_admitted_grants(clock):
    book = GrantBook(clock, SourceHealth(clock, stale_after=10.0), fence_ttl=60.0)
    book.admit(token(clock))
    miss(book.decide_clone("g1", WARM, 0), MissCode.FENCED)


class TickingClock(FakeClock):
    """A clock that moves a microsecond at every monotonic reading, as a real one does."""

    def mono(self) -> float:
        self.advance(1e-6)
        return super().mono()


def test_never_synced_fences_however_the_clock_moves_between_readings():
    """A Clone read ``now`` before the fence: a never-synced fence must still be over then
    (it once read as "now" a moment later, so the Clone started a fiber already due)."""
    clock = TickingClock()
    book = GrantBook(clock, SourceHealth(clock, stale_after=10.0), fence_ttl=60.0)
    book.admit(token(clock))
    fenced = miss(book.decide_clone("g1", WARM, 0), MissCode.FENCED)
    assert "has not answered since fiberd started" in fenced.reason and fenced.retryable
    assert book.fenced_now()


def test_no_control_plane_means_no_silence_fence(clock):
    book = GrantBook(clock, SourceHealth(clock, 10.0, control_plane=False), fence_ttl=60.0)
    book.admit(token(clock, ttl=3600))
    clock.advance(1000)
    assert start(book.decide_clone("g1", WARM, 0)).deadline.cause is DeadlineCause.LEASE


def test_rows_cold_warm_failed_capacity(book, clock):
    book.admit(token(clock, fibers=2))
    cold = miss(book.decide_clone("g1", TemplateView.cold(2.5), 0), MissCode.COLD)
    assert cold.retry_after == 2.5
    assert miss(book.decide_clone("g1", TemplateView.absent(), 0), MissCode.COLD).retry_after
    failed = miss(book.decide_clone("g1", TemplateView.failed("ImportError"), 0),
                  MissCode.WARM_FAILED)
    assert failed.detail == "ImportError" and not failed.retryable
    start(book.decide_clone("g1", WARM, 1))
    assert miss(book.decide_clone("g1", WARM, 2), MissCode.CAPACITY).retryable


def test_rows_closed_and_invalid_token_constructors():
    assert closed_miss().code is MissCode.CLOSED and not closed_miss().retryable
    m = invalid_token_miss(TokenRefused(TokenReason.EXPIRED, "expired 3 s ago"))
    assert (m.code, m.detail, m.retryable) == (MissCode.INVALID_TOKEN, "expired", False)


def test_miss_order_follows_the_table(clock):
    health = SourceHealth(clock, stale_after=10.0)
    book = GrantBook(clock, health, fence_ttl=60.0)
    failed = TemplateView.failed("boom")
    book.admit(token(clock, ttl=100, fibers=1))
    # fenced (never synced) beats cold/warm_failed/capacity
    miss(book.decide_clone("g1", failed, 5), MissCode.FENCED)
    health.mark_sync()
    miss(book.decide_clone("g1", TemplateView.cold(), 5), MissCode.COLD)
    miss(book.decide_clone("g1", failed, 5), MissCode.WARM_FAILED)
    clock.advance(100)
    miss(book.decide_clone("g1", failed, 5), MissCode.EXPIRED)  # expired beats fenced
    book.remove("g2")
    book.admit(token(clock, uid="g3", ttl=50))
    book.remove("g3")
    miss(book.decide_clone("g3", failed, 5), MissCode.DENIED)  # denied beats stale


def test_seconds_limit_and_deadline_causes(book, clock):
    book.admit(token(clock, ttl=3600, seconds=5))
    s = start(book.decide_clone("g1", WARM, 0))
    assert s.deadline.at == clock.mono() + 5 and s.deadline.cause is DeadlineCause.SECONDS


def test_several_tokens_lease_ends_at_the_latest_exp(clock, health):
    book = GrantBook(clock, health)  # no silence fence: the lease alone binds
    book.admit(token(clock, ttl=100, jti="short"))
    second = book.admit(token(clock, ttl=50, jti="shorter"))
    assert isinstance(second, Admitted) and not second.new_grant
    assert second.lease_end.mono == clock.mono() + 100
    book.admit(token(clock, ttl=300, jti="long"))
    clock.advance(150)
    s = start(book.decide_clone("g1", WARM, 0))
    assert s.jti == "long" and s.deadline.at == clock.mono() + 150


def test_wall_clock_steps_do_not_move_an_admitted_lease(book, clock):
    book.admit(token(clock, ttl=100, jti="a"))
    end = book.grants()[0].lease_end.mono
    clock.step_wall(+10_000)  # NTP jumps forward: lease must not shorten
    start(book.decide_clone("g1", WARM, 0))
    clock.step_wall(-20_000)  # and back: lease must not lengthen
    book.admit(token(clock, ttl=100, jti="a"))  # same token redelivered after the step
    assert book.grants()[0].lease_end.mono == end
    clock.advance(100)
    miss(book.decide_clone("g1", WARM, 0), MissCode.EXPIRED)


def test_epochs_revoke_older_fences(book, clock):
    book.admit(token(clock, ttl=3600))
    s = start(book.decide_clone("g1", WARM, 0))
    assert book.deadline("g1", s.epoch, s.started) == s.deadline
    assert book.bump_epoch("scope lost") == 1 and book.epoch == 1
    d = book.deadline("g1", s.epoch, s.started)
    assert (d.at, d.cause) == (clock.mono(), DeadlineCause.REVOKED)
    assert start(book.decide_clone("g1", WARM, 0)).epoch == 1


def test_live_deadline_follows_renewals_syncs_and_removal(book, clock, health):
    book.admit(token(clock, ttl=30, jti="a"))
    s = start(book.decide_clone("g1", WARM, 0))
    assert book.deadline("g1", 0, s.started).cause is DeadlineCause.LEASE
    book.admit(token(clock, ttl=3600, jti="b"))  # renewal: now the fence binds
    clock.advance(20)
    health.mark_sync()
    d = book.deadline("g1", 0, s.started)
    assert (d.at, d.cause) == (clock.mono() + 60, DeadlineCause.FENCE)
    book.remove("g1")
    assert book.deadline("g1", 0, s.started).cause is DeadlineCause.REMOVED


def test_admitting_an_already_expired_token_is_invalid(book, clock):
    vt = token(clock, ttl=10)
    clock.advance(10)
    assert miss(book.admit(vt), MissCode.INVALID_TOKEN).detail == "expired"


def test_prune_forgets_old_expired_grants_and_past_denials(book, clock):
    book.admit(token(clock, uid="a", ttl=10))
    book.admit(token(clock, uid="b", ttl=1000))
    book.admit(token(clock, uid="c", ttl=20))
    book.remove("c")
    clock.advance(30)
    assert book.prune(retain=60) == [] and book.expired_uids() == ["a"]
    clock.advance(60)
    assert book.prune(retain=60) == ["a"]
    assert [g.uid for g in book.grants()] == ["b"] and book.denied_until("c") is None


def test_one_grant_is_read_as_grants_lists_it(book, clock):
    book.admit(token(clock, uid="a", ttl=300))
    book.admit(token(clock, uid="b", ttl=300))
    assert book.grant("b") == next(g for g in book.grants() if g.uid == "b")
    assert book.grant("c") is None
    clock.advance(400)
    assert book.grant("a") is not None and book.grant("a").expired  # held until pruned
