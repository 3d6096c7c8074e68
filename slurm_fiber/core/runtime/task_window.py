"""A task window (``task_window = "template"``): fiberd decides once, the template runs the tasks.

``open_window`` is the runtime's side of a windowed ``clone_batch`` of exec and call items when
fiberd runs with ``task_window = "template"`` (off by default; docs/design.md, "Task
windows"). It resolves the grant and decides once for the whole window (the book's
``decide_clone``, counting the window's ``size`` places against the grant's ``fibers``
limit), writes the window's admission record (``window_open``) and makes it durable
before the template hears of the window, then hands the template the tasks
(core/templates/window_parent.py, core/templates/child/window_run.py). From then on:

- no fiber of the window runs past min(lease, fence): the template starts none at or
  after the deadline fiberd gave it, and fiberd, asking the book again when the deadline
  comes (a sync may have moved the fence, a renewal the lease), either extends it or
  closes the window and kills its leaves; a fence, an epoch bump, a removal and fiberd's
  shutdown close it at once, and ``close`` returns once nothing of it runs;
- every fiber is in the audit log: each report's starts and ends are written as
  ``fiber_start``/``fiber_exit`` records, in one append, and made durable before
  ``batches`` gives them to the client; a fiber the template started and never
  reported (it died) is written as a lost start from its leaf's CPU figures;
- per-fiber ``seconds`` are kept by the template (it kills the leaf); what fiberd
  guarantees itself is the window's deadline;
- a call item's record comes back as on fiberd's own path: fiberd makes its result
  channel (a SEQPACKET socketpair, as for a spare), passes the fiber's end with the
  order and reads its own with the reader a spare's call has (``ResultReader``, bounded
  by a reply's size, ``MAX_RESULT``); the fiber's exit carries its ``result`` or
  ``error`` (``call_outcome``: ``FiberDied`` when it wrote none), and ``written`` tells
  when the record is complete, for an early ``result`` event before the exit.

Not in the window path (answered by fiberd's own path instead): items of a template
that runs as another account (``fiber_user``), a batch whose descriptors (stdio, and
one result channel per call) would pass one message's ``MAX_FDS``. Window fibers are
not listed by ``list_fibers`` and cannot be stopped one by one; memory peaks and OOM
counts are not read per fiber.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slurm_fiber.core.api.service import Clone, FiberExit, Peer, Stdio
from slurm_fiber.core.audit.log import AuditEvent, AuditWriteFailed
from slurm_fiber.core.book.decisions import Deadline, closed_miss
from slurm_fiber.core.book.misses import Miss, MissCode
from slurm_fiber.core.cgroups.leaves import LeafCreateFailed
from slurm_fiber.core.fibers.fiber import ResultReader
from slurm_fiber.core.fibers.handles import call_outcome
from slurm_fiber.core.runtime.clones import fiber_order
from slurm_fiber.core.templates.child.window_run import MAX_FDS, MAX_TASKS
from slurm_fiber.core.templates.parent import Template, TemplateNotReady
from slurm_fiber.core.templates.window_parent import Batch, WindowLink, close_fds
from slurm_fiber.protocol.limits import MAX_RESULT

if TYPE_CHECKING:
    from slurm_fiber.core.runtime.core import Core

log = logging.getLogger(__name__)

TASK_WINDOW_CHOICES = ("fiberd", "template")
_IDS = itertools.count(1)
_PREFIX = os.urandom(2).hex()

CLOSE_MISSES = {  # a window's close cause -> the miss its tasks not started get
    "fence": MissCode.FENCED, "lease": MissCode.EXPIRED, "revoked": MissCode.FENCED,
    "removed": MissCode.DENIED, "shutdown": MissCode.CLOSED, "cancelled": MissCode.CLOSED,
}


@dataclass
class TaskWindowRun:
    """One open window (module doc): ``batches`` yields its events for the client."""

    core: Core
    id: str
    uid: str
    jti: str
    epoch: int
    template: Template
    link: WindowLink
    keys: list[str]
    size: int
    modes: list[str] = field(default_factory=list)  # each task's mode, "exec" or "call"
    readers: dict[str, ResultReader] = field(default_factory=dict)  # call fibers', by id
    cause: str | None = None  # why it was closed, once it is
    answered: set[str] = field(default_factory=set)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    _keeper: asyncio.Task[None] | None = None

    def fiber_id(self, key: object) -> str:
        return f"{self.id}.{self.keys.index(str(key))}" if key in self.keys else f"{self.id}.?"

    async def batches(self) -> AsyncIterator[tuple[list[dict[str, object]],
                                                   list[FiberExit], bool]]:
        """Each batch the template reports, as (started entries, exits, last), once its
        records are durable. The last batch answers the tasks that will never start."""
        try:
            while True:
                batch = await self.link.batches.get()
                entries, exits = await self._audit(batch)
                if not batch.done:  # durable: the template may send its next report
                    self.template.window_order(self.id, "window_ack")
                if batch.done:
                    entries += self._unstarted()
                    self._drop_readers()
                    self.template.give_back_window(self.link.leaves)
                    self.closed.set()
                yield entries, exits, batch.done
                if batch.done:
                    return
        finally:
            if not self.closed.is_set():  # the client left: close, kill, wait for the end
                await self.close("cancelled")
            self._drop_readers()
            self.core.windows.pop(self.id, None)
            if self._keeper is not None:
                self._keeper.cancel()

    def mode(self, fiber_id: str) -> str:
        """The mode of the window's fiber ``fiber_id`` ("call" or "exec")."""
        _, _, n = fiber_id.rpartition(".")
        return self.modes[int(n)] if n.isdigit() and int(n) < len(self.modes) else "exec"

    def written(self, fiber_id: str) -> asyncio.Future[None] | None:
        """For a call fiber whose record is still being read: done once it is complete
        (end of file on its channel, which may be before its exit); else None."""
        reader = self.readers.get(fiber_id)
        return reader.complete if reader is not None else None

    def result_event(self, fiber_id: str) -> dict[str, object] | None:
        """A call fiber's early ``result`` event (as fiberd's path's ``call_result``):
        its ``fiber_id`` and ``result`` or ``error``; None when it wrote no record (its
        exit says how it ended) or its exit was taken already."""
        reader = self.readers.get(fiber_id)
        record = reader.record() if reader is not None else None
        if record is None:
            return None
        result, error = call_outcome(record)
        return {"fiber_id": fiber_id, **({"result": result} if error is None
                                         else {"error": error})}

    def cancel(self) -> list[str]:
        """Start nothing more (the client's ``cancel``): the keys that will not start,
        answered so (the running fibers go on)."""
        self.template.window_order(self.id, "window_close")
        keys = [key for key in self.keys if key not in self.answered]
        self.answered.update(keys)
        return keys

    async def close(self, cause: str) -> None:
        """Start nothing more, kill what runs (its leaves), and return once the template's
        last report is in (or it is gone, or ``template_timeout`` passed: the leaves are
        killed again then). Audited once (``window_close``)."""
        if self.cause is None:
            self.cause = cause
            with contextlib.suppress(OSError):
                self.core.audit.write(AuditEvent.WINDOW_CLOSE, uid=self.uid, window=self.id,
                                      cause=cause, epoch=self.epoch)
            self.template.window_order(self.id, "window_close")
            self.link.kill()
        if self.closed.is_set():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.template.timeout):
                await self.closed.wait()
                return
        self.link.gone()  # no last report in time: the leaves are killed, what ran is read

    async def keep_deadline(self, first: Deadline) -> None:
        """Ask the book again whenever the window's deadline comes: extend the template's,
        or close the window (its cause: lease, fence, revoked, removed)."""
        told = first.at
        while not self.closed.is_set():
            live = self.core.book.deadline(self.uid, self.epoch, float("inf"))
            now = self.core.clock.mono()  # after the book's own reading: a due one is due
            if live.at <= now:
                await self.close(live.cause.value)
                return
            if live.at > told:
                self.template.window_order(self.id, "window_extend", left=live.at - now)
                told = live.at
            await self.core.clock.sleep(live.at - now)

    async def _audit(self, batch: Batch) -> tuple[list[dict[str, object]], list[FiberExit]]:
        """The batch's records, durable; its started entries and exits for the client."""
        records: list[tuple[str, dict[str, object]]] = []
        entries: list[dict[str, object]] = []
        exits: list[FiberExit] = []
        base = {"uid": self.uid, "epoch": self.epoch, "window": self.id}
        for start in batch.starts:
            key = start.get("key")
            fid = self.fiber_id(key) if key is not None else None
            records.append((AuditEvent.FIBER_START, {
                **base, "fiber": fid, "pid": start.get("pid"), "key": key,
                "mode": self.mode(str(fid)),
                **({"lost": True, "leaf": start.get("leaf"),
                    "usage_usec": start.get("usage_usec")} if batch.lost else {})}))
            if key is not None:
                self.answered.add(str(key))
                entries.append({"key": key, "ok": True, "fiber": {
                    "id": fid, "pid": start.get("pid"), "grant": self.uid,
                    "mode": self.mode(str(fid)),
                    "epoch": self.epoch, "window": self.id, "state": "running"}})
        for end in batch.ends:
            key = str(end.get("key"))
            refused = end.get("refused")
            if isinstance(refused, str) and key not in self.answered:
                self.answered.add(key)
                if (reader := self.readers.pop(self.fiber_id(key), None)) is not None:
                    reader.finish()
                records.append((AuditEvent.CLONE_FAILED, {**base, "key": key,
                                                          "reason": refused}))
                entries.append({"key": key, "ok": False, "error": {
                    "code": "bad_request", "reason": refused}})
                continue
            fiber_exit = self._exit(end, batch.lost)
            records.append((AuditEvent.FIBER_EXIT, {**base, "fiber": fiber_exit.fiber_id,
                                                    "exit": fiber_exit.to_json()}))
            exits.append(fiber_exit)
        if batch.error:
            records.append((AuditEvent.PROBLEM, {**base, "reason": batch.error}))
        if records:
            try:
                await self.core.write_many_durably(records)
            except AuditWriteFailed as err:  # said, not hidden: the fibers are killed
                log.error("window %s: records not durable: %s", self.id, err)
                await self.close("audit_failed")
        return entries, exits

    def _exit(self, end: dict[str, object], lost: bool) -> FiberExit:
        status = end.get("status")
        cpu = end.get("cpu")
        maxrss = end.get("maxrss")
        rusage: dict[str, object] = {}
        if isinstance(cpu, float | int):
            rusage["cpu_time"] = cpu
        if isinstance(maxrss, int):
            rusage["maxrss_kib"] = maxrss // 1024
        code = sig = None
        if isinstance(status, int):
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        reason = None
        if self.cause is not None and sig is not None:
            reason = {"code": self.cause, "message": f"task window closed ({self.cause})"}
        fiber_id = self.fiber_id(end.get("key"))
        result: object = None
        error: dict[str, object] | None = None
        reader = self.readers.pop(fiber_id, None)
        record = reader.finish() if reader is not None else None  # its writer has exited
        if lost:
            error = {"type": "FiberLost", "message": "its template died before reporting "
                     "its end"}
        elif self.mode(fiber_id) == "call":
            result, error = call_outcome(record)
        return FiberExit(fiber_id=fiber_id, exit_code=code, signal=sig, rusage=rusage,
                         result=result, error=error, reason=reason)

    def _drop_readers(self) -> None:
        """Close the result channels of call fibers that never started (or never ended)."""
        readers, self.readers = self.readers, {}
        for reader in readers.values():
            reader.finish()

    def _unstarted(self) -> list[dict[str, object]]:
        cause = self.cause or "template"
        code = CLOSE_MISSES.get(cause, MissCode.COLD)
        miss = Miss(code, f"task window {self.id} closed ({cause}) before this task "
                    "started", retry_after=1.0 if code.retryable else None)
        return [{"key": key, "ok": False, "miss": miss.to_json()}
                for key in self.keys if key not in self.answered]


