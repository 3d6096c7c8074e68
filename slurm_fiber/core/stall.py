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
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Seen:
    """What fiberd has seen of one template process, in its clock's monotonic seconds.

    ``asked``: when the oldest request still unanswered was sent (None: none
    is). ``stopped``: since when the process has been seen stopped without a
    break (None: it was running at the last look).
    """

    asked: float | None = None
    stopped: float | None = None


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
    if seen.asked is not None and now - seen.asked >= bound:
        return Verdict(f"no answer to a request for {now - seen.asked:.1f} s "
                       f"(template_timeout {bound:g} s)", every)
    if seen.stopped is not None and now - seen.stopped >= bound:
        return Verdict(f"stopped (SIGSTOP or a tracer) for {now - seen.stopped:.1f} s "
                       f"(template_timeout {bound:g} s)", every)
    due = [every]
    if seen.asked is not None:
        due.append(seen.asked + bound - now)
    if seen.stopped is not None:
        due.append(seen.stopped + bound - now)
    return Verdict(None, max(min(due), 1e-3))


def look_every(bound: float) -> float:
    """How often to look at a template's process state for a ``bound``: often enough to
    see a stop well within the bound, at most once a second."""
    return min(1.0, bound / 4)
