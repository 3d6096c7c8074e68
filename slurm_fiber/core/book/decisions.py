"""The core's decisions: admission, denial, epochs, fences, leases and Clone.

``GrantBook`` is pure decision logic over a ``BookState``, a Clock and the
home's ``SourceHealth``: no processes, sockets or sleeps. Each call decides at
the clock's now and returns an outcome value; calls that change the state
persist it (when a ``StateFile`` is given) before they return, and if that
save fails they raise OSError and the change is not made. Reloading the saved
state therefore changes no decision. The one exception is ``admit(vt,
defer_save=True)``: the admission is made in memory and marked ``unsaved``; the
caller writes it with ``take_unsaved``/``unsave`` (one save for a batch of
admissions) and must not act on it durably before that save (the runtime
holds a Clone of an unsaved book until it is saved). Any later synchronous
save writes the pending admissions too.

Rules (DESIGN §4):

- A grant is a UID with one or more admitted tokens; its lease ends at the
  latest ``exp`` among them. Each ``exp`` is converted once, at admission, to
  the monotonic clock, so a wall-clock step never moves a lease.
- ``remove`` denies the UID until the latest ``exp`` ever seen for it; a token
  offered while denied is refused and stretches the denial to its own ``exp``.
  Only ``lift`` (the home delivering the grant again) ends a denial early.
- The epoch only grows and is persisted before ``bump_epoch`` returns. A
  fiber's fence belongs to the epoch it started under; a newer epoch revokes it.
- With ``fence_ttl`` set and a home with a control plane, a fence also ends
  ``fence_ttl`` after the last sync (at once when never synced).
- A fiber's deadline is ``min(lease, fence, start + limits.seconds)``.
- A Clone that starts nothing misses with the first that applies of: denied,
  unknown_grant / source_stale (by health), expired, fenced, cold, warm_failed,
  capacity (``closed`` and ``invalid_token`` are decided by the runtime with
  ``closed_miss`` / ``invalid_token_miss``).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from slurm_fiber.core.book.health import SourceHealth
from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.book.state import BookState, HeldToken, Horizon, StateFile
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.trust.grant import FiberSpec, VerifiedToken
from slurm_fiber.core.trust.tokens import TokenReason, TokenRefused

RETRY_HINT = 1.0  # seconds: the retry_after given when nothing better is known


class Warmth(enum.StrEnum):
    """How warm a grant's template is, as a Clone decision sees it (the template's own
    lifecycle is ``core.lifecycle.TemplateState``)."""

    ABSENT = "absent"
    COLD = "cold"
    WARM = "warm"
    FAILED = "failed"


@dataclass(frozen=True)
class TemplateView:
    """What the runtime knows about a grant's template when a Clone asks."""

    state: Warmth
    retry_after: float | None = None  # COLD: expected seconds until warm
    error: str | None = None  # FAILED: one line

    @classmethod
    def absent(cls) -> TemplateView:
        return cls(Warmth.ABSENT)

    @classmethod
    def cold(cls, retry_after: float | None = None) -> TemplateView:
        return cls(Warmth.COLD, retry_after=retry_after)

    @classmethod
    def warm(cls) -> TemplateView:
        return _WARM  # one frozen record for every Clone's view of a warm template

    @classmethod
    def failed(cls, error: str) -> TemplateView:
        return cls(Warmth.FAILED, error=error)


_WARM = TemplateView(Warmth.WARM)


class DeadlineCause(enum.StrEnum):
    """Which term of min(lease, fence, seconds) sets a deadline, or why it is due now."""

    LEASE = "lease"
    FENCE = "fence"
    SECONDS = "seconds"
    REVOKED = "revoked"  # the fence's epoch is older than the current one
    REMOVED = "removed"  # the grant was removed (or denied)


@dataclass(frozen=True)
class Deadline:
    """When a fiber must be stopped (monotonic seconds) and why then."""

    at: float
    cause: DeadlineCause