async def open_window(core: Core, requests: Sequence[Clone], peer: Peer,
                      stdios: Sequence[Stdio], keys: list[str],
                      size: int) -> TaskWindowRun | Miss | None:
    """Open a window for a windowed batch's exec and call items (module doc): the run, a
    miss for them all (audited), or None when the window path does not take them
    (another account's template, more descriptors than one message carries, fiberd
    out of descriptors): fiberd's own path then. ``stdios``' descriptors are handed to
    the template and closed here once the order is sent; on a miss or None they are
    left to the caller."""
    if not requests or len(requests) > MAX_TASKS or len(stdios) != len(requests) or any(
            (r.exec is None) == (r.call is None) for r in requests):
        return None
    calls = sum(r.call is not None for r in requests)
    passed_fds = sum(fd is not None for s in stdios for fd in (s.stdin, s.stdout, s.stderr))
    if passed_fds + calls > MAX_FDS:
        return None  # one window message cannot carry them: fiberd's path
    channels = _result_channels(calls)
    if channels is None:
        return None
    try:
        run = await _open(core, requests, peer, stdios, keys, size, channels)
    finally:
        for ours, theirs in channels:  # what _open did not hand on
            if ours is not None:
                ours.close()
            if theirs is not None:
                theirs.close()
    return run


