"""Clones: a Clone request turned into a running fiber, or a miss, and the fibers it made.

``Clones`` resolves which grant a Clone is for (a carried token, verified and admitted
inline, the named UID, else the only grant held), asks the book
to decide (counting the grant's fibers still starting, so a burst cannot pass its
``fibers`` limit), has the grant's template fork the fiber and writes the Clone's record,
durable, before the fiber is answered or registered: a fiber whose record cannot be
written is killed and the Clone answers ``audit_failed``. Each registered fiber is bound
to its deadline (upkeep.py), listed in registration order, and remembered for a while
once ended (``history`` records for ``history_seconds``). A Clone never waits for the
control plane; every miss is audited; a fork the template could not make raises
``CloneFailed`` (audited). Once ``closing`` is set every Clone answers ``closed``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from slurm_fiber.core.api.service import (
    Clone,
    FiberNotFound,
    Forked,
    JsonMap,
    Peer,
    Stdio,
    page,
)
from slurm_fiber.core.audit.log import AuditEvent, AuditWriteFailed
from slurm_fiber.core.book.decisions import RETRY_HINT, Start, TemplateView, closed_miss
from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.fibers.fiber import Fiber, FiberEnd
from slurm_fiber.core.fibers.handles import FiberView
from slurm_fiber.core.runtime.admission import Admission
from slurm_fiber.core.runtime.grants import Grant, Grants
from slurm_fiber.core.runtime.shared import Parts
from slurm_fiber.core.runtime.trail import AuditTrail, audit_failed
from slurm_fiber.core.runtime.upkeep import Upkeep
from slurm_fiber.core.templates.parent import (
    FiberRequest,
    ForkFailed,
    Template,
    TemplateNotReady,
    TemplateState,
)

log = logging.getLogger("slurm_fiber.core.runtime.clones")


class CloneFailed(Exception):
    """A Clone the book allowed but the template could not start (one line; audited).
    ``errno``: the cause's, when it was an OSError (EMFILE/ENFILE: the API answers
    ``busy``, docs/socket-protocol.md)."""

    def __init__(self, reason: str, errno: int | None = None) -> None:
        super().__init__(reason)
        self.errno = errno


class Clones:
    """The Clones and fibers of one fiberd (see the module doc)."""

    def __init__(self, parts: Parts, trail: AuditTrail, grants: Grants, admission: Admission,
                 upkeep: Upkeep) -> None:
        self.parts = parts
        self.trail = trail
        self.grants = grants
        self.admission = admission
        self.upkeep = upkeep
        # told of every registered fiber's end (grant uid, end, mode): the metrics' fiber_ended
        self.on_fiber_end: Callable[[str, FiberEnd | None, str], None] | None = None
        self._fibers: dict[str, FiberView] = {}
        # Ended fibers' last records (ended at, listing order, record), oldest first: the
        # last ``history`` of them, for ``history_seconds`` (inspect_fiber, list_fibers'
        # ``ended``), so a fiber that ended is still seen for a while, within bounds.
        self._ended: dict[str, tuple[float, int, JsonMap]] = {}
        self._gone: dict[str, int] = {}  # listing order of fibers ending now
        self._listed: dict[str, int] = {}  # fiber id -> registration order (list pages)
        self._registered = itertools.count(1)
        self._ids = itertools.count(1)
        self._prefix = os.urandom(3).hex()
        self._starting: Counter[str] = Counter()  # Clones deciding past, not yet started, by UID

    # ------------------------------------------------------------ Clone

    async def clone(self, request: Clone, peer: Peer, stdio: Stdio) -> FiberView | Miss:
        """Resolve the grant, decide, and fork a fiber, or say which miss applies.

        Raises CloneFailed when the template cannot fork (audited).
        """
        caller = {"caller_uid": peer.uid, "caller_pid": peer.pid}
        try:
            return await self._clone(request, stdio, caller)
        except AuditWriteFailed as err:
            log.error("clone refused: %s", err)
            return audit_failed(err)

    async def _clone(self, request: Clone, stdio: Stdio,
                     caller: dict[str, int]) -> FiberView | Miss:
        if self.parts.closing:
            return self.trail.miss(None, closed_miss(), caller)
        resolved = await self._resolve(request)
        if isinstance(resolved, Miss):
            return self.trail.miss(None, resolved, caller)
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
            resolved = closed_miss() if self.parts.closing else await self._resolve(first)
            if isinstance(resolved, Miss):
                return [self.trail.miss(None, resolved, caller)] * len(requests)
        except AuditWriteFailed as err:
            log.error("clone batch refused: %s", err)
            return [audit_failed(err)] * len(requests)
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
            return audit_failed(err)
        except CloneFailed as err:
            return err
        except Exception as err:  # a fault of fiberd's: that item is answered internal
            log.exception("clone batch item failed")
            return err

    async def _clone_for(self, uid: str, request: Clone, stdio: Stdio,
                         caller: dict[str, int],
                         forked: Forked | None = None) -> FiberView | Miss:
        """A Clone whose grant is resolved: the book's decision, then the fork."""
        grant = self.grants.get(uid)
        if grant is None and uid in self.grants.unenforceable:
            return self.trail.miss(uid, self.grants.unenforceable[uid], caller)
        if self.parts.book.unsaved:
            try:
                await self.admission.saved()
            except OSError as err:
                return self.trail.miss(uid, Miss(MissCode.COLD, f"admission of {uid!r} not "
                                                 f"saved yet: {err}", retry_after=RETRY_HINT,
                                                 detail="state_unsaved"), caller)
            grant = self.grants.get(uid)
        decision = self.decide(uid, 1, caller)
        if isinstance(decision, Miss):
            return decision
        assert grant is not None
        return await self._start(grant, decision, request, stdio, caller, forked)

    def decide(self, uid: str, places: int, caller: dict[str, int]) -> Start | Miss:
        """The book's decision for ``places`` more fibers of ``uid`` (a miss audited),
        counting its fibers running, its Clones still starting (another connection's,
        or a windowed batch's, or a burst could pass ``fibers``) and its task windows'
        places."""
        grant = self.grants.get(uid)
        running = len(grant.template.fibers) + self._starting[uid] + sum(
            w.size for w in self.parts.windows.values() if w.uid == uid) \
            if grant is not None else 0
        decision = self.parts.book.decide_clone(uid, _template_view(grant),
                                                running + places - 1)
        if isinstance(decision, Miss):
            return self.trail.miss(uid, decision, caller)
        return decision

    async def resolve(self, request: Clone) -> str | Miss:
        """The UID a Clone is for (``_resolve``), the book's admissions saved."""
        resolved = await self._resolve(request)
        if isinstance(resolved, str) and self.parts.book.unsaved:
            try:
                await self.admission.saved()
            except OSError as err:
                return Miss(MissCode.COLD, f"admission of {resolved!r} not saved yet: {err}",
                            retry_after=RETRY_HINT, detail="state_unsaved")
        return resolved

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
        if self.parts.settings.history <= 0:
            return
        self._ended[view.fiber.id] = (self.parts.clock.mono(), order, view.to_json())
        self._forget_old()

    def _forget_old(self) -> None:
        """Drop the ended records past ``history`` in number or ``history_seconds`` in age."""
        oldest = self.parts.clock.mono() - self.parts.settings.history_seconds
        while self._ended:
            fid, (at, _, _) = next(iter(self._ended.items()))
            if len(self._ended) <= self.parts.settings.history and at >= oldest:
                break
            del self._ended[fid]

    async def stop_fiber(self, fiber_id: str, grace: float | None, peer: Peer) -> JsonMap:
        view = self._fiber(fiber_id)
        self.trail.note_release(view.fiber, "stop_request", caller_uid=peer.uid,
                           caller_pid=peer.pid)
        await view.fiber.stop(self.parts.settings.grace if grace is None else grace)
        return view.to_json()

    def signal_fiber(self, fiber_id: str, signum: int, peer: Peer) -> bool:
        return self._fiber(fiber_id).fiber.signal(signum)

    def fibers_running(self) -> int:
        return sum(1 for f in self._fibers.values() if f.fiber.running)

    # ------------------------------------------------------------ internals

    async def _resolve(self, request: Clone) -> str | Miss:
        """The UID a Clone is for: the carried token, the named UID, else the only grant
        held."""
        if request.token is not None:
            return await self.admission.admit_inline(request.token.encode())
        if request.grant is not None:
            return request.grant
        held = [g.uid for g in self.parts.book.grants()]
        if len(held) == 1:
            return held[0]
        if not held and len(self.grants.unenforceable) == 1:
            return next(iter(self.grants.unenforceable.values()))
        if not held:
            reading = self.parts.home.liveness.health().read()
            code = MissCode.UNKNOWN_GRANT if reading.fresh else MissCode.SOURCE_STALE
            why = f" ({reading.down})" if reading.down else ""
            return Miss(code, f"no grant is admitted here{why}; deliver one or carry a token",
                        retry_after=None if reading.fresh else 1.0)
        return Miss(MissCode.UNKNOWN_GRANT,
                    f"{len(held)} grants are admitted ({', '.join(held[:5])}); name one")

    async def _start(self, grant: Grant, decision: Start, request: Clone,
                     stdio: Stdio, caller: dict[str, int],
                     forked: Forked | None = None) -> FiberView | Miss:
        fiber_id = f"{self._prefix}-{next(self._ids)}"
        fiber_request = fiber_order(fiber_id, request, stdio, decision.jti, decision.epoch,
                                    decision.deadline.at)
        template = grant.template
        # Counted with the grant's fibers while it starts (another connection's Clone, or a
        # windowed batch's, is decided meanwhile); once forked, it is one of them.
        self._starting[grant.uid] += 1
        try:
            fiber = await template.fork(fiber_request)
        except TemplateNotReady as err:
            return self.trail.miss(grant.uid, _not_ready_miss(grant.uid, template, err), caller)
        except ForkFailed as err:
            self.trail.write(AuditEvent.CLONE_FAILED, uid=grant.uid, fiber=fiber_id,
                             reason=str(err), **caller)
            raise CloneFailed(str(err), err.errno) from None
        finally:
            self._starting[grant.uid] -= 1
            if not self._starting[grant.uid]:
                del self._starting[grant.uid]
        deadline_wall = self.parts.wall(decision.deadline.at)
        view = FiberView(fiber, {"grant": grant.uid, "deadline_wall": deadline_wall})
        if forked is not None:
            forked(view)
        try:
            await self.trail.write_durably(
                AuditEvent.CLONE, uid=grant.uid, jti=decision.jti, fiber=fiber_id,
                pid=fiber.pid, epoch=decision.epoch, deadline=deadline_wall,
                deadline_cause=decision.deadline.cause.value, mode=fiber.mode,
                health_age=self.parts.home.liveness.health().read().age, **caller)
        except AuditWriteFailed:
            await self._unstart(fiber)
            raise
        if fiber.exit is not None:
            # It ended while its record was made durable: its exit record now, so that, as
            # for a fiber that ends later, the record is in the log before its end is seen.
            self._fibers[fiber_id] = view  # (and remembered, as one that ends later)
            self._gone[fiber_id] = next(self._registered)
            self._fiber_done(fiber)
            self.trail.write_exits()
            return view
        self._fibers[fiber_id] = view
        self._listed[fiber_id] = next(self._registered)
        fiber.on_done(self._unlist)
        self.upkeep.bound(fiber, decision)
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
        self.trail.unstarted(fiber)

    def _fiber_done(self, fiber: Fiber) -> None:
        """A fiber ended: unregister it, remember its last record, tell ``on_fiber_end``,
        and have its ``fiber_exit`` record written (``AuditTrail.fiber_exit``: with the
        other exits of this loop step, before any task woken by the exit runs)."""
        view = self._fibers.pop(fiber.id, None)
        order = self._gone.pop(fiber.id, 0)
        if view is not None:
            self._remember(view, order)
        if self.on_fiber_end is not None:
            self.on_fiber_end(fiber.uid, fiber.exit, fiber.mode)
        self.trail.fiber_exit(fiber)

    def _fiber(self, fiber_id: str) -> FiberView:
        view = self._fibers.get(fiber_id)
        if view is None:
            raise FiberNotFound(fiber_id)
        return view


def _template_view(grant: Grant | None) -> TemplateView:
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


def fiber_order(fiber_id: str, request: Clone, stdio: Stdio, jti: str, epoch: int,
                deadline: float) -> FiberRequest:
    """The template's order for one fiber of ``request`` (its call or its exec), with its
    passed ``stdio`` and the admission's jti, epoch and deadline. Pure."""
    call, exe = request.call, request.exec
    return FiberRequest(
        id=fiber_id, mode="call" if call is not None else "exec",
        target=call.target if call else None, args=call.args if call else (),
        kwargs=call.kwargs if call else {}, pickled=call.pickled if call else None,
        path=call.path if call else (), argv=exe.argv if exe else (),
        cwd=exe.cwd if exe else None, env=request.env,
        stdio=(stdio.stdin, stdio.stdout, stdio.stderr), jti=jti, epoch=epoch,
        deadline=deadline)
