"""A template's spares of one kind, as fiberd sees them: asked, idle, in use.

A *spare* is a process made ahead of a Clone, already in its cgroup leaf
(core/leaves.py), tied to the template by its death signal and blocked on its order
channel, whose other end fiberd holds (``Spare.orders``): a *fiber* spare, forked from
the warm template (it runs call and exec orders). A *spawn* is kept the same way with no
process made ahead: an exec fiber's program the template starts straight into its leaf
on the Clone (core/exec_spawn.py), asked with its order and no order channel; its pool
keeps none idle. ``SparePool`` holds one kind's spares through their life: *asked* of
the template (``asked``, until its ``spared`` answer), *idle* (spared, waiting for an
order), *in use* (handed an order: the fiber it became, by spare id, until that fiber
ends). It does the bookkeeping and no I/O; ``Template`` sends, kills and reaps.
``short()`` says whether more should be asked for to keep ``target`` idle or under way.
Ids are unique across a template's kinds (one counter, shared): the template reports
each exit by spare id.
"""

from __future__ import annotations

import asyncio
import enum
import socket
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from slurm_fiber.core.fibers.fiber import Fiber


class Kind(enum.StrEnum):
    FIBER = "spare"  # forked from the warm template (the wire's "spare" order)
    SPAWN = "spawn"  # an exec fiber's program, started on its Clone (the wire's "spawn")


@dataclass
class Spare:
    """A spare process: asked of the template, then (``spared``) waiting for its order."""

    id: str
    kind: Kind
    cgroup: Path | None
    orders: socket.socket | None  # fiberd's end of the spare's order channel (a spawn: none)
    spared: asyncio.Future[int]  # its pid, once the template has made it
    asked: float = 0.0  # when it was asked of the template (clock mono)
    pidfd: int | None = None
    pid: int = 0  # once spared


class SparePool:
    """One kind's spares. ``target``: how many to keep idle or under way. Not
    thread-safe; use on fiberd's event loop."""

    def __init__(self, kind: Kind, target: int) -> None:
        self.kind = kind
        self.target = target
        self.filling: asyncio.Task[None] | None = None  # the refill under way, if any
        self._asked: dict[str, Spare] = {}
        self._idle: deque[Spare] = deque()
        self._in_use: dict[str, Fiber] = {}

    def asked(self, spare: Spare) -> None:
        """``spare`` was asked of the template; it awaits the answer."""
        self._asked[spare.id] = spare

    def answered(self, spare_id: str) -> Spare | None:
        """The asked spare the template's answer ``spared``/``fork_failed`` is about
        (no longer asked), or None if none is."""
        return self._asked.pop(spare_id, None)

    def take(self) -> Spare | None:
        """The oldest idle spare (no longer idle), or None."""
        return self._idle.popleft() if self._idle else None

    def keep(self, spare: Spare) -> None:
        """``spare`` is spared and nobody took it: idle, for the next Clone."""
        self._idle.append(spare)

    def drop(self, spare: Spare) -> None:
        """Forget ``spare`` wherever it is but in use (it is being buried)."""
        if spare in self._idle:
            self._idle.remove(spare)
        if self._asked.get(spare.id) is spare:
            del self._asked[spare.id]

    def idle_one(self, spare_id: str) -> Spare | None:
        """The idle spare with ``spare_id``, if any."""
        return next((s for s in self._idle if s.id == spare_id), None)

    def dismiss(self) -> list[Spare]:
        """Every spare not handed an order (idle or asked), now forgotten, for burial."""
        out = [*self._idle, *self._asked.values()]
        self._idle.clear()
        self._asked.clear()
        return out

    def use(self, spare: Spare, fiber: Fiber) -> None:
        """``spare`` took its order and is ``fiber`` now."""
        self._in_use[spare.id] = fiber

    def used(self, spare_id: str) -> None:
        """The fiber spare ``spare_id`` became has ended."""
        self._in_use.pop(spare_id, None)

    def running(self) -> int:
        """How many of its spares are fibers now."""
        return len(self._in_use)

    def fiber(self, spare_id: str) -> Fiber | None:
        """The fiber spare ``spare_id`` became, while it runs."""
        return self._in_use.get(spare_id)

    def has_idle(self) -> bool:
        """Whether a spare is idle (the next Clone of this kind needs no fork)."""
        return bool(self._idle)

    def short(self) -> bool:
        """Whether fewer than ``target`` are idle or asked."""
        return len(self._idle) + len(self._asked) < self.target

    def oldest_ask(self) -> float | None:
        """When the longest-unanswered ask was made (clock mono), or None."""
        return min((s.asked for s in self._asked.values()), default=None)

    @property
    def idle(self) -> list[Spare]:
        """The idle spares, oldest first."""
        return list(self._idle)