ChannelPair = list[socket.socket | None]


def _result_channels(count: int) -> list[ChannelPair] | None:
    """``count`` result channels (fiberd's end, the fiber's): SEQPACKET socketpairs, as a
    spare's; None when fiberd is out of descriptors (its own path then says so)."""
    channels: list[ChannelPair] = []
    try:
        for _ in range(count):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            channels.append([ours, theirs])
    except OSError as err:
        log.warning("a task window's result channels: %s; fiberd's path instead", err)
        for pair in channels:
            for sock in pair:
                if sock is not None:
                    sock.close()
        return None
    return channels


async def _open(core: Core, requests: Sequence[Clone], peer: Peer, stdios: Sequence[Stdio],
                keys: list[str], size: int,
                channels: list[ChannelPair]) -> TaskWindowRun | Miss | None:
    """``open_window`` with its result channels made; the ones it hands on (to the
    template, to the run's readers) are taken out of ``channels`` (set to None)."""
    first = requests[0]
    caller = {"caller_uid": peer.uid, "caller_pid": peer.pid,
              "batch": len(requests)}
    if core.closing:
        return core.miss(None, closed_miss(), caller)
    resolved = await core.resolve(first)
    if isinstance(resolved, Miss):
        return core.miss(None, resolved, caller)
    grant = core.grant(resolved)
    if grant is not None and grant.template.identity is not None \
            and grant.template.identity.uid != os.geteuid():
        return None
    size = min(size, len(requests))  # places a window holds: never more than its tasks
    decision = core.decide(resolved, size, caller)
    if isinstance(decision, Miss) and decision.code is MissCode.CAPACITY:
        return None  # fewer places than the window asks: fiberd's path holds items back
    if isinstance(decision, Miss):
        return decision
    assert grant is not None
    template = grant.template
    window_id = f"w{_PREFIX}-{next(_IDS)}"
    try:
        leaves = await template.window_leaves(window_id, len(requests))
    except LeafCreateFailed as err:
        return core.miss(resolved, Miss(MissCode.COLD, f"no cgroup leaf for the window: "
                                        f"{err}", retry_after=1.0), caller)
    link = WindowLink(window_id, keys, leaves)
    window_deadline = core.book.deadline(resolved, decision.epoch, float("inf"))
    seconds = decision.spec.limits.seconds
    try:
        await core.write_many_durably([(AuditEvent.WINDOW_OPEN, {
            "uid": resolved, "jti": decision.jti, "window": window_id,
            "epoch": decision.epoch, "size": size, "tasks": len(requests),
            "deadline": core.wall(window_deadline.at),
            "deadline_cause": window_deadline.cause.value, "seconds": seconds,
            "carved": leaves[0] is not None, **caller})])
    except AuditWriteFailed as err:
        template.give_back_window(leaves)
        return core.miss(resolved, Miss(MissCode.AUDIT_FAILED, str(err), retry_after=1.0),
                         caller)
    tasks: list[dict[str, object]] = []
    fds: list[int] = []
    passed_stdio = {fd for s in stdios for fd in (s.stdin, s.stdout, s.stderr)
                    if fd is not None}
    run = TaskWindowRun(core, window_id, resolved, decision.jti, decision.epoch, template,
                        link, keys, size)
    free = iter(channels)
    for n, (request, stdio) in enumerate(zip(requests, stdios, strict=True)):
        passed = (stdio.stdin, stdio.stdout, stdio.stderr)
        fiber_id = f"{window_id}.{n}"
        order = template.run_order(fiber_order(fiber_id, request, stdio, decision.jti,
                                               decision.epoch, window_deadline.at))
        run.modes.append(str(order["mode"]))
        fds += [fd for fd in passed if fd is not None]
        if request.call is None:
            tasks.append({"key": keys[n], "order": order})
            continue
        pair = next(free)
        ours, theirs = pair[0], pair[1]
        assert ours is not None and theirs is not None
        ours.setblocking(False)
        run.readers[fiber_id] = ResultReader(ours, limit=MAX_RESULT)
        fds.append(theirs.detach())  # closed here once the order is sent, or not
        pair[0] = pair[1] = None
        tasks.append({"key": keys[n], "order": order, "result": True})
    left = window_deadline.at - core.clock.mono()
    try:
        await template.open_window(link, link.order(size, left, seconds, tasks), fds)
    except TemplateNotReady:
        template.give_back_window(leaves)
        run._drop_readers()
        close_fds([fd for fd in fds if fd not in passed_stdio])  # the stdio: the caller's
        return core.miss(resolved, Miss(MissCode.COLD, "the template is not ready",
                                        retry_after=1.0), caller)
    except BaseException:
        run._drop_readers()
        close_fds([fd for fd in fds if fd not in passed_stdio])
        raise
    close_fds(fds)  # sent: the stdio and the fibers' ends of the result channels
    core.windows[window_id] = run
    run._keeper = asyncio.ensure_future(run.keep_deadline(window_deadline))
    return run

