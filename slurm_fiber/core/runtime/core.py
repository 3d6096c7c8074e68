"""The core runtime: grant decisions carried out with templates, fibers, cgroups and devices.

``Core`` is what the edges call. A home's deliveries reach it through
``drive`` (it is drive's ``Admitter``: verify, lift, admit, remove); the
socket API reaches it as its ``Service`` (clone, list, stop, status ...);
fiberd calls ``bump_epoch``, ``lose_scope``, ``maintain`` and ``shutdown``.
Every decision is the ``GrantBook``'s (pure, on the injected clock); Core
only carries it out: an admitted grant gets its devices from the home, a
grant cgroup and a warm template; a Clone the book allows forks a fiber whose
deadline is re-asked from the book until it is due; removal, expiry, an epoch
bump and shutdown stop the fibers concerned and return once they are gone.

Guarantees: every decision is written to the audit log, durable per the
log's policy, before it is answered (a fiber's exit, an observation, is
written before its exit event and, under ``always``, made durable with the
next decision's record or within ``EXIT_SYNC_DELAY``); a decision that
cannot be audited raises instead of being answered (a Clone whose audit
record cannot be written kills the fiber it forked, before registering it,
and answers the retryable miss ``audit_failed``); a Clone never waits for
the control plane; nothing here raises into the event loop for a refused
input: refusals become misses or ``AdmitRefused`` with a code and a
one-line reason. All methods run on fiberd's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import sys
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from slurm_fiber.core.api.service import (
    Clone,
    FiberNotFound,
    Forked,
    JsonMap,
    Peer,
    Stdio,
    page,
)
from slurm_fiber.core.audit.log import AuditEvent, AuditLog, AuditWriteFailed, FsyncPolicy
from slurm_fiber.core.audit.syncer import AuditSyncer
from slurm_fiber.core.book.decisions import (
    RETRY_HINT,
    Admitted,
    GrantBook,
    Start,
    TemplateView,
    closed_miss,
    invalid_token_miss,
)
from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.cgroups.common import GrantCgroup
from slurm_fiber.core.cgroups.enforcement import (
    Enforcement,
    device_confinement,
    grant_enforcement,
    host_devices,
    host_enforcement,
)
from slurm_fiber.core.cgroups.manager import CgroupManager
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.devices import DeviceChannel
from slurm_fiber.core.fibers.fiber import DeadlineTimer, Fiber, FiberEnd
from slurm_fiber.core.fibers.handles import FiberView
from slurm_fiber.core.runtime.identity import FiberIdentity
from slurm_fiber.core.runtime.task_window import TaskWindowRun, open_window
from slurm_fiber.core.seam import HomePorts, ReleaseDevices
from slurm_fiber.core.templates.parent import (
    DEFAULT_TIMEOUT,
    FiberRequest,
    ForkFailed,
    Template,
    TemplateNotReady,
    TemplateState,
    template_env,
)
from slurm_fiber.core.trust.grant import FiberSpec, Limits, VerifiedToken
from slurm_fiber.core.trust.tokens import TokenRefused, TokenVerifier
from slurm_fiber.errors import CodedError

log = logging.getLogger("slurm_fiber.core.runtime.core")

T = TypeVar("T")

EXIT_SYNC_DELAY = 0.1  # seconds a fiber_exit record may wait for an fsync it shares
DEFAULT_PRUNE_AFTER = 3600.0  # seconds an expired grant stays listed before it is forgotten
DEFAULT_HISTORY = 1000  # ended fibers whose records are kept (inspect, ls --all)
DEFAULT_HISTORY_SECONDS = 3600.0  # ... and for how long after they ended


class AdmitRefused(CodedError):
    """An admission the core refused: ``code`` and a one-line ``reason`` (audited already)."""

    def __init__(self, miss: Miss) -> None:
        super().__init__(miss.code.value, miss.reason)
        self.miss = miss


class CloneFailed(Exception):
    """A Clone the book allowed but the template could not start (one line; audited).
    ``errno``: the cause's, when it was an OSError (EMFILE/ENFILE: the API answers
    ``busy``, docs/socket-protocol.md)."""

    def __init__(self, reason: str, errno: int | None = None) -> None:
        super().__init__(reason)
        self.errno = errno


@dataclass
class _Grant:
    """One admitted grant's processes and resources."""

    uid: str
    spec: FiberSpec
    template: Template
    channel: DeviceChannel
    release: ReleaseDevices
    cgroup: GrantCgroup | None
    enforcement: Enforcement
    watcher: asyncio.Task[None] | None = None
    retired: list[Template] = field(default_factory=list)


def _template_view(grant: _Grant | None) -> TemplateView:
    """What the book is told of a grant's template: warm only when ready; warming and
    re-warming (also after it stopped answering) are cold, with when to retry."""
    if grant is None:
        return TemplateView.absent()
    template = grant.template
    match template.state:
        case TemplateState.READY:
            return TemplateView.warm()
        case TemplateState.WARMING | TemplateState.REWARMING:
            return TemplateView.cold(template.retry_after())
        case TemplateState.WARM_FAILED:
            err = template.warm_error
            return TemplateView.failed(f"{err.error}: {err.message}" if err else "unknown error")
        case _:
            return TemplateView.absent()


def _not_ready_miss(uid: str, template: Template, err: TemplateNotReady) -> Miss:
    """The miss of a Clone whose template stopped being ready while it was served (it
    died, stopped answering, or is being stopped): ``cold`` and when to retry; only a
    failed warm is final."""
    if err.state is TemplateState.WARM_FAILED:
        detail = err.warm_error.error if err.warm_error else None
        return Miss(MissCode.WARM_FAILED, f"template of {uid!r} failed to warm: {err}",
                    detail=detail)
    why = f" ({template.last_fault})" if template.last_fault else ""
    retry = template.retry_after() if err.state is not TemplateState.STOPPED else RETRY_HINT
    return Miss(MissCode.COLD, f"template of {uid!r} is {err.state.value}{why}; retry",
                retry_after=retry)


