"""When a template process counts as stalled: a pure rule on what fiberd saw and the clock.

fiberd asks a template for spares and expects each answer within a bound
(``template_timeout``); it also looks, now and then, whether the process is
stopped (SIGSTOP, a tracer: state ``T``/``t`` in ``/proc/<pid>/stat``). A
template that leaves a request unanswered for the bound, or stays stopped
for the bound, has stopped answering: ``Template`` then marks it not ready,
kills it and re-warms it. ``judge`` decides that from a ``Seen`` and the
time on the caller's clock; it reads nothing and changes nothing, so the rule
is tested alone. It also says when to look again, so the caller sleeps
exactly until the verdict could change (or until the next look at the
process state), never polls faster.

Only time fiberd itself was watching counts: after a gap in its looks (fiberd
was suspended with its job, stopped, or its loop was blocked; the suspend-
aware clock jumped) the count starts afresh, so resuming a suspended job
never condemns a template for the time everything was stopped.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Seen:
    """What fiberd has seen of one template process, in its clock's monotonic seconds.

    ``asked``: when the oldest request still unanswered was sent (None: none
    is). ``stopped``: since when the process has been seen stopped without a
    break (None: it was running at the last look). ``watching``: since when
    fiberd has been looking without a gap (``gap``).
    """

    asked: float | None = None
    stopped: float | None = None
    watching: float = float("-inf")


@dataclass(frozen=True)
class Verdict:
    """``reason`` (one line) when the template counts as stalled now, else None;
    ``recheck``: seconds until the verdict could change with no news (> 0)."""

    reason: str | None
    recheck: float


def judge(seen: Seen, now: float, bound: float, every: float) -> Verdict:
    """The verdict at ``now`` for a template allowed ``bound`` seconds to answer a request
    or to be stopped, whose state is looked at every ``every`` seconds (<= ``bound``).

    A request unanswered for ``bound`` seconds, or a stop lasting ``bound``
    seconds, is a stall (the request is named first: it is what a Clone waits
    for). Otherwise ``recheck`` is the time until the first of those could
    fall due, at most ``every``.
    """
    asked = None if seen.asked is None else max(seen.asked, seen.watching)
    stopped = None if seen.stopped is None else max(seen.stopped, seen.watching)
    if asked is not None and now - asked >= bound:
        return Verdict(f"no answer to a request for {now - asked:.1f} s "
                       f"(template_timeout {bound:g} s)", every)
    if stopped is not None and now - stopped >= bound:
        return Verdict(f"stopped (SIGSTOP or a tracer) for {now - stopped:.1f} s "
                       f"(template_timeout {bound:g} s)", every)
    due = [every]
    if asked is not None:
        due.append(asked + bound - now)
    if stopped is not None:
        due.append(stopped + bound - now)
    return Verdict(None, max(min(due), 1e-3))


def gap(last_look: float, now: float, every: float) -> bool:
    """Whether the looks at ``last_look`` and ``now`` are too far apart to count the
    time between as watched (more than twice the period: fiberd itself did not run)."""
    return now - last_look > 2 * every


def look_every(bound: float) -> float:
    """How often to look at a template's process state for a ``bound``: often enough to
    see a stop well within the bound, at most once a second."""
    return min(1.0, bound / 4)
