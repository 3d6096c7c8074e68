"""What the prolog and the epilog share: one-line reports and time-bounded steps.

slurmd runs both as root with a bare environment and reads only their exit
status (non-zero drains the node) and their stderr (into its log). ``Hook``
runs a hook as named steps: each step gets ``step_seconds`` of wall time
(an interval timer raises ``StepTimeout`` inside it, which also breaks a
blocked lock wait), and a step that fails or overruns is reported as one
line, ``<hook>: job <id>: <step>: <reason>``, to stderr and to syslog
(LOG_DAEMON), never as a traceback. Whether a failed step drains the node
is the caller's decision (``Hook.failed``). Used from the main thread only.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import syslog
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


class StepTimeout(Exception):
    """A step ran out of its time bound."""


@dataclass
class Hook:
    """One run of a hook: its ``name`` (syslog ident), the job (once known), its failures.

    ``failed`` maps a step name to its one-line reason; ``warn`` emits a line
    for something a step skipped without failing it; ``notes`` keeps the
    informational lines (what was done), printed only with ``verbose``.
    """

    name: str
    step_seconds: float = 2.0
    job: int | None = None
    verbose: bool = False
    use_syslog: bool = True
    failed: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def _line(self, step: str, text: str) -> str:
        who = f"job {self.job}: " if self.job is not None else ""
        return " ".join(f"{self.name}: {who}{step}: {text}".split())

    def report(self, step: str, reason: str) -> None:
        """Record and emit one failure line for ``step``. Never raises."""
        line = self._line(step, reason)
        self.failed[step] = reason
        self._emit(line, syslog.LOG_WARNING)

    def warn(self, step: str, reason: str) -> None:
        """Emit one warning line for something ``step`` skipped; the step still succeeds."""
        self._emit(self._line(step, reason), syslog.LOG_WARNING)

    def note(self, step: str, text: str) -> None:
        """Record what a step did; emitted to stderr only when verbose (syslog: info)."""
        line = self._line(step, text)
        self.notes.append(line)
        if self.verbose:
            self._emit(line, syslog.LOG_INFO)

    def _emit(self, line: str, priority: int) -> None:
        with contextlib.suppress(OSError, ValueError):
            print(line, file=sys.stderr, flush=True)
        if self.use_syslog:
            with contextlib.suppress(OSError, ValueError):
                syslog.openlog(self.name, syslog.LOG_PID, syslog.LOG_DAEMON)
                syslog.syslog(priority, line)

    def step(self, step: str, action: Callable[[], T], *,
             errors: tuple[type[BaseException], ...] = (Exception,)) -> T | None:
        """Run ``action`` within the step's time bound; its result, or None when it failed.

        Exceptions of the ``errors`` kinds and overruns are reported (one
        line) and swallowed; anything else propagates.
        """
        try:
            with bounded(self.step_seconds):
                return action()
        except StepTimeout:
            self.report(step, f"did not finish within {self.step_seconds:g} s")
        except errors as err:
            self.report(step, describe(err))
        return None


def describe(err: BaseException) -> str:
    """One line for an exception: its message (strerror and file for OSError), else its type."""
    if isinstance(err, OSError) and err.strerror:
        where = f"{err.filename}: " if err.filename else ""
        return f"{where}{err.strerror}"
    text = " ".join(str(err).split())
    return text or type(err).__name__


@contextlib.contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Raise StepTimeout in the body once ``seconds`` of wall time have passed. Main thread."""

    def expire(signum: int, frame: Any) -> None:
        raise StepTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
