"""SourceHealth: how recently the home's control plane answered.

Homes mark a sync whenever their control plane answers (HealthPoll does it
each answered round). The core reads it to tell "no" from "don't know": a
Clone for an unknown grant misses with ``unknown_grant`` while the source is
fresh and ``source_stale`` while it is stale or was never synced, and, where
the home has a control plane, a fence ends ``fence_ttl`` after the last sync.

A home with no control plane at all (the standalone host) builds its health
with ``control_plane=False``: it is always fresh, and fences never end by
silence. All readings are on the clock's monotonic scale.

A grant source can also be known to be down while the control plane answers
(a grantdir that is missing or cannot be read): its reader calls
``mark_down(source, reason)``, and until ``mark_up(source)`` every reading is
stale (``reason`` says why), with or without a control plane, so a Clone
for a grant not yet delivered misses with the retryable ``source_stale``
rather than the final ``unknown_grant``. A source being down does not end
fences: fibers already running keep their deadlines.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from slurm_fiber.core.clock import Clock


class HealthState(enum.StrEnum):
    FRESH = "fresh"
    STALE = "stale"
    NEVER = "never"


@dataclass(frozen=True)
class HealthReading:
    """One look at the health: its state and the age of the last sync (None: never)."""

    state: HealthState
    age: float | None
    control_plane: bool
    down: str | None = None  # why a grant source is down (then the state is stale)

    @property
    def fresh(self) -> bool:
        return self.state is HealthState.FRESH


class SourceHealth:
    """Last-sync bookkeeping for one control plane. Not thread-safe; used on the loop.

    ``stale_after`` is the TTL after which a silent control plane counts as
    stale. Never-synced counts as stale (state NEVER) for a home that has a
    control plane.
    """

    def __init__(self, clock: Clock, stale_after: float, *, control_plane: bool = True) -> None:
        if stale_after <= 0:
            raise ValueError("stale_after must be positive")
        self._clock = clock
        self.stale_after = stale_after
        self.control_plane = control_plane
        self._last_sync: float | None = None
        self._down: dict[str, str] = {}  # grant source -> why it is down

    def mark_down(self, source: str, reason: str) -> None:
        """Say that ``source`` (e.g. the grantdir's path) cannot deliver grants now, and why."""
        self._down[source] = reason

    def mark_up(self, source: str) -> None:
        """Say that ``source`` delivers again (a no-op when it was not down)."""
        self._down.pop(source, None)

    def mark_sync(self) -> None:
        """Record that the control plane answered now."""
        self._last_sync = self._clock.mono()

    @property
    def last_sync(self) -> float | None:
        """Monotonic time of the last sync, None when never synced."""
        return self._last_sync

    def read(self) -> HealthReading:
        """The state now: fresh, stale or never (always fresh without a control plane)."""
        age = None if self._last_sync is None else self._clock.mono() - self._last_sync
        if self._down:
            return HealthReading(HealthState.STALE, age, self.control_plane,
                                 "; ".join(self._down.values()))
        if not self.control_plane:
            return HealthReading(HealthState.FRESH, age, False)
        if age is None:
            return HealthReading(HealthState.NEVER, None, True)
        state = HealthState.FRESH if age < self.stale_after else HealthState.STALE
        return HealthReading(state, age, True)

    def fence_end(self, fence_ttl: float) -> float | None:
        """Monotonic time a fence ends by control-plane silence; None when it never does.

        Without a control plane fences never end by silence. Never synced: the
        fence has already ended (returns -inf), so work waits for a first sync.
        """
        if not self.control_plane:
            return None
        if self._last_sync is None:
            return float("-inf")
        return self._last_sync + fence_ttl
