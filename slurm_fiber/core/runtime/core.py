"""The core runtime: grant decisions carried out with templates, fibers, cgroups and devices.

``Core`` is what the edges call, a façade over collaborators with one job each:
``Admission`` (admission.py: grants in and out, epochs, scope loss, saves), ``Grants``
(grants.py: each admitted grant's devices, cgroup and template), ``Clones`` (clones.py:
a Clone turned into a fiber, and the fibers listed), ``Upkeep`` (upkeep.py: deadlines,
expiry, idle spares) and ``AuditTrail`` (trail.py: what is recorded when). A home's
deliveries reach it through ``drive`` (it is drive's ``Admitter``: verify, lift, admit,
remove); the socket API reaches it as its ``Service`` (clone, list, stop, status ...);
fiberd calls ``bump_epoch``, ``lose_scope``, ``maintain`` and ``shutdown``.

Every decision is the ``GrantBook``'s (pure, on the injected clock); the runtime only
carries it out. Guarantees: every decision is written to the audit log, durable per the
log's policy, before it is answered; a decision that cannot be audited raises instead
of being answered (a Clone whose record cannot be written kills the fiber it forked and
answers the retryable miss ``audit_failed``); a Clone never waits for the control plane;
nothing here raises into the event loop for a refused input: refusals become misses or
``AdmitRefused`` with a code and a one-line reason. All methods run on fiberd's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from slurm_fiber.core.api.service import Clone, Forked, JsonMap, Peer, Stdio
from slurm_fiber.core.audit.log import AuditLog, AuditWriteFailed
from slurm_fiber.core.book.decisions import Admitted, GrantBook, Start
from slurm_fiber.core.book.misses import Miss
from slurm_fiber.core.cgroups.manager import CgroupManager
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.fibers.fiber import FiberEnd
from slurm_fiber.core.fibers.handles import FiberView
from slurm_fiber.core.runtime.admission import Admission
from slurm_fiber.core.runtime.clones import Clones
from slurm_fiber.core.runtime.grants import Grant, Grants
from slurm_fiber.core.runtime.identity import FiberIdentity
from slurm_fiber.core.runtime.shared import (
    DEFAULT_HISTORY,
    DEFAULT_HISTORY_SECONDS,
    DEFAULT_PRUNE_AFTER,
    Parts,
    Settings,
)
from slurm_fiber.core.runtime.task_window import TaskWindowRun, open_window
from slurm_fiber.core.runtime.trail import AuditTrail, audit_failed
from slurm_fiber.core.runtime.upkeep import Upkeep
from slurm_fiber.core.seam import HomePorts
from slurm_fiber.core.templates.parent import DEFAULT_TIMEOUT
from slurm_fiber.core.trust.grant import VerifiedToken
from slurm_fiber.core.trust.tokens import TokenVerifier


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
        settings = Settings(state_dir=state_dir, grace=grace, spares=spares,
                            spares_idle=spares_idle, template_timeout=template_timeout,
                            python=python, prune_after=prune_after,
                            strict_limits=strict_limits, identity=identity, history=history,
                            history_seconds=history_seconds, task_window=task_window)
        self.parts = Parts(home, book, cgroups, clock, settings)
        self.home, self.book, self.audit, self.cgroups, self.clock = (home, book, audit,
                                                                      cgroups, clock)
        self.identity = identity  # whom templates and fibers run as (runtime/identity.py)
        self.trail = AuditTrail(audit, self.parts)
        self.grants = Grants(self.parts, self.trail)
        self.upkeep = Upkeep(self.parts, self.trail, self.grants)
        self.admission = Admission(self.parts, verifier, self.trail, self.grants, self.upkeep)
        self.clones = Clones(self.parts, self.trail, self.grants, self.admission, self.upkeep)

    @property
    def closing(self) -> bool:
        """Set once fiberd stops: nothing more is admitted, every Clone answers ``closed``."""
        return self.parts.closing

    @closing.setter
    def closing(self, value: bool) -> None:
        self.parts.closing = value

    @property
    def task_window(self) -> str:
        """"template": a windowed batch of exec items runs as a task window
        (core/runtime/task_window.py); "fiberd" (the default): fiberd starts each item."""
        return self.parts.settings.task_window

    @property
    def windows(self) -> dict[str, TaskWindowRun]:
        """The task windows open, by id."""
        return self.parts.windows

    @property
    def on_fiber_end(self) -> Callable[[str, FiberEnd | None, str], None] | None:
        """Told of every registered fiber's end (grant uid, end, mode): the metrics'."""
        return self.clones.on_fiber_end

    @on_fiber_end.setter
    def on_fiber_end(self, hook: Callable[[str, FiberEnd | None, str], None] | None) -> None:
        self.clones.on_fiber_end = hook

    # ------------------------------------------------------------ Admitter (drive)

    def verify(self, raw: bytes | str) -> VerifiedToken:
        return self.admission.verify(raw)

    def lift(self, uid: str) -> bool:
        return self.admission.lift(uid)

    async def admit(self, vt: VerifiedToken) -> Admitted:
        return await self.admission.admit(vt)

    async def remove(self, uid: str) -> None:
        await self.admission.remove(uid)

    # ------------------------------------------------------------ fiberd

    async def bump_epoch(self, reason: str) -> int:
        return await self.admission.bump_epoch(reason)

    async def lose_scope(self, reason: str, removes_grants: bool) -> None:
        await self.admission.lose_scope(reason, removes_grants)

    async def maintain(self, every: float = 1.0) -> None:
        await self.upkeep.maintain(every)

    async def shutdown(self) -> None:
        """Refuse new work, stop every fiber and template, release devices and cgroups.

        Returns once everything is gone. Idempotent.
        """
        self.closing = True
        with contextlib.suppress(OSError):  # said by saved; the admissions are redelivered
            await self.admission.saved()
        await asyncio.gather(*(self.grants.retire(uid, "shutdown")
                               for uid in self.grants.uids()))
        await self.grants.wait_retiring()
        await self.upkeep.close()
        await self.parts.cancel_tasks()
        self.trail.close()

    # ------------------------------------------------------------ Service (socket API)

    async def clone(self, request: Clone, peer: Peer, stdio: Stdio) -> FiberView | Miss:
        return await self.clones.clone(request, peer, stdio)

    async def clone_batch(self, requests: Sequence[Clone], peer: Peer, stdios: Sequence[Stdio],
                          batch: int | None = None, forked: Forked | None = None,
                          ) -> list[FiberView | Miss | Exception]:
        return await self.clones.clone_batch(requests, peer, stdios, batch, forked)

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
            return audit_failed(err)

    def decide(self, uid: str, places: int, caller: dict[str, int]) -> Start | Miss:
        return self.clones.decide(uid, places, caller)

    async def resolve(self, request: Clone) -> str | Miss:
        return await self.clones.resolve(request)

    def grant(self, uid: str) -> Grant | None:
        return self.grants.get(uid)

    def miss(self, uid: str | None, miss: Miss, caller: dict[str, int]) -> Miss:
        """Audit a miss and return it."""
        return self.trail.miss(uid, miss, caller)

    def wall(self, mono: float) -> float:
        return self.parts.wall(mono)

    async def write_many_durably(self, records: Sequence[tuple[str, dict[str, object]]],
                                 ) -> None:
        await self.trail.write_many_durably(records)

    # ------------------------------------------------------------ the fibers

    def list_fibers(self, after: str | None = None, limit: int | None = None,
                    ended: bool = False) -> tuple[Sequence[JsonMap], str | None]:
        return self.clones.list_fibers(after, limit, ended)

    def inspect_fiber(self, fiber_id: str) -> JsonMap:
        return self.clones.inspect_fiber(fiber_id)

    async def stop_fiber(self, fiber_id: str, grace: float | None, peer: Peer) -> JsonMap:
        return await self.clones.stop_fiber(fiber_id, grace, peer)

    def signal_fiber(self, fiber_id: str, signum: int, peer: Peer) -> bool:
        return self.clones.signal_fiber(fiber_id, signum, peer)

    def list_grants(self) -> Sequence[JsonMap]:
        return self.grants.list_grants()

    def fibers_running(self) -> int:
        return self.clones.fibers_running()

    def status(self) -> JsonMap:
        cgroups = self.cgroups.status.to_json()
        cgroups["backend"] = self.cgroups.mode
        cgroups["enforced"] = self.cgroups.describe()
        return {"home": self.home.name(), "pid": os.getpid(), "epoch": self.book.epoch,
                "closing": self.closing, "grants": len(self.book.grants()),
                "templates": self.grants.templates(),
                "templates_stopping": self.grants.stopping,
                "fibers_running": self.fibers_running(), "cgroups": cgroups,
                "mode": "carved" if cgroups["carved"] else "uncarved",
                "enforcement": self.grants.enforcement_status(),
                "scope": {c.key: c.value for c in self.home.liveness.scope()},
                "audit_path": str(self.audit.path), "audit_seq": self.audit.seq,
                "fiber_user": self.identity.to_json() if self.identity else None}

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
        return self.grants.any_ready() and not self.book.fenced_now()
