"""A job's cgroup tree ended and removed by root, whatever the job did to its own groups.

The hooks' cgroup operations (the epilog's, run as root after a job): the caller
derives the tree from what root knows (the site's delegated cgroup, Slurm's root-owned
job groups), never from a file a job user wrote; the Slurm layout (which directory is
which job and step) is the Slurm home's and the epilog's, not this module's.

A job user may own groups below the job's (Slurm 22.05's v1 step groups, a delegated
v2 subtree), and make and freeze groups there. A process frozen by the v1 freezer
ignores SIGKILL until it is thawed, and thawing a parent does not thaw a child that
froze itself; a v2 ``cgroup.freeze`` stops a process from running (a fatal signal still
ends it). ``end_tree`` therefore:

- v2 (the top has ``cgroup.kill``): writes 0 to ``cgroup.freeze`` of every group of
  the subtree, then 1 to the top's ``cgroup.kill`` (the kernel kills every process
  below, a fork racing it included);
- v1 freezer (``freezer.state``): freezes the top (nothing below forks meanwhile),
  SIGKILLs every pid listed below it, then writes THAWED to every group below and to
  the top, so a group the job froze itself thaws too and its killed processes die;
- any other v1 hierarchy: SIGKILLs every pid listed below the top.

``kill_each`` writes ``cgroup.kill`` of each group given, ``wait_empty`` waits for
their ``populated 0``, ``pids_left`` lists what still runs, and ``remove_tree``
removes a tree's groups deepest first, its top last, leaving (and naming) what is busy;
it walks by moving the working directory one level at a time, so a tree's depth costs
it no more than its size. Groups are walked without following links and without
recursion (cgroupfs holds no links, and a name that were one is never opened; a tree
of any depth is walked), files are opened ``O_NOFOLLOW``; every walk, write, kill, wait
and removal stops at a deadline and after ``MAX_GROUPS`` groups, so no number or depth
of groups or processes a job made can stretch it. Nothing is created. Never raises: a
group that went away is done.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

FREEZE_WAIT_S = 0.2  # for FREEZING to become FROZEN (a scheduler round per task)
MAX_GROUPS = 100_000  # groups walked below one top at most
POLL_S = 0.02


def groups(top: Path, deadline: float, limit: int = MAX_GROUPS) -> Iterator[str]:
    """``top`` and every group below it, parents before children, until ``deadline`` or
    ``limit`` groups."""
    stack = [os.fspath(top)]
    while stack and time.monotonic() < deadline and limit > 0:
        group = stack.pop()
        limit -= 1
        yield group
        with contextlib.suppress(OSError), os.scandir(group) as entries:
            stack += [e.path for e in entries if e.is_dir(follow_symlinks=False)]


def _write(path: str, text: str) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        os.write(fd, text.encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _read(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def pids_in(group: str) -> list[int]:
    """The pids listed directly in ``group`` (none when it is gone)."""
    return [int(p) for p in _read(os.path.join(group, "cgroup.procs")).split() if p.isdigit()]


def _kill(pids: list[int], keep: set[int]) -> None:
    for pid in pids:
        if pid not in keep:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def end_tree(top: Path, deadline: float, keep: set[int]) -> None:
    """SIGKILL every process of cgroup subtree ``top`` (thawing whatever is frozen in it);
    a pid of ``keep`` is never signalled one by one (``cgroup.kill`` takes the whole
    subtree: the caller keeps none of its own there)."""
    base = os.fspath(top)
    if os.path.exists(os.path.join(base, "cgroup.kill")):
        for group in list(groups(top, deadline)):
            _write(os.path.join(group, "cgroup.freeze"), "0\n")
        _write(os.path.join(base, "cgroup.kill"), "1\n")
        return
    state = os.path.join(base, "freezer.state")
    if not os.path.exists(state):
        for group in list(groups(top, deadline)):
            _kill(pids_in(group), keep)
        return
    _write(state, "FROZEN\n")
    until = min(deadline, time.monotonic() + FREEZE_WAIT_S)
    while _read(state).strip() == "FREEZING" and time.monotonic() < until:
        time.sleep(0.005)
    below = list(groups(top, deadline))
    for group in below:
        _kill(pids_in(group), keep)
    for group in reversed(below):  # children first, the top last
        _write(os.path.join(group, "freezer.state"), "THAWED\n")


def pids_left(top: Path, deadline: float) -> list[int]:
    """The pids still listed anywhere in subtree ``top`` (until ``deadline``)."""
    return [pid for g in list(groups(top, deadline)) for pid in pids_in(g)]


def kill_each(tops: list[Path]) -> None:
    """Write 1 to ``cgroup.kill`` of each of ``tops`` (cgroup v2; a gone one is done)."""
    for top in tops:
        _write(os.path.join(top, "cgroup.kill"), "1\n")


def populated(group: Path) -> bool:
    """Whether ``group``'s ``cgroup.events`` says ``populated 1`` (False when gone)."""
    return "\npopulated 1" in "\n" + _read(os.path.join(group, "cgroup.events"))


