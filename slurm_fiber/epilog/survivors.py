"""Stopping a finished job's processes on this node, within a bound, whatever the job did.

A job's processes are found only through what root knows, never through a
path a job user wrote and never as "all processes of the user":

- the job's cgroup trees, which the caller derives from the site config (the
  delegated subtree) and Slurm's root-owned names (``uid_<uid>/job_<id>`` in
  each v1 hierarchy): everything in them is killed, frozen groups thawed
  (core/cgroups/teardown.py); the cgroup root a fiberd record names is never used (a
  user writes that record);
- the fiberd its record names, if pid, start time and uid match, and its
  descendants; processes of the job's uid whose environment names the job
  (epilog/procscan, a bounded read per process).

``stop_job_processes`` SIGKILLs them, repeats discovery (up to ROUNDS) so a
child forked meanwhile is caught, then waits, thawing and killing the trees
again on every poll, and returns those that provably survived (same start
time, not a zombie). Discovery gets DISCOVER_SHARE of the budget and stops
there (reported as incomplete: a job's own process count cannot make the step
overrun); the rest is for the wait. Pid 1, the caller and its ancestors are
never touched.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from slurm_fiber.core.cgroups import teardown
from slurm_fiber.epilog.procscan import Found, command, read_stat

POLL_S = 0.02
ROUNDS = 3
DISCOVER_SHARE = 0.75  # of the budget, for finding and killing; the rest is the wait


REPORTED = 5  # killed processes named in the report line


@dataclass
class Outcome:
    """What ``stop_job_processes`` did: how many processes it killed and the first
    REPORTED of them described, those that survived SIGKILL (described), and whether
    discovery looked at every process."""

    killed: int = 0
    named: list[str] = field(default_factory=list)
    alive: list[str] = field(default_factory=list)
    complete: bool = True

    def saw(self, process: Found) -> None:
        """Count ``process`` as killed (described while it still runs, if among the first)."""
        self.killed += 1
        if len(self.named) < REPORTED:
            self.named.append(describe(process))


def protected_pids(proc: Path = Path("/proc")) -> set[int]:
    """Pid 1, this process and its ancestors (slurmd), which are never signalled.

    The ancestors are read from ``<proc>/<pid>/stat`` (the field after the
    command name's closing parenthesis is the state, then the parent pid).
    """
    keep = {1, os.getpid()}
    pid = os.getppid()
    while pid > 1 and pid not in keep:
        keep.add(pid)
        try:
            stat = (proc / str(pid) / "stat").read_bytes()
            pid = int(stat[stat.rindex(b")") + 1:].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return keep


def still_there(process: Found) -> bool:
    """Whether ``process`` still runs: same pid, same start time, not a zombie."""
    st = read_stat(process.pid)
    return st is not None and st.start == process.start and st.state not in ("Z", "X")


def describe(process: Found) -> str:
    """``pid <n> (<command line>; <why>)`` for a report line."""
    return f"pid {process.pid} ({command(process.pid)[:120]}; {process.why})"


def stop_job_processes(discover: Callable[[float], tuple[list[Found], bool]],
                       trees: list[Path], budget_s: float) -> Outcome:
    """SIGKILL everything in ``trees`` and what ``discover(deadline)`` finds; wait for it
    to go. Blocks for at most about ``budget_s`` seconds (polling every 20 ms)."""
    start = time.monotonic()
    discover_until = start + budget_s * DISCOVER_SHARE
    wait_until = start + budget_s
    keep = protected_pids()
    out = Outcome()
    targets: dict[int, Found] = {}
    in_trees: set[int] = set()  # counted, not tracked: the trees are checked whole below
    for _ in range(ROUNDS):
        for tree in (t for t in trees if t.exists()):
            for pid in set(teardown.pids_left(tree, discover_until)) - keep - in_trees:
                in_trees.add(pid)
                out.saw(Found(pid, 0, f"in cgroup {tree}"))
            teardown.end_tree(tree, discover_until, keep)
        found, out.complete = discover(discover_until)
        skip = keep | in_trees | targets.keys()
        new = [p for p in found if p.pid not in skip]
        for process in new:
            targets[process.pid] = process
            out.saw(process)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(process.pid, signal.SIGKILL)
        if not new or not out.complete:
            break
    alive = [p for p in targets.values() if still_there(p)]
    while (alive or _populated(trees, keep, wait_until)) and time.monotonic() < wait_until:
        time.sleep(POLL_S)
        for tree in trees:  # a group frozen again meanwhile (by another job of the user)
            if tree.exists():
                teardown.end_tree(tree, wait_until, keep)
        alive = [p for p in alive if still_there(p)]
    left = {p.pid for p in alive}
    for tree in trees:
        for pid in teardown.pids_left(tree, wait_until):
            st = read_stat(pid)
            if pid not in keep and pid not in left and st is not None:
                alive.append(Found(pid, st.start, f"in cgroup {tree}"))
                left.add(pid)
    out.alive = [describe(p) for p in alive if still_there(p)]
    return out


def _populated(trees: list[Path], keep: set[int], deadline: float) -> bool:
    return any(set(teardown.pids_left(tree, deadline)) - keep for tree in trees if tree.exists())
