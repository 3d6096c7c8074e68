"""The stall rule alone (core/stall.py): what counts as a template that stopped answering,
and when to look again, as a pure function of what was seen and the time."""

from __future__ import annotations

import pytest

from slurm_fiber.core.templates.stall import Seen, gap, judge, look_every

BOUND, EVERY = 10.0, 1.0


def test_nothing_outstanding_and_running_is_never_a_stall() -> None:
    verdict = judge(Seen(), now=1e6, bound=BOUND, every=EVERY)
    assert verdict.reason is None and verdict.recheck == EVERY


def test_an_unanswered_request_is_a_stall_exactly_at_the_bound() -> None:
    before = judge(Seen(asked=100.0), now=109.75, bound=BOUND, every=EVERY)
    assert before.reason is None and before.recheck == pytest.approx(0.25)
    at = judge(Seen(asked=100.0), now=110.0, bound=BOUND, every=EVERY)
    assert at.reason is not None and "no answer to a request for 10.0 s" in at.reason
    assert "template_timeout 10 s" in at.reason


def test_a_stop_is_a_stall_once_it_lasted_the_bound() -> None:
    assert judge(Seen(stopped=50.0), now=59.9, bound=BOUND, every=EVERY).reason is None
    at = judge(Seen(stopped=50.0), now=60.0, bound=BOUND, every=EVERY)
    assert at.reason is not None and at.reason.startswith("stopped (SIGSTOP or a tracer)")


def test_the_request_is_named_when_both_fall_due_and_the_first_due_sets_the_recheck() -> None:
    both = judge(Seen(asked=0.0, stopped=0.0), now=10.0, bound=BOUND, every=EVERY)
    assert both.reason is not None and both.reason.startswith("no answer")
    early = judge(Seen(asked=5.0, stopped=1.0), now=10.5, bound=BOUND, every=EVERY)
    assert early.reason is None and early.recheck == pytest.approx(0.5)


def test_a_recheck_is_never_zero_or_negative() -> None:
    verdict = judge(Seen(asked=0.0), now=10.0 - 1e-9, bound=BOUND, every=EVERY)
    assert verdict.reason is None and verdict.recheck > 0


def test_looks_are_well_within_the_bound_and_at_most_once_a_second() -> None:
    assert look_every(10.0) == 1.0
    assert look_every(1.0) == 0.25


def test_only_watched_time_counts_after_a_gap_in_the_looks() -> None:
    # fiberd was suspended with its job from 101 to 500: a request sent at 100 and a stop
    # seen at 100 count from 500, the first look after the gap.
    assert gap(last_look=101.0, now=500.0, every=EVERY)
    assert not gap(last_look=101.0, now=103.0, every=EVERY)
    seen = Seen(asked=100.0, stopped=100.0, watching=500.0)
    verdict = judge(seen, now=500.0, bound=BOUND, every=EVERY)
    assert verdict.reason is None and verdict.recheck == EVERY
    later = judge(seen, now=510.0, bound=BOUND, every=EVERY)
    assert later.reason is not None and "for 10.0 s" in later.reason