def wait_empty(tops: list[Path], deadline: float) -> bool:
    """Wait until none of ``tops`` is populated, or ``deadline``; whether none is."""
    while any(populated(top) for top in tops):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def remove_tree(top: Path, deadline: float, limit: int = MAX_GROUPS) -> tuple[int, list[str]]:
    """rmdir every group of ``top``'s tree, deepest first, ``top`` last, until ``deadline``
    (``limit`` groups at most): how many were removed, and one line per group left (busy,
    or not reached in time).

    The walk moves the working directory down and up the tree one name at a time (each
    directory opened ``O_NOFOLLOW`` relative to the one it is in, listed once, one
    descriptor held besides ``top``'s and the caller's working directory, which is
    restored before it returns), so no path is resolved through the levels above and
    its cost grows with the number of groups, not with their depth."""
    removed, left, seen = 0, [], 0
    try:
        home = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        return 0, [f"{top}: not walked, the working directory cannot be kept: {err.strerror}"]
    try:
        top_fd = os.open(top, _DIR_FLAGS)
    except OSError as err:
        os.close(home)
        return 0, [] if isinstance(err, FileNotFoundError) else [f"{top}: {err.strerror}"]
    try:
        os.fchdir(top_fd)
        names: list[str] = []  # the path from ``top`` to the working directory
        pending = [_subdirs()]  # per level: the groups below it not yet visited
        while True:
            if time.monotonic() >= deadline:
                left.append(f"{os.path.join(top, *names)}: not removed within the step's bound")
                break
            if pending[-1] and seen < limit:
                child = pending[-1].pop()
                if _enter(child):
                    names.append(child)
                    pending.append(_subdirs())
                    seen += 1
                continue
            if not names:
                break
            name = names.pop()
            pending.pop()
            try:
                os.chdir("..")
            except OSError:  # the group went away under the walk: start again at the top
                os.fchdir(top_fd)
                names, pending = [], [_subdirs()]
                continue
            try:
                os.rmdir(name)
                removed += 1
            except FileNotFoundError:
                continue
            except OSError as err:
                left.append(f"{os.path.join(top, *names, name)}: {err.strerror}")
    finally:
        os.fchdir(home)
        os.close(home)
        os.close(top_fd)
    if seen >= limit:
        left.append(f"{top}: more than {limit} groups")
    try:
        os.rmdir(top)
        removed += 1
    except FileNotFoundError:
        pass
    except OSError as err:
        if not left:
            left.append(f"{top}: {err.strerror}")
    return removed, left


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _subdirs() -> list[str]:
    """The names of the directories in the working directory ([] when it cannot be listed)."""
    try:
        with os.scandir(".") as entries:
            return [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _enter(name: str) -> bool:
    """Make ``name``, a directory of the working directory, the working directory (never
    through a symbolic link); False when it cannot be."""
    try:
        fd = os.open(name, _DIR_FLAGS)
    except OSError:
        return False
    try:
        os.fchdir(fd)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True
