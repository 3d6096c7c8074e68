"""The template lifecycle alone (core/lifecycle.py): its table, pair by pair, and the data
that goes with each transition (backoff, warm error, last fault, restarts, retry_after)."""

from __future__ import annotations

import itertools

import pytest

from slurm_fiber.core.templates.lifecycle import (
    TABLE,
    Action,
    Backoff,
    Event,
    Lifecycle,
    Phase,
    TemplateState,
    WarmError,
    how,
    transition,
)

P, E, A = Phase, Event, Action
GIVE_UP = (A.DISMISS_SPARES, A.KILL_FIBERS, A.KILL_PROCESS)
GONE = (A.DISMISS_SPARES, A.FIBERS_LOST)

# Every (phase, event) pair: the phase after it and the actions, written out by hand.
# A pair absent from this dict must leave the phase alone and ask for nothing.
EXPECTED = {
    (P.WARMING, E.READY): (P.READY, (A.REFILL,)),
    (P.WARMING, E.WARM_FAILED): (P.WARM_FAILED, ()),
    (P.WARMING, E.STALLED): (P.REWARMING, GIVE_UP),
    (P.WARMING, E.EXITED): (P.WARM_FAILED, GONE),
    (P.WARMING, E.STOP): (P.STOPPING, ()),
    (P.READY, E.STALLED): (P.REWARMING, GIVE_UP),
    (P.READY, E.EXITED): (P.REWARMING, (*GONE, A.REWARM)),
    (P.READY, E.STOP): (P.STOPPING, ()),
    (P.WARM_FAILED, E.EXITED): (P.WARM_FAILED, GONE),
    (P.WARM_FAILED, E.STOP): (P.STOPPING, ()),
    (P.REWARMING, E.EXITED): (P.REWARMING, (*GONE, A.REWARM)),
    (P.REWARMING, E.SPAWNED): (P.WARMING, ()),
    (P.REWARMING, E.SPAWN_FAILED): (P.REWARMING, (A.REWARM,)),
    (P.REWARMING, E.STOP): (P.STOPPING, ()),
    (P.STOPPING, E.EXITED): (P.STOPPED, GONE),
    (P.STOPPING, E.STOPPED): (P.STOPPED, ()),
}


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(Phase, Event)),
                         ids=lambda v: str(v))
def test_every_transition(phase: Phase, event: Event) -> None:
    assert transition(phase, event) == EXPECTED.get((phase, event), (phase, ()))


def test_the_table_lists_nothing_the_expectations_do_not() -> None:
    assert set(TABLE) == set(EXPECTED)


def at(phase: Phase) -> Lifecycle:
    """A lifecycle driven into ``phase`` by events (on clock times 0, 1, ...)."""
    life = Lifecycle()
    paths = {P.WARMING: [], P.READY: [E.READY], P.WARM_FAILED: [E.WARM_FAILED],
             P.REWARMING: [E.READY, E.STALLED], P.STOPPING: [E.STOP],
             P.STOPPED: [E.STOP, E.STOPPED]}
    for now, event in enumerate(paths[phase]):
        life.on(event, float(now), "why")
    assert life.phase is phase
    return life


def test_ready_resets_the_backoff_and_measures_the_warm() -> None:
    life = Lifecycle(Backoff(initial=1, cap=8))
    life.on(E.SPAWNED, 10.0)
    life.on(E.READY, 12.5)
    life.on(E.EXITED, 20.0, status=-9)
    assert (life.shown, life.delay, life.last_fault) == (
        TemplateState.REWARMING, 1, "the template exited (signal 9 (SIGKILL))")
    assert life.retry_after(20.0) == pytest.approx(1 + 2.5)  # backoff left + the warm
    life.on(E.SPAWNED, 21.0)
    assert (life.shown, life.restarts) == (TemplateState.WARMING, 1)
    assert life.retry_after(22.0) == pytest.approx(1.5)  # the warm took 2.5 s last time
    life.on(E.EXITED, 22.0, status=1)  # died while warming: no re-warm
    assert life.shown is TemplateState.WARM_FAILED
    assert life.warm_error == WarmError("TemplateDied",
                                        "the template exited (1) before it was warm")


def test_the_backoff_doubles_to_its_cap_across_failed_starts_and_resets_on_ready() -> None:
    life = at(P.REWARMING)
    life.backoff = Backoff(initial=0.5, cap=2)
    life.on(E.EXITED, 5.0)
    delays = [life.delay]
    for _ in range(3):
        life.on(E.SPAWN_FAILED, 6.0, "no memory")
        delays.append(life.delay)
    assert delays == [0.5, 1, 2, 2]
    assert life.last_fault == "cannot start the template: no memory"
    assert life.restarts == 3
    life.on(E.SPAWNED, 7.0)
    life.on(E.READY, 8.0)
    assert life.backoff.peek() == 0.5


def test_a_stall_gives_up_and_says_why_and_later_reports_are_ignored() -> None:
    life = at(P.READY)
    assert life.on(E.STALLED, 3.0, "stopped for 10 s") == GIVE_UP
    assert life.last_fault == "stopped for 10 s"
    assert life.on(E.READY, 4.0) == () and life.shown is TemplateState.REWARMING
    assert life.on(E.STALLED, 4.0, "again") == () and life.last_fault == "stopped for 10 s"


def test_warm_failed_keeps_the_error_given() -> None:
    life = Lifecycle()
    error = WarmError("ImportError", "No module named x")
    life.on(E.WARM_FAILED, 1.0, warm_error=error)
    assert (life.shown, life.warm_error) == (TemplateState.WARM_FAILED, error)
    assert not life.ready


@pytest.mark.parametrize("phase", [P.WARMING, P.READY, P.WARM_FAILED, P.REWARMING])
def test_stopping_shows_the_state_it_stopped_from_until_stopped(phase: Phase) -> None:
    life = at(phase)
    shown = life.shown
    life.on(E.STOP, 9.0)
    assert (life.phase, life.shown, life.stopping, life.ready) == (
        P.STOPPING, shown, True, False)
    life.on(E.STOPPED, 10.0)
    assert life.shown is TemplateState.STOPPED


def test_only_ready_serves() -> None:
    assert [p for p in Phase if at(p).ready] == [P.READY]


@pytest.mark.parametrize(("code", "words"), [(0, "exit code 0"), (3, "exit code 3"),
                                             (-15, "signal 15 (SIGTERM)"),
                                             (-200, "signal 200")])
def test_how_a_process_ended_in_words(code: int, words: str) -> None:
    assert how(code) == words
