"""A warm template's lifecycle, pure: a transition table with the re-warm backoff.

``Template`` (core/templates/parent.py) feeds a ``Lifecycle`` what happened to its
process (``Event``: started, said ready or warm_failed, stalled, exited, a
start that failed, a stop asked or done) with the time on the injected
clock, and gets back the ``Action``\\ s to take (refill spares, dismiss them,
kill the fibers or the process, tell the fibers their template is gone,
sleep the backoff and re-warm). It does no I/O and never blocks; the same
events at the same times always give the same state and actions. Every
(phase, event) pair has one entry in ``TABLE``; a pair not listed leaves the
phase as it is and asks for nothing (e.g. ``ready`` from a process already
given up on).

Phases are the public ``TemplateState``\\ s plus ``stopping`` (asked to stop,
not yet stopped), shown as the state it was stopped from until it is
``stopped``. ``rewarming`` covers both a process given up on (being killed)
and none at all (waiting out the backoff): in both, only its exit and a
(re)start count. The backoff doubles from 0.5 s to 30 s and is reset when a
warm succeeds.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass

_WARM_GUESS = 1.0  # seconds a warm is expected to take before one has been measured


class TemplateState(enum.StrEnum):
    """A template's state as fiberd shows it (status, the audit)."""

    WARMING = "warming"
    READY = "ready"
    WARM_FAILED = "warm_failed"
    REWARMING = "rewarming"
    STOPPED = "stopped"


class Phase(enum.StrEnum):
    """The lifecycle's own state: the public ones plus ``stopping``."""

    WARMING = "warming"
    READY = "ready"
    WARM_FAILED = "warm_failed"
    REWARMING = "rewarming"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Event(enum.StrEnum):
    SPAWNED = "spawned"  # a template process was started
    SPAWN_FAILED = "spawn_failed"  # starting one raised (detail: why)
    READY = "ready"  # it reported ready
    WARM_FAILED = "warm_failed"  # it reported warm_failed
    STALLED = "stalled"  # it stopped answering (detail: why)
    EXITED = "exited"  # the process is gone, reaped (detail: how it ended)
    STOP = "stop"  # stop() began
    STOPPED = "stopped"  # stop() is done


class Action(enum.StrEnum):
    REFILL = "refill"  # make spares up to the target
    DISMISS_SPARES = "dismiss_spares"  # bury the spares nobody took
    KILL_FIBERS = "kill_fibers"  # SIGKILL the fibers (their template is given up on)
    KILL_PROCESS = "kill_process"  # SIGKILL the template, its group and cgroup leaf
    FIBERS_LOST = "fibers_lost"  # tell each fiber its template is gone
    REWARM = "rewarm"  # sleep ``Lifecycle.delay`` on the clock, then start a new process


_P, _E, _A = Phase, Event, Action
_GIVE_UP = (_A.DISMISS_SPARES, _A.KILL_FIBERS, _A.KILL_PROCESS)
_GONE = (_A.DISMISS_SPARES, _A.FIBERS_LOST)

TABLE: dict[tuple[Phase, Event], tuple[Phase, tuple[Action, ...]]] = {
    (_P.WARMING, _E.READY): (_P.READY, (_A.REFILL,)),
    (_P.WARMING, _E.WARM_FAILED): (_P.WARM_FAILED, ()),
    (_P.WARMING, _E.STALLED): (_P.REWARMING, _GIVE_UP),
    (_P.WARMING, _E.EXITED): (_P.WARM_FAILED, _GONE),  # a warm that crashes would again
    (_P.WARMING, _E.STOP): (_P.STOPPING, ()),
    (_P.READY, _E.STALLED): (_P.REWARMING, _GIVE_UP),
    (_P.READY, _E.EXITED): (_P.REWARMING, (*_GONE, _A.REWARM)),
    (_P.READY, _E.STOP): (_P.STOPPING, ()),
    (_P.WARM_FAILED, _E.EXITED): (_P.WARM_FAILED, _GONE),
    (_P.WARM_FAILED, _E.STOP): (_P.STOPPING, ()),
    (_P.REWARMING, _E.EXITED): (_P.REWARMING, (*_GONE, _A.REWARM)),
    (_P.REWARMING, _E.SPAWNED): (_P.WARMING, ()),
    (_P.REWARMING, _E.SPAWN_FAILED): (_P.REWARMING, (_A.REWARM,)),
    (_P.REWARMING, _E.STOP): (_P.STOPPING, ()),
    (_P.STOPPING, _E.EXITED): (_P.STOPPED, _GONE),
    (_P.STOPPING, _E.STOPPED): (_P.STOPPED, ()),
}