class Core:
    """The runtime of one fiberd. Build it once, on the loop that will use it.

    ``state_dir`` holds template logs and fiber output files. ``grace`` is
    the SIGTERM → SIGKILL delay for every stop. ``spares`` is how many fiber
    processes each ready template forks ahead; ``spares_idle``, the clock
    seconds without a Clone after which a grant's spares are dismissed until
    its next Clone (None: never). ``template_timeout`` is the
    seconds a template or spare may take to answer before the template is
    killed and re-warmed. ``python`` is the interpreter templates run.
    ``strict_limits``: refuse (``unenforceable``) a grant asking for a limit
    nothing here enforces, instead of running it with that limit reported as
    not enforced.
    """

    def __init__(self, home: HomePorts, book: GrantBook, verifier: TokenVerifier, audit: AuditLog,
                 cgroups: CgroupManager, *, clock: Clock, state_dir: Path, grace: float = 5.0,
                 spares: int = 1, spares_idle: float | None = None,
                 template_timeout: float = DEFAULT_TIMEOUT, python: str = sys.executable,
                 prune_after: float = DEFAULT_PRUNE_AFTER, strict_limits: bool = False,
                 identity: FiberIdentity | None = None,
                 history: int = DEFAULT_HISTORY,
                 history_seconds: float = DEFAULT_HISTORY_SECONDS,
                 task_window: str = "fiberd") -> None:
        self.home = home
        # "template": a windowed batch of exec items runs as a task window
        # (core/runtime/task_window.py); "fiberd" (the default): fiberd starts each item
        self.task_window = task_window
        self.windows: dict[str, TaskWindowRun] = {}  # task windows open, by id
        self.identity = identity  # whom templates and fibers run as (core/identity.py)
        self.book = book
        self.verifier = verifier
        self.audit = audit
        self.cgroups = cgroups
        self.clock = clock
        self.state_dir = state_dir
        self.grace = grace
        self.spares = spares
        self.spares_idle = spares_idle
        self.template_timeout = template_timeout
        self.python = python
        self.prune_after = prune_after
        self.strict_limits = strict_limits
        self.closing = False
        # told of every registered fiber's end (grant uid, end, mode): the metrics' fiber_ended
        self.on_fiber_end: Callable[[str, FiberEnd | None, str], None] | None = None
        self._grants: dict[str, _Grant] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._fibers: dict[str, FiberView] = {}
        # Ended fibers' last records (ended at, listing order, record), oldest first: the
        # last ``history`` of them, for ``history_seconds`` (inspect_fiber, list_fibers'
        # ``ended``), so a fiber that ended is still seen for a while, within bounds.
        self.history, self.history_seconds = history, history_seconds
        self._ended: dict[str, tuple[float, int, JsonMap]] = {}
        self._gone: dict[str, int] = {}  # listing order of fibers ending now
        self._listed: dict[str, int] = {}  # fiber id -> registration order (list pages)
        self._registered = itertools.count(1)
        self._ids = itertools.count(1)
        self._prefix = os.urandom(3).hex()
        self._deadlines = DeadlineTimer(clock, grace)  # every fiber's, on one timer
        self._released: set[str] = set()  # fiber ids whose release is audited
        self._tasks: set[asyncio.Task[Any]] = set()
        self._retiring: set[asyncio.Future[None]] = set()  # grants being stopped
        self._unenforceable: dict[str, Miss] = {}  # strict limits: UIDs refused, not admitted
        self._starting: Counter[str] = Counter()  # Clones deciding past, not yet started, by UID
        self._epoch_reason = ""  # why the epoch was last bumped (a revoked fiber's reason)
        self._saving: asyncio.Task[None] | None = None  # writing deferred admissions
        self._exits: list[tuple[str, dict[str, object]]] = []  # fiber_exit records to write
        self._exit_sync: asyncio.Task[None] | None = None  # the fsync they wait for
        self._syncer: AuditSyncer | None = None  # fsyncs Clone records off the loop

    # ------------------------------------------------------------ Admitter (drive)

    def verify(self, raw: bytes | str) -> VerifiedToken:
        """Verify a raw token; a refusal is audited and raised as TokenRefused."""
        try:
            return self.verifier.verify(raw)
        except TokenRefused as err:
            # As every refusal and miss: reason for a person, detail the machine code.
            miss = invalid_token_miss(err)
            self._write(AuditEvent.REFUSE, code=miss.code.value, reason=miss.reason,
                        detail=miss.detail)
            raise

    def lift(self, uid: str) -> bool:
        """Lift a removal denial (the home delivered the grant again); True when one held."""
        lifted = self.book.lift(uid)
        if lifted:
            self._write(AuditEvent.LIFT, uid=uid, reason="the home delivered the grant again")
        return lifted

    async def admit(self, vt: VerifiedToken) -> Admitted:
        """Admit a verified token and warm its grant's template (returns before it is warm).

        Raises AdmitRefused (denied, expired, closed, devices or cgroup
        refused, or under strict limits ``unenforceable``), audited with its
        code and reason. The admit record carries the token's enforcement
        record (which of its limits are enforced, by what; how devices are
        confined).
        """
        if self.closing:
            raise self._refuse(vt, closed_miss())
        expected = self._expected(vt.spec.limits)
        if self.strict_limits:
            self._refuse_unenforceable(vt, expected)
        outcome = self.book.admit(vt, defer_save=True)
        if isinstance(outcome, Miss):
            raise self._refuse(vt, outcome)
        self._save_soon()
        self._unenforceable.pop(vt.uid, None)
        self._write(AuditEvent.ADMIT, uid=vt.uid, jti=vt.jti, issuer=vt.issuer,
                    lease_end=outcome.lease_end.wall, new_grant=outcome.new_grant,
                    leeway=vt.leeway_used, enforcement=expected.to_json())
        async with self._lock(vt.uid):
            grant = self._grants.get(vt.uid)
            spec = self.book_spec(vt.uid) or outcome.spec
            if grant is None or grant.template.state is TemplateState.STOPPED:
                await self._provision(vt, spec)
            elif grant.spec != spec:
                await self._replace_template(grant, spec)
        self._deadlines.rearm()  # a renewal may move deadlines
        await asyncio.sleep(0)  # a batch of admissions lets the loop answer in between
        return outcome

    async def remove(self, uid: str) -> None:
        """Remove the grant: deny the UID until its tokens expire, stop its fibers and
        template, release its devices and cgroup; returns once its fibers are gone."""
        removed = self.book.remove(uid)
        self._unenforceable.pop(uid, None)
        self._write(AuditEvent.REMOVE, uid=uid, jtis=list(removed.jtis),
                    denied_until=removed.until)
        await self._retire(uid, "removed")

    # ------------------------------------------------------------ epochs, scope, upkeep

    async def bump_epoch(self, reason: str) -> int:
        """Start a new epoch and stop every fiber of an older one; returns once they are gone."""
        epoch = self.book.bump_epoch(reason)
        self._epoch_reason = reason
        self._write(AuditEvent.EPOCH_BUMP, epoch=epoch, reason=reason)
        self._deadlines.rearm()
        closing = [w.close("revoked") for w in list(self.windows.values()) if w.epoch < epoch]
        self._note_releases([f for g in list(self._grants.values())
                             for f in g.template.fibers.values() if f.epoch < epoch], "revoked")
        await asyncio.gather(*closing, *(g.template.stop_fibers(self.grace, before_epoch=epoch)
                                         for g in list(self._grants.values())))
        return epoch

    async def lose_scope(self, reason: str, removes_grants: bool) -> None:
        """A home lost its scope: bump the epoch and, when ``removes_grants``, remove every
        grant. The home's ``LosesScope`` handler; never raises but cancellation."""
        self._write(AuditEvent.SCOPE_LOSS, reason=reason, removes_grants=removes_grants)
        try:
            await self.bump_epoch(reason)
            if removes_grants:
                for grant in self.book.grants():
                    await self.remove(grant.uid)
        except Exception:
            log.exception("scope loss %r not fully carried out", reason)

    async def expire_due(self) -> list[str]:
        """Cool the templates of grants whose lease ended, then prune long-expired grants.

        Their fibers were stopped at their deadlines already. Returns the UIDs cooled.
        """
        cooled = []
        for uid in self.book.expired_uids():
            if uid in self._grants:
                self._write(AuditEvent.EXPIRE, uid=uid, reason="lease ended")
                await self._retire(uid, "expired")
                cooled.append(uid)
        self.book.prune(self.prune_after)
        return cooled

    async def maintain(self, every: float = 1.0) -> None:
        """Run expiry, pruning and the shedding of idle grants' spares every ``every``
        clock seconds until cancelled."""
        while True:
            await self.clock.sleep(every)
            try:
                await self.expire_due()
            except OSError as err:
                log.error("upkeep failed: %s", err)
            self._shed_idle_spares()

    def _shed_idle_spares(self) -> None:
        """Dismiss the spares of grants not cloned for ``spares_idle``
        (``Template.shed_idle_spares``), each said in the log."""
        for uid, grant in self._grants.items():
            if grant.template.shed_idle_spares():
                log.info("grant %s: not cloned for %g s, its spares dismissed until its "
                         "next Clone", uid, self.spares_idle)

    async def shutdown(self) -> None:
        """Refuse new work, stop every fiber and template, release devices and cgroups.

        Returns once everything is gone. Idempotent.
        """
        self.closing = True
        with contextlib.suppress(OSError):  # said by _saved; the admissions are redelivered
            await self._saved()
        await asyncio.gather(*(self._retire(uid, "shutdown") for uid in list(self._grants)))
        await asyncio.gather(*list(self._retiring), return_exceptions=True)
        self._deadlines.close()
        await self._deadlines.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._syncer is not None:
            self._syncer.close()

    # ------------------------------------------------------------ Service (socket API)

    async def clone(self, request: Clone, peer: Peer, stdio: Stdio) -> FiberView | Miss:
        """Resolve the grant, decide, and fork a fiber, or say which miss applies.

        Raises CloneFailed when the template cannot fork (audited).
        """
        caller = {"caller_uid": peer.uid, "caller_pid": peer.pid}
        try:
            return await self._clone(request, stdio, caller)
        except AuditWriteFailed as err:
            log.error("clone refused: %s", err)
            return _audit_failed(err)

    async def _clone(self, request: Clone, stdio: Stdio,
                     caller: dict[str, int]) -> FiberView | Miss:
        if self.closing:
            return self._miss(None, closed_miss(), caller)
        resolved = await self._resolve(request)
        if isinstance(resolved, Miss):
            return self._miss(None, resolved, caller)
        return await self._clone_for(resolved, request, stdio, caller)

    async def clone_batch(self, requests: Sequence[Clone], peer: Peer, stdios: Sequence[Stdio],
                          batch: int | None = None, forked: Forked | None = None,
                          ) -> list[FiberView | Miss | Exception]:
        """Clone once per request (all of one grant and token): the grant resolved and
        a carried token verified and admitted once; a miss of that step is audited once
        (``batch``: the client request's item count, default how many it answers) and
        answers every item. Then each item is decided, forked and audited (``clone``, with
        ``batch``) on its own: an item's miss, failed fork (its CloneFailed, returned) or
        unwritable audit record leaves the rest going. ``forked`` is told of each fiber
        once it runs, before its record is durable (``Service.clone_batch``)."""
        if not requests:
            return []
        first = requests[0]
        caller = {"caller_uid": peer.uid, "caller_pid": peer.pid,
                  "batch": len(requests) if batch is None else batch}
        try:
            resolved = closed_miss() if self.closing else await self._resolve(first)
            if isinstance(resolved, Miss):
                return [self._miss(None, resolved, caller)] * len(requests)
        except AuditWriteFailed as err:
            log.error("clone batch refused: %s", err)
            return [_audit_failed(err)] * len(requests)
        return list(await asyncio.gather(*(
            self._batch_item(resolved, request, stdio, caller, forked)
            for request, stdio in zip(requests, stdios, strict=True))))

    async def _batch_item(self, uid: str, request: Clone, stdio: Stdio,
                          caller: dict[str, int],
                          forked: Forked | None) -> FiberView | Miss | Exception:
        """One item of ``clone_batch``, its outcome. The items run at once, each decided in
        the order given (a task runs until its fork is asked): the template forks them
        one after another, and under ``audit_fsync = always`` their records share fsyncs
        rather than waiting for one each in turn. Whatever fails one item is that item's
        outcome (``Service.clone_batch``), so no other item's fiber is left unanswered."""
        try:
            return await self._clone_for(uid, request, stdio, caller, forked)
        except AuditWriteFailed as err:
            log.error("clone refused: %s", err)
            return _audit_failed(err)
        except CloneFailed as err:
            return err
        except Exception as err:  # a fault of fiberd's: that item is answered internal
            log.exception("clone batch item failed")
            return err

    async def _clone_for(self, uid: str, request: Clone, stdio: Stdio,
                         caller: dict[str, int],
                         forked: Forked | None = None) -> FiberView | Miss:
        """A Clone whose grant is resolved: the book's decision, then the fork."""
        grant = self._grants.get(uid)
        if grant is None and uid in self._unenforceable:
            return self._miss(uid, self._unenforceable[uid], caller)
        if self.book.unsaved:
            try:
                await self._saved()
            except OSError as err:
                return self._miss(uid, Miss(MissCode.COLD, f"admission of {uid!r} not saved "
                                            f"yet: {err}", retry_after=RETRY_HINT,
                                            detail="state_unsaved"), caller)
            grant = self._grants.get(uid)
        # Counted with its fibers: the Clones of this grant still starting (another
        # connection's, or a windowed batch's), or a burst could pass ``fibers``.
        decision = self.decide(uid, 1, caller)
        if isinstance(decision, Miss):
            return decision
        assert grant is not None
        return await self._start(grant, decision, request, stdio, caller, forked)

    # ------------------------------------------------------------ task windows

    async def open_window(self, requests: Sequence[Clone], peer: Peer, stdios: Sequence[Stdio],
                          keys: list[str], size: int) -> TaskWindowRun | Miss | None:
        """A task window for a windowed batch (core/runtime/task_window.py), when
        ``task_window`` is "template"; None: fiberd's own path runs the batch."""
        if self.task_window != "template":
            return None
        try:
            return await open_window(self, requests, peer, stdios, keys, size)
        except AuditWriteFailed as err:
            return _audit_failed(err)

    def decide(self, uid: str, places: int, caller: dict[str, int]) -> Start | Miss:
        """The book's decision for ``places`` more fibers of ``uid`` (a miss audited),
        counting its fibers running, its Clones still starting (another connection's,
        or a windowed batch's, or a burst could pass ``fibers``) and its task windows'
        places."""
        grant = self._grants.get(uid)
        running = len(grant.template.fibers) + self._starting[uid] + sum(
            w.size for w in self.windows.values() if w.uid == uid) \
            if grant is not None else 0
        decision = self.book.decide_clone(uid, _template_view(grant), running + places - 1)
        if isinstance(decision, Miss):
            return self._miss(uid, decision, caller)
        return decision

    async def resolve(self, request: Clone) -> str | Miss:
        """The UID a Clone is for (``_resolve``), the book's admissions saved."""
        resolved = await self._resolve(request)
        if isinstance(resolved, str) and self.book.unsaved:
            try:
                await self._saved()
            except OSError as err:
                return Miss(MissCode.COLD, f"admission of {resolved!r} not saved yet: {err}",
                            retry_after=RETRY_HINT, detail="state_unsaved")
        return resolved

    def grant(self, uid: str) -> _Grant | None:
        return self._grants.get(uid)

    def miss(self, uid: str | None, miss: Miss, caller: dict[str, int]) -> Miss:
        """Audit a miss and return it."""
        return self._miss(uid, miss, caller)

    def wall(self, mono: float) -> float:
        return self._wall(mono)

    def list_fibers(self, after: str | None = None, limit: int | None = None,
                    ended: bool = False) -> tuple[Sequence[JsonMap], str | None]:
        """A page of the fibers by registration order (``page``); records are built for
        that page only. ``ended``: with the ended fibers still remembered (``history``)."""
        ordered: Iterable[tuple[int, FiberView | JsonMap]] = (
            (self._listed.get(fid, 0), view) for fid, view in self._fibers.items())
        if ended:
            self._forget_old()
            ordered = sorted([*ordered, *((n, rec) for _, n, rec in self._ended.values())],
                             key=lambda pair: pair[0])
        views, cursor = page(ordered, after, limit)
        return [v.to_json() if isinstance(v, FiberView) else v for v in views], cursor

    def inspect_fiber(self, fiber_id: str) -> JsonMap:
        view = self._fibers.get(fiber_id)
        if view is None:
            self._forget_old()
            if fiber_id in self._ended:
                return self._ended[fiber_id][2]
        return self._fiber(fiber_id).to_json()

    def _remember(self, view: FiberView, order: int) -> None:
        """Keep an ended fiber's last record (within ``history`` and ``history_seconds``)."""
        if self.history <= 0:
            return
        self._ended[view.fiber.id] = (self.clock.mono(), order, view.to_json())
        self._forget_old()

    def _forget_old(self) -> None:
        """Drop the ended records past ``history`` in number or ``history_seconds`` in age."""
        oldest = self.clock.mono() - self.history_seconds
        while self._ended:
            fid, (at, _, _) = next(iter(self._ended.items()))
            if len(self._ended) <= self.history and at >= oldest:
                break
            del self._ended[fid]

    async def stop_fiber(self, fiber_id: str, grace: float | None, peer: Peer) -> JsonMap:
        view = self._fiber(fiber_id)
        self._note_release(view.fiber, "stop_request", caller_uid=peer.uid,
                           caller_pid=peer.pid)
        await view.fiber.stop(self.grace if grace is None else grace)
        return view.to_json()

    def signal_fiber(self, fiber_id: str, signum: int, peer: Peer) -> bool:
        return self._fiber(fiber_id).fiber.signal(signum)

    def list_grants(self) -> Sequence[JsonMap]:
        out = []
        for view in self.book.grants():
            grant = self._grants.get(view.uid)
            out.append({
                "uid": view.uid, "issuer": view.issuer, "jtis": list(view.jtis),
                "lease_end": view.lease_end.wall, "expired": view.expired,
                "template": grant.template.to_json() if grant else None,
                "fibers": len(grant.template.fibers) if grant else 0,
                "devices": grant.channel.to_json() if grant else [],
                "limits": _limits_json(view.spec),
                "enforcement": grant.enforcement.to_json() if grant else None,
            })
        return out

    def status(self) -> JsonMap:
        cgroups = self.cgroups.status.to_json()
        cgroups["backend"] = self.cgroups.mode
        cgroups["enforced"] = self.cgroups.describe()
        return {"home": self.home.name(), "pid": os.getpid(), "epoch": self.book.epoch,
                "closing": self.closing, "grants": len(self.book.grants()),
                "templates": {uid: g.template.state.value for uid, g in self._grants.items()},
                "templates_stopping": len(self._retiring),
                "fibers_running": self.fibers_running(), "cgroups": cgroups,
                "mode": "carved" if cgroups["carved"] else "uncarved",
                "enforcement": self.enforcement_status(),
                "scope": {c.key: c.value for c in self.home.liveness.scope()},
                "audit_path": str(self.audit.path), "audit_seq": self.audit.seq,
                "fiber_user": self.identity.to_json() if self.identity else None}

    def enforcement_status(self) -> JsonMap:
        """What is enforced here: ``strict_limits``; ``host``, what a grant asking for every
        limit would get (no ``asked`` values); ``grants``, each provisioned grant's record."""
        host = host_enforcement(self.cgroups.predict(Limits(memory=1, pids=1, cpu=1.0)),
                                backend=self.cgroups.backend,
                                uncarved_reason=self._uncarved_reason(),
                                devices=host_devices(self.cgroups.confines_devices)).to_json()
        limits = host["limits"]
        assert isinstance(limits, dict)
        host["limits"] = {name: {k: v for k, v in entry.items() if k != "asked"}
                          for name, entry in limits.items()}
        return {"strict_limits": self.strict_limits, "host": host,
                "grants": {uid: g.enforcement.to_json() for uid, g in self._grants.items()}}

    def health(self) -> JsonMap:
        reading = self.home.liveness.health().read()
        fence = self.book.fence_end()
        return {"state": reading.state.value, "age": reading.age,
                "control_plane": reading.control_plane, "source_down": reading.down,
                "fence_ends_in": None if fence is None else max(0.0, fence - self.clock.mono()),
                "epoch": self.book.epoch}

    def ready(self) -> bool:
        """Whether a Clone can start now: a template is warm and work is not fenced (a
        home with a control plane fences until its first answer)."""
        return (any(g.template.state is TemplateState.READY for g in self._grants.values())
                and not self.book.fenced_now())

    def fibers_running(self) -> int:
        return sum(1 for f in self._fibers.values() if f.fiber.running)

    # ------------------------------------------------------------ internals: admission

    def book_spec(self, uid: str) -> FiberSpec | None:
        """The spec in force for ``uid`` (the newest token's), None when not held."""
        view = self.book.grant(uid)  # one grant's view, not all G of them
        return view.spec if view is not None else None

    def _lock(self, uid: str) -> asyncio.Lock:
        return self._locks.setdefault(uid, asyncio.Lock())

    def _refuse(self, vt: VerifiedToken, miss: Miss, **fields: object) -> AdmitRefused:
        self._write(AuditEvent.REFUSE, uid=vt.uid, jti=vt.jti, code=miss.code.value,
                    reason=miss.reason, detail=miss.detail, **fields)
        return AdmitRefused(miss)

    def _uncarved_reason(self) -> str:
        return f"no cgroup to enforce it in: {self.cgroups.status.cause}"

    def _expected(self, limits: Limits) -> Enforcement:
        """The enforcement record a grant with ``limits`` would get here (before carving)."""
        return grant_enforcement(limits, self.cgroups.predict(limits),
                                 backend=self.cgroups.backend,
                                 uncarved_reason=self._uncarved_reason(),
                                 devices=host_devices(self.cgroups.confines_devices))

    def _carved(self, cgroup: GrantCgroup | None, limits: Limits) -> Enforcement:
        """The enforcement record of a carved (or, None, uncarved) grant cgroup."""
        written, rule = (None, None) if cgroup is None else (cgroup.limits, cgroup.devices)
        return grant_enforcement(limits, written, backend=self.cgroups.backend,
                                 uncarved_reason=self._uncarved_reason(),
                                 devices=device_confinement(rule))

    def _refuse_unenforceable(self, vt: VerifiedToken, record: Enforcement) -> None:
        """Under strict limits: raise the audited ``unenforceable`` refusal when ``record``
        leaves a limit unenforced, and remember it for Clones naming the UID."""
        reason = record.refusal(vt.uid)
        if reason is None:
            return
        miss = Miss(MissCode.UNENFORCEABLE, reason,
                    detail=",".join(e.limit for e in record.unenforced()))
        self._unenforceable[vt.uid] = miss
        raise self._refuse(vt, miss, enforcement=record.to_json())

    async def _provision(self, vt: VerifiedToken, spec: FiberSpec) -> None:
        """Devices, cgroup and a warming template for a newly admitted grant."""
        try:
            channel, release = await self.home.device_source.devices(vt)
        except Exception as err:
            raise self._refuse(vt, Miss(MissCode.WARM_FAILED,
                                        f"devices for {vt.uid!r} refused: {err}",
                                        detail="devices_refused")) from None
        try:
            # Off the loop: its mkdirs wait on the kernel's cgroup lock, which templates
            # warming meanwhile (joining their cgroups) hold; 100 grants stalled it ~1 s.
            cgroup = await asyncio.to_thread(self.cgroups.carve_grant, vt.uid, spec.limits,
                                             channel.devices)
            enforcement = self._enforced(vt.uid, cgroup, spec.limits)
            if self.strict_limits:
                self._refuse_unenforceable(vt, enforcement)
            template = await self._start_template(vt.uid, spec, channel, cgroup)
        except (OSError, AdmitRefused) as err:
            await asyncio.to_thread(release)
            if isinstance(err, AdmitRefused):
                if vt.uid not in self._grants:  # nothing of the grant runs in it
                    with contextlib.suppress(OSError):
                        await self.cgroups.remove_grant(vt.uid)
                raise
            raise self._refuse(vt, Miss(MissCode.WARM_FAILED,
                                        f"cannot start the template of {vt.uid!r}: {err}",
                                        detail="template_start")) from None
        grant = _Grant(vt.uid, spec, template, channel, release, cgroup, enforcement)
        self._grants[vt.uid] = grant
        grant.watcher = self._spawn(self._watch(grant))

    async def _start_template(self, uid: str, spec: FiberSpec, channel: DeviceChannel,
                              cgroup: GrantCgroup | None) -> Template:
        env = template_env(os.environ, spec.template, channel)
        return await Template.start(uid, spec.template, env, cgroup, state_dir=self.state_dir,
                                    clock=self.clock, python=self.python, spares=self.spares,
                                    timeout=self.template_timeout, spares_once_cloned=True,
                                    spares_idle=self.spares_idle, identity=self.identity)

    def _enforced(self, uid: str, cgroup: GrantCgroup | None, limits: Limits) -> Enforcement:
        """The record of what carving wrote; audited (``enforcement``) when it differs from
        what was expected at admission (a limit write the kernel refused)."""
        record = self._carved(cgroup, limits)
        if record.outcome() != self._expected(limits).outcome():
            self._write(AuditEvent.ENFORCEMENT, uid=uid, enforcement=record.to_json())
        return record

    async def _replace_template(self, grant: _Grant, spec: FiberSpec) -> None:
        """A renewal changed the grant: write its limits again, warm a new template; the
        old one stops once its fibers have ended."""
        if grant.cgroup is not None and spec.limits != grant.spec.limits:
            grant.cgroup = await asyncio.to_thread(self.cgroups.carve_grant, grant.uid,
                                                   spec.limits, grant.channel.devices)
        grant.enforcement = self._carved(grant.cgroup, spec.limits)
        old = grant.template
        grant.template = await self._start_template(grant.uid, spec, grant.channel,
                                                    grant.cgroup)
        grant.spec = spec
        grant.retired.append(old)
        if grant.watcher is not None:
            grant.watcher.cancel()
        grant.watcher = self._spawn(self._watch(grant))
        self._spawn(self._drain(grant, old))

    async def _drain(self, grant: _Grant, old: Template) -> None:
        while old.fibers:
            await asyncio.gather(*(f.wait() for f in list(old.fibers.values())))
        await old.stop(self.grace)
        with contextlib.suppress(ValueError):
            grant.retired.remove(old)

    async def _watch(self, grant: _Grant) -> None:
        """Publish readiness on every flip of the template between warm and not warm;
        audit a failed warm, and a template given up on (``template_lost``: it died or
        stopped answering, and is re-warmed)."""
        template, state, published = grant.template, grant.template.state, False
        while state is not TemplateState.STOPPED:
            warm = state is TemplateState.READY
            if state is TemplateState.WARM_FAILED and template.warm_error is not None:
                self._write(AuditEvent.WARM_FAILED, uid=grant.uid, error=template.warm_error.error,
                            reason=template.warm_error.message)
            if state is TemplateState.REWARMING:
                with contextlib.suppress(OSError):
                    self._write(AuditEvent.TEMPLATE_LOST, uid=grant.uid, pid=template.pid,
                                reason=template.last_fault, restarts=template.restarts)
            if warm != published:
                await self._publish(grant.uid, warm)
                published = warm
            state = await template.wait_change(state)

    async def _publish(self, uid: str, ready: bool) -> None:
        try:
            await self.home.readiness.publish_ready(uid, ready)
        except Exception as err:  # the home republishes; say it once here
            log.warning("readiness of %s not published: %s", uid, err)

    async def _retire(self, uid: str, cause: str) -> None:
        """Stop a grant's fibers and template, release its devices, remove its cgroup.

        The stopping runs on its own task, shielded: a caller cancelled
        midway (drive, at shutdown) leaves it running, and ``shutdown``
        waits for it, so no template outlives fiberd.
        """
        async with self._lock(uid):
            grant = self._grants.pop(uid, None)
            if grant is None:
                return
            if grant.watcher is not None:
                grant.watcher.cancel()
            await asyncio.gather(*(w.close(cause) for w in list(self.windows.values())
                                   if w.uid == uid))
            self._note_releases(list(grant.template.fibers.values()), cause)
            stopping = asyncio.ensure_future(self._stop_grant(grant))
            self._retiring.add(stopping)
            stopping.add_done_callback(self._retiring.discard)
            await asyncio.shield(stopping)

    async def _stop_grant(self, grant: _Grant) -> None:
        await asyncio.gather(grant.template.stop(self.grace),
                             *(t.stop(self.grace) for t in grant.retired))
        await asyncio.to_thread(grant.release)
        try:
            await self.cgroups.remove_grant(grant.uid)
        except OSError as err:
            log.warning("cgroup of %s not removed: %s", grant.uid, err)
        await self._publish(grant.uid, False)

    # ------------------------------------------------------------ internals: state saves

    def _save_soon(self) -> None:
        """Start writing deferred admissions unless a save is under way (that one's end
        starts the next): admissions made meanwhile share one save."""
        if self._saving is None or self._saving.done():
            self._saving = self._spawn(self._save_unsaved())

    async def _save_unsaved(self) -> None:
        """Write the book's deferred admissions off the loop, until none is left. A failed
        save raises (logged as a failed task) and leaves them unsaved: the next admission,
        Clone or shutdown tries again."""
        store = self.book.store
        while store is not None:
            stamp, state = store.stamp(), self.book.take_unsaved()
            if state is None:
                return
            try:
                await asyncio.to_thread(store.write, stamp, state)
            except OSError:
                self.book.unsave()
                raise

    async def _saved(self) -> None:
        """Return once every admission made so far is saved; OSError when a save fails."""
        while self.book.unsaved or (self._saving is not None and not self._saving.done()):
            self._save_soon()
            assert self._saving is not None
            await asyncio.shield(self._saving)

    # ------------------------------------------------------------ internals: Clone

    async def _resolve(self, request: Clone) -> str | Miss:
        """The UID a Clone is for: the carried token, the named UID, else the only grant
        held."""
        if request.token is not None:
            return await self._admit_inline(request.token.encode())
        if request.grant is not None:
            return request.grant
        held = [g.uid for g in self.book.grants()]
        if len(held) == 1:
            return held[0]
        if not held and len(self._unenforceable) == 1:
            return next(iter(self._unenforceable.values()))
        if not held:
            reading = self.home.liveness.health().read()
            code = MissCode.UNKNOWN_GRANT if reading.fresh else MissCode.SOURCE_STALE
            why = f" ({reading.down})" if reading.down else ""
            return Miss(code, f"no grant is admitted here{why}; deliver one or carry a token",
                        retry_after=None if reading.fresh else 1.0)
        return Miss(MissCode.UNKNOWN_GRANT,
                    f"{len(held)} grants are admitted ({', '.join(held[:5])}); name one")

    async def _admit_inline(self, raw: bytes) -> str | Miss:
        """Verify and (when new) admit a token carried by a Clone; never lifts a denial."""
        try:
            vt = self.verify(raw)
        except TokenRefused as err:
            return invalid_token_miss(err)
        held = self.book.grant(vt.uid)
        if held is None or vt.jti not in held.jtis:
            try:
                await self.admit(vt)
            except AdmitRefused as err:
                return err.miss
        return vt.uid

    async def _start(self, grant: _Grant, decision: Start, request: Clone,
                     stdio: Stdio, caller: dict[str, int],
                     forked: Forked | None = None) -> FiberView | Miss:
        fiber_id = f"{self._prefix}-{next(self._ids)}"
        call, exe = request.call, request.exec
        fiber_request = FiberRequest(
            id=fiber_id, mode="call" if call is not None else "exec",
            target=call.target if call else None, args=call.args if call else (),
            kwargs=call.kwargs if call else {}, pickled=call.pickled if call else None,
            path=call.path if call else (),
            argv=exe.argv if exe else (),
            cwd=exe.cwd if exe else None, env=request.env,
            stdio=(stdio.stdin, stdio.stdout, stdio.stderr), jti=decision.jti,
            epoch=decision.epoch, deadline=decision.deadline.at)
        template = grant.template
        # Counted with the grant's fibers while it starts (another connection's Clone, or a
        # windowed batch's, is decided meanwhile); once forked, it is one of them.
        self._starting[grant.uid] += 1
        try:
            fiber = await template.fork(fiber_request)
        except TemplateNotReady as err:
            return self._miss(grant.uid, _not_ready_miss(grant.uid, template, err), caller)
        except ForkFailed as err:
            self._write(AuditEvent.CLONE_FAILED, uid=grant.uid, fiber=fiber_id, reason=str(err),
                        **caller)
            raise CloneFailed(str(err), err.errno) from None
        finally:
            self._starting[grant.uid] -= 1
            if not self._starting[grant.uid]:
                del self._starting[grant.uid]
        deadline_wall = self._wall(decision.deadline.at)
        view = FiberView(fiber, {"grant": grant.uid, "deadline_wall": deadline_wall})
        if forked is not None:
            forked(view)
        try:
            await self._write_durably(
                AuditEvent.CLONE, uid=grant.uid, jti=decision.jti, fiber=fiber_id,
                pid=fiber.pid, epoch=decision.epoch, deadline=deadline_wall,
                deadline_cause=decision.deadline.cause.value, mode=fiber.mode,
                health_age=self.home.liveness.health().read().age, **caller)
        except AuditWriteFailed:
            await self._unstart(fiber)
            raise
        if fiber.exit is not None:
            # It ended while its record was made durable: its exit record now, so that, as
            # for a fiber that ends later, the record is in the log before its end is seen.
            self._fibers[fiber_id] = view  # (and remembered, as one that ends later)
            self._gone[fiber_id] = next(self._registered)
            self._fiber_done(fiber)
            self._write_exits()
            return view
        self._fibers[fiber_id] = view
        self._listed[fiber_id] = next(self._registered)
        fiber.on_done(self._unlist)
        self._bound(fiber, decision)
        fiber.on_done(self._fiber_done)
        return view

    def _unlist(self, fiber: Fiber) -> None:
        """A fiber gone leaves the listing order (just before ``_fiber_done`` runs)."""
        self._gone[fiber.id] = self._listed.pop(fiber.id, 0)

    async def _unstart(self, fiber: Fiber) -> None:
        """Kill a fiber whose Clone could not be audited and wait until it is gone (it was
        never registered, listed or answered). Its exit is audited when the log takes it."""
        fiber.kill()
        await fiber.stop(0)
        with contextlib.suppress(OSError):
            self._write(AuditEvent.FIBER_EXIT, uid=fiber.uid, fiber=fiber.id, epoch=fiber.epoch,
                        cause="audit_failed", exit=fiber.exit.to_json() if fiber.exit else None)

    def _bound(self, fiber: Fiber, decision: Start) -> None:
        """Stop the fiber at its live deadline (the book's answer, asked again by the one
        deadline timer when it comes and on every rearm)."""

        def due() -> float:
            last = self.book.deadline(fiber.uid, decision.epoch, decision.started)
            if self.clock.mono() >= last.at:
                self._note_release(fiber, last.cause.value)
            return last.at

        self._deadlines.add(fiber, due)

    def _fiber_done(self, fiber: Fiber) -> None:
        """A fiber ended: unregister it; its ``fiber_exit`` record is written with the other
        exits of this loop step, in one append (``_write_exits``), before any task woken by
        the exit runs (they are scheduled after it). It is an observation, not a decision:
        under ``audit_fsync = always`` its fsync is the next decision's (a busy fiberd
        fsyncs once per task, not twice) or ``_sync_exits``' within ``EXIT_SYNC_DELAY``."""
        view = self._fibers.pop(fiber.id, None)
        order = self._gone.pop(fiber.id, 0)
        if view is not None:
            self._remember(view, order)
        self._released.discard(fiber.id)
        end = fiber.exit
        if self.on_fiber_end is not None:
            self.on_fiber_end(fiber.uid, end, fiber.mode)
        if not self._exits:
            asyncio.get_running_loop().call_soon(self._write_exits)
        self._exits.append((AuditEvent.FIBER_EXIT, _present(
            uid=fiber.uid, fiber=fiber.id, epoch=fiber.epoch,
            exit=end.to_json() if end else None)))

    def _write_exits(self) -> None:
        records, self._exits = self._exits, []
        try:
            self.audit.write_many(records, durable=False)
        except OSError as err:
            log.error("%d fiber exits unaudited: %s", len(records), err)
        if self.audit.unsynced and self._exit_sync is None:
            self._exit_sync = self._spawn(self._sync_exits())

    async def _sync_exits(self) -> None:
        """Make the exit records durable ``EXIT_SYNC_DELAY`` after the first of them,
        unless a decision's fsync did meanwhile (then this costs nothing)."""
        try:
            await self.clock.sleep(EXIT_SYNC_DELAY)
            self.audit.sync()
        except OSError as err:
            log.error("fsync of the audit log's fiber exits failed: %s", err)
        finally:
            self._exit_sync = None

    def _note_release(self, fiber: Fiber, cause: str, **fields: object) -> None:
        """Audit that fiberd is stopping a running fiber and why (once per fiber), and tell
        the fiber its reason (``_stop_reason``), which its exit event carries.

        A stop goes ahead even when its record cannot be written (a full disk):
        stopping is never the decision an audit failure may hold back; it is logged.
        """
        self._note_releases([fiber], cause, **fields)

    def _note_releases(self, fibers: Sequence[Fiber], cause: str, **fields: object) -> None:
        """``_note_release`` of many fibers at once: their records in one append."""
        records: list[tuple[str, dict[str, object]]] = []
        for fiber in fibers:
            if fiber.id in self._released or not fiber.running:
                continue
            fiber.note_reason(*self._stop_reason(fiber, cause, fields))
            self._released.add(fiber.id)
            records.append((AuditEvent.RELEASE, _present(
                uid=fiber.uid, fiber=fiber.id, epoch=fiber.epoch, cause=cause, **fields)))
        try:
            self.audit.write_many(records)
        except AuditWriteFailed as err:
            log.error("stopping %d fibers (%s) unaudited: %s", len(records), cause, err)

    def _stop_reason(self, fiber: Fiber, cause: str,
                     fields: dict[str, object]) -> tuple[str, str]:
        """The fiber's reason code and line for a release ``cause`` (audit's word)."""
        spec = self.book_spec(fiber.uid)
        seconds = spec.limits.seconds if spec is not None else None
        fence = self.book.fence_ttl
        match cause:
            case "seconds":
                return "deadline", (f"deadline {seconds:g} s (limits.seconds) reached"
                                    if seconds is not None else "deadline reached")
            case "lease" | "expired":
                return "lease_end", (f"the lease of grant {fiber.uid!r} ended (no renewed "
                                     "token was delivered)")
            case "fence":
                return "fence", ("fenced: the control plane was silent for over "
                                 f"{fence:g} s" if fence else "fenced: the control plane "
                                 "was silent")
            case "removed":
                return "removed", f"grant {fiber.uid!r} was removed"
            case "revoked":
                why = f" ({self._epoch_reason})" if self._epoch_reason else ""
                return "epoch", f"epoch {fiber.epoch} was revoked{why}"
            case "stop_request":
                return "stopped", (f"stopped on request (uid {fields.get('caller_uid')}, "
                                   f"pid {fields.get('caller_pid')})")
            case "shutdown":
                return "fiberd_shutdown", "fiberd is shutting down"
        return cause, f"stopped by fiberd ({cause})"

    def _miss(self, uid: str | None, miss: Miss, caller: dict[str, int]) -> Miss:
        self._write(AuditEvent.MISS, uid=uid, code=miss.code.value, reason=miss.reason,
                    detail=miss.detail, epoch=self.book.epoch,
                    health_age=self.home.liveness.health().read().age, **caller)
        return miss

    def _fiber(self, fiber_id: str) -> FiberView:
        view = self._fibers.get(fiber_id)
        if view is None:
            raise FiberNotFound(fiber_id)
        return view

    # ------------------------------------------------------------ internals: plumbing

    def _wall(self, mono: float) -> float:
        return self.clock.wall() + (mono - self.clock.mono())

    def _write(self, event: AuditEvent, **fields: object) -> None:
        self.audit.write(event, **_present(**fields))

    async def write_many_durably(self, records: Sequence[tuple[str, dict[str, object]]],
                                 ) -> None:
        """``_write_durably`` of several records in one append and one fsync."""
        if self.audit.fsync is not FsyncPolicy.ALWAYS:
            self.audit.write_many([(event, _present(**fields)) for event, fields in records])
            return
        if self._syncer is None:
            self._syncer = AuditSyncer(self.audit.fileno(), self.python)
        self.audit.write_many([(event, _present(**fields)) for event, fields in records],
                              durable=False)
        appended = self.audit.appended
        try:
            await self._syncer.synced()
        except OSError as err:
            raise AuditWriteFailed(err.errno or errno.EIO, f"audit log {self.audit.path}: "
                                   f"records written, not made durable "
                                   f"({err.strerror or err})") from None
        self.audit.synced_through(appended)

    async def _write_durably(self, event: AuditEvent, **fields: object) -> None:
        """Write a decision's record and return once it is durable, as ``_write`` does, but
        under ``audit_fsync = always`` with the fsync made by the helper process
        (core/audit_syncer.py, started on first use) while the loop goes on. Raises
        AuditWriteFailed (a record whose fsync failed stays in the file, its durability
        unknown)."""
        if self.audit.fsync is not FsyncPolicy.ALWAYS:
            self._write(event, **fields)
            return
        if self._syncer is None:
            self._syncer = AuditSyncer(self.audit.fileno(), self.python)
        self.audit.write_many([(event, _present(**fields))], durable=False)
        appended = self.audit.appended
        try:
            await self._syncer.synced()
        except OSError as err:
            raise AuditWriteFailed(err.errno or errno.EIO, f"audit log {self.audit.path}: "
                                   f"record written, not made durable "
                                   f"({err.strerror or err})") from None
        self.audit.synced_through(appended)

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[object]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("runtime task failed: %s", task.exception())


def _present(**fields: object) -> dict[str, object]:
    """The audit fields that have a value (None is left out)."""
    return {k: v for k, v in fields.items() if v is not None}


def _audit_failed(err: AuditWriteFailed) -> Miss:
    """The miss of a Clone that was refused because its audit record could not be written."""
    return Miss(MissCode.AUDIT_FAILED, f"nothing started: the audit log cannot be written "
                f"({err.strerror or err}); retry once it has room", retry_after=1.0)


def _limits_json(spec: FiberSpec) -> dict[str, object]:
    limits = spec.limits
    return {k: v for k, v in (("fibers", limits.fibers), ("memory", limits.memory),
                              ("pids", limits.pids), ("cpu", limits.cpu),
                              ("seconds", limits.seconds)) if v is not None}