@dataclass(frozen=True)
class Start:
    """Clone decided: start a fiber for ``uid`` under ``epoch``, stopping it at ``deadline``."""

    uid: str
    jti: str  # the token that holds the lease
    epoch: int
    started: float  # monotonic
    deadline: Deadline
    spec: FiberSpec


@dataclass(frozen=True)
class Admitted:
    """A token was admitted. ``new_grant``: the UID had no token before (warm its template)."""

    uid: str
    jti: str
    lease_end: Horizon
    new_grant: bool
    spec: FiberSpec


@dataclass(frozen=True)
class Removed:
    """A grant was removed; the UID is denied until ``until`` (Unix time; None: not denied)."""

    uid: str
    jtis: tuple[str, ...]
    until: float | None


@dataclass(frozen=True)
class GrantView:
    """One grant for listing: UID, tokens, lease end, the grant in force, and whether expired."""

    uid: str
    jtis: tuple[str, ...]
    issuer: str
    lease_end: Horizon
    spec: FiberSpec
    expired: bool


def closed_miss() -> Miss:
    """The miss for a Clone that arrives while fiberd is shutting down."""
    return Miss(MissCode.CLOSED, "fiberd is shutting down; send the Clone to another allocation")


def invalid_token_miss(err: TokenRefused) -> Miss:
    """The miss for a Clone whose carried token was refused (detail: the token reason)."""
    return Miss(MissCode.INVALID_TOKEN, f"token refused: {err.detail}", detail=err.reason.value)


def _iso(wall: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))


