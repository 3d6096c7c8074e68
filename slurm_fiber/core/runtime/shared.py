"""What the runtime's collaborators share: the parts they are built on, the settings, the tasks.

``Parts`` is handed to each collaborator of ``Core`` (admission, grants, clones, upkeep,
the audit trail) so they see one home, one book, one cgroup manager, one clock, one
set of settings, one ``closing`` flag (once set, no new grant is admitted and no Clone
starts) and one registry of the task windows open (task_window.py), which a Clone's
decision counts and an epoch bump or a grant's removal closes. ``spawn`` runs a
background coroutine whose failure is logged, never raised into the loop;
``cancel_tasks`` ends them all at shutdown. Everything runs on fiberd's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from slurm_fiber.core.book.decisions import GrantBook
from slurm_fiber.core.cgroups.manager import CgroupManager
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.runtime.identity import FiberIdentity
from slurm_fiber.core.seam import HomePorts
from slurm_fiber.core.templates.parent import DEFAULT_TIMEOUT

if TYPE_CHECKING:
    from slurm_fiber.core.runtime.task_window import TaskWindowRun

log = logging.getLogger("slurm_fiber.core.runtime")

T = TypeVar("T")

DEFAULT_PRUNE_AFTER = 3600.0  # seconds an expired grant stays listed before it is forgotten
DEFAULT_HISTORY = 1000  # ended fibers whose records are kept (inspect, ls --all)
DEFAULT_HISTORY_SECONDS = 3600.0  # ... and for how long after they ended


@dataclass
class Settings:
    """How one fiberd runs its grants (see ``Core``)."""

    state_dir: Path
    grace: float = 5.0
    spares: int = 1
    spares_idle: float | None = None
    template_timeout: float = DEFAULT_TIMEOUT
    python: str = sys.executable
    prune_after: float = DEFAULT_PRUNE_AFTER
    strict_limits: bool = False
    identity: FiberIdentity | None = None
    history: int = DEFAULT_HISTORY
    history_seconds: float = DEFAULT_HISTORY_SECONDS
    # "template": a windowed batch of exec items runs as a task window
    # (core/runtime/task_window.py); "fiberd" (the default): fiberd starts each item
    task_window: str = "fiberd"


@dataclass
class Parts:
    """The home, book, cgroups, clock and settings every collaborator uses, and their state
    in common: ``closing``, the task windows open and the background tasks."""

    home: HomePorts
    book: GrantBook
    cgroups: CgroupManager
    clock: Clock
    settings: Settings
    closing: bool = False
    windows: dict[str, TaskWindowRun] = field(default_factory=dict)  # task windows, by id
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``coro`` in the background; a failure is logged when it ends."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    async def cancel_tasks(self) -> None:
        """Cancel every background task and return once they are gone."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def wall(self, mono: float) -> float:
        """The wall-clock time of the clock's monotonic instant ``mono``."""
        return self.clock.wall() + (mono - self.clock.mono())

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("runtime task failed: %s", task.exception())