def transition(phase: Phase, event: Event) -> tuple[Phase, tuple[Action, ...]]:
    """The next phase and the actions for ``event`` in ``phase`` (unlisted: no change)."""
    return TABLE.get((phase, event), (phase, ()))


class Backoff:
    """Delays between re-warms: ``initial`` doubling up to ``cap``; ``reset()`` on success."""

    def __init__(self, initial: float = 0.5, factor: float = 2.0, cap: float = 30.0) -> None:
        self.initial, self.factor, self.cap = initial, factor, cap
        self._next = initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self.cap, self._next * self.factor)
        return delay

    def reset(self) -> None:
        self._next = self.initial

    def peek(self) -> float:
        """The delay ``next()`` would give, without taking it."""
        return self._next


@dataclass(frozen=True)
class WarmError:
    """Why a template failed to warm: the exception class and one line."""

    error: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"error": self.error, "message": self.message}


class Lifecycle:
    """One template's phase and what goes with it: the backoff, the last warm error and
    fault, restarts, and the times ``retry_after`` is computed from.

    ``on(event, now, ...)`` applies ``TABLE`` and returns the actions; the caller (the
    template, on fiberd's loop) performs them. Not thread-safe; no I/O.
    """

    def __init__(self, backoff: Backoff | None = None) -> None:
        self.backoff = backoff or Backoff()
        self.phase = Phase.WARMING
        self.shown = TemplateState.WARMING  # the public state; kept while stopping
        self.warm_error: WarmError | None = None
        self.last_fault: str | None = None
        self.restarts = 0
        self.delay = 0.0  # the backoff of the last REWARM action, in seconds
        self._spawned_at = 0.0
        self._warm_took: float | None = None
        self._respawn_at: float | None = None

    def on(self, event: Event, now: float, detail: str = "", *, status: int = 0,
           warm_error: WarmError | None = None) -> tuple[Action, ...]:
        """Apply ``event`` at clock time ``now``; the actions to take, in order.

        ``detail``: why (STALLED, SPAWN_FAILED); ``status``: the process's Popen return
        code (EXITED); ``warm_error`` comes with WARM_FAILED."""
        before = self.phase
        listed = (before, event) in TABLE
        self.phase, actions = transition(before, event)
        if event is Event.SPAWNED and self.phase is Phase.WARMING:
            if before is Phase.REWARMING:
                self.restarts += 1
            self._spawned_at, self._respawn_at = now, None
        elif listed and event is Event.SPAWN_FAILED:
            self.restarts += 1
            self.last_fault = f"cannot start the template: {detail}"
        elif listed and event is Event.READY:
            self.backoff.reset()
            self._warm_took = now - self._spawned_at
        elif listed and event is Event.WARM_FAILED:
            self.warm_error = warm_error
        elif listed and event is Event.STALLED:
            self.last_fault = detail
        elif event is Event.EXITED and before is Phase.WARMING:
            self.warm_error = WarmError("TemplateDied",
                                        f"the template exited ({status}) before it was warm")
        elif event is Event.EXITED and before is Phase.READY:
            self.last_fault = f"the template exited ({how(status)})"
        if Action.REWARM in actions:
            self.delay = self.backoff.next()
            self._respawn_at = now + self.delay
        if self.phase is not Phase.STOPPING:
            self.shown = TemplateState(self.phase.value)
        return actions

    @property
    def ready(self) -> bool:
        """Whether a Clone may be served (ready, not given up on, not stopping)."""
        return self.phase is Phase.READY

    @property
    def stopping(self) -> bool:
        return self.phase in (Phase.STOPPING, Phase.STOPPED)

    def retry_after(self, now: float) -> float:
        """Seconds until the template is expected ready again: the rest of its backoff and
        the last warm's duration (a guess of 1 s before any was measured)."""
        warm = self._warm_took if self._warm_took is not None else _WARM_GUESS
        if self.shown is TemplateState.WARMING:
            return max(0.1, self._spawned_at + warm - now)
        if self._respawn_at is not None:
            return max(0.1, self._respawn_at - now + warm)
        return self.backoff.peek() + warm  # the process is still going: no backoff yet


def how(returncode: int) -> str:
    """A Popen return code in words: "exit code 1", "signal 9 (SIGKILL)"."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"
    return f"signal {-returncode} ({name})"
