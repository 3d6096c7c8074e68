"""Hypothesis stateful test of the core rules against an independent model.

Whatever the interleaving of admissions, removals, lifts, syncs, epoch bumps,
clock advances and wall-clock steps: a Clone never starts a fiber whose
deadline is past the latest admitted token's exp, past the silence fence, or
for a denied UID; and a GrantBook reloaded from the state file decides exactly
as the running one does.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from slurm_fiber.core.book.decisions import Admitted, GrantBook, Start, TemplateView
from slurm_fiber.core.book.health import SourceHealth
from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.book.state import StateFile
from slurm_fiber.core.clock import FakeClock
from tests.core.bookkit import token

UIDS = st.sampled_from(["a", "b", "c"])
FENCE_TTL = 50.0
WARM = TemplateView.warm()


class CoreRules(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="rules-"))
        self.clock = FakeClock()
        self.health = SourceHealth(self.clock, stale_after=20.0)
        self.book = self._open()
        self.lease: dict[str, float] = {}  # uid → latest admitted exp (monotonic)
        self.seen: dict[str, float] = {}  # uid → latest exp ever offered
        self.denied: dict[str, float] = {}  # uid → denied until
        self.serial = 0

    def _open(self) -> GrantBook:
        store = StateFile(self.dir / "state.json", boot_id="boot")
        return GrantBook(self.clock, self.health, fence_ttl=FENCE_TTL, store=store)

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def _is_denied(self, uid: str) -> bool:
        return self.denied.get(uid, float("-inf")) > self.clock.mono()

    @rule(uid=UIDS, ttl=st.integers(1, 300), redelivered=st.booleans())
    def admit(self, uid: str, ttl: int, redelivered: bool) -> None:
        if redelivered:  # drive(): GrantAdded lifts first
            self.book.lift(uid)
            self.denied.pop(uid, None)
        self.serial += 1
        exp = self.clock.mono() + ttl
        outcome = self.book.admit(token(self.clock, uid, ttl=ttl, jti=f"t{self.serial}"))
        self.seen[uid] = max(self.seen.get(uid, exp), exp)
        if self._is_denied(uid):
            assert isinstance(outcome, Miss) and outcome.code is MissCode.DENIED
            self.denied[uid] = max(self.denied[uid], exp)
        else:
            assert isinstance(outcome, Admitted)
            live = self.lease.get(uid, float("-inf"))
            self.lease[uid] = max(exp, live) if live > self.clock.mono() else exp

    @rule(uid=UIDS)
    def remove(self, uid: str) -> None:
        self.book.remove(uid)
        self.lease.pop(uid, None)
        if self.seen.get(uid, float("-inf")) > self.clock.mono():
            self.denied[uid] = self.seen[uid]

    @rule(seconds=st.floats(0, 120))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(seconds=st.sampled_from([-86_400.0, -30.0, 45.0, 86_400.0]))
    def step_wall(self, seconds: float) -> None:
        self.clock.step_wall(seconds)

    @rule()
    def sync(self) -> None:
        self.health.mark_sync()

    @rule()
    def bump(self) -> None:
        before = self.book.epoch
        assert self.book.bump_epoch("scope loss") == before + 1

    @rule(uid=UIDS, running=st.integers(0, 3))
    def clone(self, uid: str, running: int) -> None:
        outcome = self.book.decide_clone(uid, WARM, running)
        now = self.clock.mono()
        if self._is_denied(uid):
            assert isinstance(outcome, Miss) and outcome.code is MissCode.DENIED
        if isinstance(outcome, Start):
            assert not self._is_denied(uid)
            assert now < outcome.deadline.at <= self.lease[uid]
            assert self.health.last_sync is not None
            assert outcome.deadline.at <= self.health.last_sync + FENCE_TTL
            assert running < 2 and outcome.epoch == self.book.epoch

    @invariant()
    def reload_changes_no_decision(self) -> None:
        again = self._open()
        assert again.epoch == self.book.epoch
        for uid in ("a", "b", "c"):
            assert again.decide_clone(uid, WARM, 0) == self.book.decide_clone(uid, WARM, 0)


CoreRules.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestCoreRules = CoreRules.TestCase
