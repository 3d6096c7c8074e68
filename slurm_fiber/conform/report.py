"""What a conformance run found: one result per clause, a verdict, and its two renderings.

Outcomes are ``pass``, ``fail``, ``declared-skip`` (the stage declared it
lacks a lever the clause needs) and ``undeclared-skip`` (a lever found at run
time that it cannot work here). A run is conformant when nothing failed;
with ``strict`` an undeclared skip counts as a failure too. Declared skips
never make a run fail: the stage said up front what its home cannot do.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

JSON_VERSION = 1


class Outcome(enum.StrEnum):
    PASS = "pass"
    FAIL = "fail"
    DECLARED_SKIP = "declared-skip"
    UNDECLARED_SKIP = "undeclared-skip"


@dataclass(frozen=True)
class Result:
    """One clause's outcome with a one-line reason (empty for a pass) and its duration."""

    clause: str
    outcome: Outcome
    reason: str = ""
    seconds: float = 0.0

    def to_json(self) -> dict[str, object]:
        return {"clause": self.clause, "outcome": self.outcome.value, "reason": self.reason,
                "seconds": round(self.seconds, 3)}


@dataclass(frozen=True)
class Report:
    """A whole run against one home."""

    home: str
    results: tuple[Result, ...]
    strict: bool = False

    def count(self, outcome: Outcome) -> int:
        return sum(1 for r in self.results if r.outcome is outcome)

    @property
    def ok(self) -> bool:
        """Conformant: no clause failed (and, when strict, none was skipped undeclared)."""
        bad = {Outcome.FAIL, Outcome.UNDECLARED_SKIP} if self.strict else {Outcome.FAIL}
        return not any(r.outcome in bad for r in self.results)

    def summary(self) -> str:
        """One line: the verdict and the count of each outcome."""
        counts = ", ".join(f"{self.count(o)} {o.value}" for o in Outcome)
        verdict = "conformant" if self.ok else "NOT conformant"
        return f"home {self.home}: {verdict} ({counts})"

    def to_json(self) -> dict[str, object]:
        return {"version": JSON_VERSION, "home": self.home, "ok": self.ok,
                "strict": self.strict, "summary": {o.value: self.count(o) for o in Outcome},
                "clauses": [r.to_json() for r in self.results]}

    def table(self) -> str:
        """The human table: clause, outcome, reason; then the summary line."""
        width = max([len(r.clause) for r in self.results] + [len("clause")])
        lines = [f"{'clause':<{width}}  {'outcome':<15}  reason"]
        for r in self.results:
            lines.append(f"{r.clause:<{width}}  {r.outcome.value:<15}  {r.reason}".rstrip())
        lines.append(self.summary())
        return "\n".join(lines)
