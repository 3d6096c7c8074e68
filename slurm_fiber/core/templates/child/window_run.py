"""A task window run inside the template: the next task starts when one ends, no fiberd round.

fiberd (core/templates/window_parent.py) decides a window once and sends it as one
``window`` message: its id, ``size`` (how many at once), ``left`` (seconds until the
window's deadline, min(lease, fence) as fiberd knew it), ``seconds`` (each fiber's own
limit, or None), the tasks (each a run order, as a ``spawn`` or a spare's ``run``
carries) with their passed stdio descriptors in order, a call task's result channel
after its stdio (its ``result``), and one cgroup leaf per task (``leaves``, each with
its v1 mirrors; none when uncarved); at most ``MAX_FDS`` descriptors in all (the
kernel's SCM_MAX_FD). ``TaskWindow`` then, on the template's own loop:

- starts tasks in order while fewer than ``size`` run, each in its own leaf: an exec
  task's program straight into it (core/exec_spawn.py), a call task forked by the
  template (``fork_call``: the child joins the leaf, as a spare does, and runs the
  order as a spare would, its record on the result channel); never past the deadline,
  never after ``close``; the n-th task
  taken gets the n-th leaf, so a leaf hosts one task of a window at most and fiberd can
  tell from a leaf's CPU figures alone whether its task ran (the record of a start the
  template never reported);
- kills a fiber (its leaf's ``cgroup.kill`` and its process group) once it has run its
  ``seconds``;
- reports what happened as ``window_report`` messages (``starts``: key, pid, leaf index;
  ``ends``: key, pid, wait status, CPU, maxrss), one at a time: the next goes once
  fiberd has acked the last (``window_ack``: its records are durable), holding all that
  happened meanwhile, so the busier fiberd is the bigger its batches; the last one has
  ``done``, sent once nothing runs and nothing more will start.

``extend`` moves the deadline later (fiberd asked the book again when it came: a sync
extended the fence, a renewal the lease); ``close`` starts nothing more (fiberd kills
what runs through the leaves). The template is trusted for none of this: fiberd keeps
the deadline through the cgroup and reads the leaves when a report never comes.
Blocking, single-threaded: it is part of the template's fork-and-reap loop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from slurm_fiber.core.cgroups.held_files import HeldFiles
from slurm_fiber.core.templates import wire
from slurm_fiber.core.templates.child import exec_spawn
from slurm_fiber.core.templates.child.fiber_setup import write_control

MAX_TASKS = 64  # tasks of one window message (a clone_batch's items)
MAX_FDS = 253  # descriptors of one message: the kernel's SCM_MAX_FD

Send = Callable[[dict[str, object]], None]
# fork_call(order, stdio, result channel, leaf, leaf's v1 mirrors): the forked call
# fiber's pid (it joins the leaf and runs the order). Raises OSError when it cannot fork.
ForkCall = Callable[[dict[str, object], list[int], int, str | None, list[str]], int]


@dataclass
class Task:
    """One task not started yet: its key, run order and passed descriptors (its stdio,
    then, for a call task, its result channel)."""

    key: str
    order: dict[str, object]
    fds: list[int]
    result: bool = False  # a call task: its last descriptor is its result channel


@dataclass
class Running:
    """A started task: its key, leaf index, leaf path (None uncarved) and when it began."""

    key: str
    leaf: int
    cgroup: str | None
    began: float


@dataclass
class TaskWindow:
    """One window's state in the template (module doc)."""

    id: str
    size: int
    deadline: float  # time.monotonic() seconds: no start at or after it
    seconds: float | None
    tasks: deque[Task]
    leaves: list[tuple[str | None, list[str]]]
    send: Send
    running: dict[int, Running] = field(default_factory=dict)
    starts: list[list[object]] = field(default_factory=list)
    ends: list[list[object]] = field(default_factory=list)
    closed: bool = False
    done: bool = False
    unacked: bool = False  # a report is out and fiberd has not said its records are durable
    next_leaf: int = 0

    @classmethod
    def from_message(cls, msg: wire.Message, fds: list[int], send: Send) -> TaskWindow:
        """The window a ``window`` message orders, its ``fds`` handed out to its tasks in
        order (each task's ``stdio`` flags say how many are its). Raises ValueError
        (fds closed) on a malformed message."""
        try:
            it = iter(fds)
            tasks: deque[Task] = deque()
            for raw in msg.get("tasks") or []:
                order = dict(raw["order"])
                result = raw.get("result") is True
                count = sum(1 for given in order.get("stdio") or [] if given) + result
                tasks.append(Task(str(raw["key"]), order, [next(it) for _ in range(count)],
                                  result))
            leaves = [(leaf if isinstance(leaf, str) else None, list(also))
                      for leaf, also in msg.get("leaves") or []]
            if len(leaves) < len(tasks) or len(tasks) > MAX_TASKS:
                raise ValueError("a window needs one leaf per task, at most 64 tasks")
            seconds = msg.get("seconds")
            return cls(str(msg["id"]), max(1, int(str(msg["size"]))),
                       time.monotonic() + float(str(msg["left"])),
                       float(seconds) if isinstance(seconds, int | float) else None,
                       tasks, leaves, send)
        except (KeyError, TypeError, ValueError, StopIteration) as e:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise ValueError(f"unreadable window order: {e}") from None

    def pump(self, home: wire.Message, unblocked: set[int], doors: HeldFiles,
             adopt: Callable[[int, str, str | None], None], fork_call: ForkCall) -> None:
        """Start tasks while fewer than ``size`` run and the window is open and before its
        deadline (a call task by ``fork_call``); ``adopt(pid, key, cgroup)`` makes each a
        child the template reaps. A task's descriptors are closed here once it started."""
        while (self.tasks and not self.closed and len(self.running) < self.size
               and time.monotonic() < self.deadline):
            task = self.tasks.popleft()
            index = self.next_leaf
            self.next_leaf += 1
            leaf, also = self.leaves[index]
            try:
                if task.result:
                    pid = fork_call(task.order, task.fds[:-1], task.fds[-1], leaf, also)
                else:
                    pid = exec_spawn.spawn({"order": task.order, "cgroup": leaf,
                                            "also": also}, task.fds, home, unblocked, doors)
            except exec_spawn.Refused as e:
                self.ends.append([task.key, None, None, 0.0, 0, f"not started: {e}"])
                continue
            except OSError as e:  # the template could not fork a call task
                self.ends.append([task.key, None, None, 0.0, 0,
                                  f"not started: cannot fork: {e.strerror or e}"])
                continue
            finally:
                for fd in task.fds:
                    os.close(fd)
            adopt(pid, task.key, leaf)
            self.running[pid] = Running(task.key, index, leaf, time.monotonic())
            self.starts.append([task.key, pid, index])
        if not self.tasks or self.closed or time.monotonic() >= self.deadline:
            self._drop_tasks()

    def ended(self, pid: int, status: int, cpu: float, maxrss: int) -> bool:
        """A reaped child: True when it was one of this window's (its end noted)."""
        run = self.running.pop(pid, None)
        if run is None:
            return False
        self.ends.append([run.key, pid, status, cpu, maxrss, None])
        return True

    def enforce(self) -> float | None:
        """Kill the fibers past their ``seconds``; the seconds until the next such kill or
        the deadline is due (None: nothing to watch)."""
        now = time.monotonic()
        due: list[float] = []
        if self.tasks and not self.closed:
            due.append(self.deadline - now)
        if self.seconds is not None:
            for pid, run in self.running.items():
                left = run.began + self.seconds - now
                if left <= 0:
                    kill(pid, run.cgroup)
                else:
                    due.append(left)
        return max(0.0, min(due)) if due else None

    def close(self) -> None:
        """Start nothing more (fiberd kills what runs through the leaves)."""
        self.closed = True
        self._drop_tasks()

    def extend(self, left: float) -> None:
        """fiberd found the deadline later (``left`` seconds from now)."""
        self.deadline = max(self.deadline, time.monotonic() + left)

    def acked(self) -> None:
        """fiberd made the last report's records durable: the next may go."""
        self.unacked = False

    def report(self) -> None:
        """Send what happened since the last report, if anything and fiberd has acked the
        last one (so what happens while fiberd writes and fsyncs a batch goes in the next
        one, whatever the rate); ``done`` once nothing runs and nothing will start."""
        finished = not self.tasks and not self.running
        if self.unacked or not (self.starts or self.ends or (finished and not self.done)):
            return
        self.unacked = True
        self.done = finished
        msg: dict[str, object] = {"t": "window_report", "id": self.id, "starts": self.starts,
                                  "ends": self.ends, "done": finished}
        self.starts, self.ends = [], []
        self.send(msg)

    def forget_fds(self) -> None:
        """Close the descriptors of the tasks not started (in a forked fiber, before user
        code: no fiber holds another task's stdio or result channel)."""
        for task in self.tasks:
            for fd in task.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _drop_tasks(self) -> None:
        while self.tasks:
            for fd in self.tasks.popleft().fds:
                with contextlib.suppress(OSError):
                    os.close(fd)


def kill(pid: int, cgroup: str | None) -> None:
    """SIGKILL a window fiber: its leaf whole when carved, and its process group."""
    if cgroup is not None:
        with contextlib.suppress(OSError):
            write_control(cgroup, "cgroup.kill", b"1")
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