class GrantBook:
    """Admitted grants, denials and the epoch, deciding against ``clock`` and ``health``.

    Not thread-safe; used from one event loop. With ``store`` the state is
    loaded at construction (StateCorrupt propagates: refuse to start) and
    saved before every state-changing call returns.
    """

    def __init__(
        self,
        clock: Clock,
        health: SourceHealth,
        fence_ttl: float | None = None,
        store: StateFile | None = None,
    ) -> None:
        if fence_ttl is not None and fence_ttl <= 0:
            raise ValueError("fence_ttl must be positive (or None for no silence fence)")
        self.clock = clock
        self.health = health
        self.fence_ttl = fence_ttl
        self.store = store
        loaded = store.load(clock) if store is not None else None
        self._state = loaded or BookState()
        self._unsaved = False  # deferred admissions not yet written to ``store``

    # -- reading ---------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._state.epoch

    def denied_until(self, uid: str) -> Horizon | None:
        """When the denial of ``uid`` ends, or None when it is not denied now."""
        h = self._state.denials.get(uid)
        return h if h is not None and h.mono > self.clock.mono() else None

    def grants(self) -> list[GrantView]:
        """Every grant held (expired ones until pruned), sorted by UID."""
        return [self._view(uid) for uid in sorted(self._state.tokens)]

    def grant(self, uid: str) -> GrantView | None:
        """The grant held for ``uid`` (expired until pruned), None when none is."""
        return self._view(uid) if uid in self._state.tokens else None

    def expired_uids(self) -> list[str]:
        """UIDs whose lease has ended: the runtime stops their fibers and cools their templates."""
        return [g.uid for g in self.grants() if g.expired]

    def fence_end(self) -> float | None:
        """Monotonic time the current fence ends by control-plane silence; None: never;
        ``-inf`` while the control plane has never answered (work waits for a first sync)."""
        if self.fence_ttl is None:
            return None
        return self.health.fence_end(self.fence_ttl)

    def fenced_now(self) -> bool:
        """Whether a Clone would miss ``fenced`` now (silence, or no answer yet)."""
        fence = self.fence_end()
        return fence is not None and fence <= self.clock.mono()

    # -- changing --------------------------------------------------------------

    def admit(self, vt: VerifiedToken, *, defer_save: bool = False) -> Admitted | Miss:
        """Admit a verified token, or miss: ``denied`` (the UID is removed) or ``invalid_token``.

        Idempotent per jti: a token admitted again keeps the deadline of its
        first admission. Raises OSError if the state cannot be saved. With
        ``defer_save`` an admission is not saved here but marked ``unsaved``
        (module doc); a denial's stretch is still saved before the miss returns.
        """
        expiry = Horizon.at_wall(vt.exp, self.clock)
        new = self._state.clone()
        new.seen[vt.uid] = expiry.later(new.seen.get(vt.uid))
        denied = self.denied_until(vt.uid)
        if denied is not None:
            new.denials[vt.uid] = expiry.later(denied)
            self._commit(new)
            return self._denied_miss(vt.uid)
        now = self.clock.mono()
        if expiry.mono <= now:
            return invalid_token_miss(TokenRefused(TokenReason.EXPIRED, "expired at admission"))
        held = {j: t for j, t in new.tokens.get(vt.uid, {}).items() if t.expiry.mono > now}
        new_grant = not held
        held.setdefault(vt.jti, HeldToken(vt.jti, vt.issuer, vt.iat, expiry, vt.spec))
        new.tokens[vt.uid] = held
        if defer_save and self.store is not None:
            self._state, self._unsaved = new, True
        else:
            self._commit(new)
        view = self._view(vt.uid)
        return Admitted(vt.uid, vt.jti, view.lease_end, new_grant, view.spec)

    def lift(self, uid: str) -> bool:
        """End a denial (the home delivered the grant again). Whether one was in force."""
        if uid not in self._state.denials:
            return False
        new = self._state.clone()
        del new.denials[uid]
        self._commit(new)
        return True

    def remove(self, uid: str) -> Removed:
        """Forget the grant and deny ``uid`` until every token seen for it has expired."""
        new = self._state.clone()
        jtis = tuple(new.tokens.pop(uid, {}))
        horizon = new.seen.get(uid)
        if horizon is not None and horizon.mono > self.clock.mono():
            new.denials[uid] = horizon
        self._commit(new)
        denial = new.denials.get(uid)
        return Removed(uid, jtis, denial.wall if denial is not None else None)

    def bump_epoch(self, reason: str) -> int:
        """Start a new epoch, revoking every older fence. Returns it once it is persisted."""
        new = self._state.clone()
        new.epoch += 1
        new.epoch_reason = reason
        self._commit(new)
        return new.epoch

    def prune(self, retain: float) -> list[str]:
        """Forget grants whose lease ended over ``retain`` s ago, and past denials.

        Returns the UIDs of the grants forgotten. Raises OSError if the save fails.
        """
        cutoff = self.clock.mono() - retain
        new = self._state.clone()
        gone = [uid for uid in new.tokens if self._view(uid).lease_end.mono <= cutoff]
        for uid in gone:
            del new.tokens[uid]
        now = self.clock.mono()
        for table in (new.denials, new.seen):
            for uid in [u for u, h in table.items() if h.mono <= now]:
                del table[uid]
        if gone or new.denials != self._state.denials or new.seen != self._state.seen:
            self._commit(new)
        return gone

    @property
    def unsaved(self) -> bool:
        """Whether deferred admissions are not yet written to the store."""
        return self._unsaved

    def take_unsaved(self) -> BookState | None:
        """The state to write for the deferred admissions (None when all are saved),
        marked saved; the caller saves it (off the loop if it likes) and calls
        ``unsave`` when that save fails."""
        if not self._unsaved:
            return None
        self._unsaved = False
        return self._state

    def unsave(self) -> None:
        """A save of ``take_unsaved``'s state failed: its admissions are unsaved again."""
        self._unsaved = True

    # -- Clone and deadlines -----------------------------------------------------

    def decide_clone(self, uid: str, template: TemplateView, running: int) -> Start | Miss:
        """Start a fiber now (with its deadline) or the first miss that applies (DESIGN §4).

        ``running``: fibers of this grant running now. Pure: changes nothing.
        """
        now = self.clock.mono()
        if self.denied_until(uid) is not None:
            return self._denied_miss(uid)
        if uid not in self._state.tokens:
            reading = self.health.read()
            if reading.fresh:
                return Miss(MissCode.UNKNOWN_GRANT,
                            f"no grant {uid!r} here and the control plane is answering")
            source = reading.down or f"the control plane is {reading.state}"
            return Miss(MissCode.SOURCE_STALE, f"no grant {uid!r} here yet, and {source}",
                        retry_after=RETRY_HINT)
        view = self._view(uid)
        if view.expired:
            return Miss(MissCode.EXPIRED,
                        f"grant {uid!r} expired at {_iso(view.lease_end.wall)}; deliver a renewal")
        fence = self.fence_end()
        if fence is not None and fence <= now:
            silent = ("has not answered since fiberd started" if fence == float("-inf")
                      else f"has been silent for over {self.fence_ttl:g} s")
            return Miss(MissCode.FENCED, f"the control plane {silent}; work is fenced",
                        retry_after=RETRY_HINT)
        miss = self._template_miss(uid, template)
        if miss is not None:
            return miss
        limit = view.spec.limits.fibers
        if limit is not None and running >= limit:
            return Miss(MissCode.CAPACITY,
                        f"grant {uid!r} already runs {running} of {limit} fibers",
                        retry_after=RETRY_HINT)
        lease_jti = max(self._state.tokens[uid].values(), key=lambda t: t.expiry.mono).jti
        return Start(uid, lease_jti, self.epoch, now, self._deadline(uid, now), view.spec)

    def deadline(self, uid: str, epoch: int, started: float) -> Deadline:
        """The live deadline of a fiber of ``uid`` started at ``started`` under ``epoch``.

        Recomputed at each call: renewals extend the lease, syncs extend the
        fence; a revoked epoch or a removed grant makes it due now.
        """
        now = self.clock.mono()
        if epoch != self.epoch:
            return Deadline(now, DeadlineCause.REVOKED)
        if uid not in self._state.tokens or self.denied_until(uid) is not None:
            return Deadline(now, DeadlineCause.REMOVED)
        return self._deadline(uid, started)

    def _deadline(self, uid: str, started: float) -> Deadline:
        view = self._view(uid)
        terms = [Deadline(view.lease_end.mono, DeadlineCause.LEASE)]
        fence = self.fence_end()
        if fence is not None:  # never synced (-inf): due now, a time the audit can write
            terms.append(Deadline(max(fence, self.clock.mono()), DeadlineCause.FENCE))
        if view.spec.limits.seconds is not None:
            terms.append(Deadline(started + view.spec.limits.seconds, DeadlineCause.SECONDS))
        return min(terms, key=lambda d: d.at)

    # -- helpers -------------------------------------------------------------------

    def _template_miss(self, uid: str, template: TemplateView) -> Miss | None:
        if template.state in (Warmth.COLD, Warmth.ABSENT):
            return Miss(MissCode.COLD, f"template of grant {uid!r} is still warming",
                        retry_after=template.retry_after or RETRY_HINT)
        if template.state is Warmth.FAILED:
            return Miss(MissCode.WARM_FAILED,
                        f"template of grant {uid!r} failed to warm: {template.error}",
                        detail=template.error)
        return None

    def _denied_miss(self, uid: str) -> Miss:
        until = self._state.denials[uid]
        return Miss(MissCode.DENIED,
                    f"grant {uid!r} was removed; denied until {_iso(until.wall)} "
                    "unless the home delivers it again",
                    retry_after=max(0.0, until.mono - self.clock.mono()), until=until.wall)

    def _view(self, uid: str) -> GrantView:
        held = self._state.tokens[uid].values()
        lease = max(held, key=lambda t: t.expiry.mono)
        newest = max(held, key=lambda t: (t.iat, t.expiry.mono))
        return GrantView(uid, tuple(t.jti for t in held), newest.issuer, lease.expiry,
                         newest.spec, lease.expiry.mono <= self.clock.mono())

    def _commit(self, new: BookState) -> None:
        if self.store is not None:
            self.store.save(new)  # carries any deferred admissions too
            self._unsaved = False
        self._state = new
