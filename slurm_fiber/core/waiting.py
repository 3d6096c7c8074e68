"""Small awaitables and process readings the process layer shares.

``pidfd_wait`` wakes on the pidfd becoming readable (the process exited,
reaped or not), through the event loop, never by polling. ``first_done``
races a main future against others (a clock sleep, an event) and cancels
the losers. ``stopped`` and ``zombie_exit`` read what the kernel shows of a
process in ``/proc/<pid>/stat``: whether it is stopped (SIGSTOP, a tracer),
and the wait status of one that exited but is not reaped yet, which is how
fiberd learns a fiber's end when its template (the parent, the only one
that can reap it) stops answering. None of these block.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
from collections.abc import Awaitable
from typing import Any

_CLOCK_TICK = os.sysconf("SC_CLK_TCK")


def pidfd_exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has exited (never blocks). ``poll``, not
    ``select``: a fiberd holding thousands of fibers has pidfds above FD_SETSIZE (1024),
    which ``select`` refuses (a ValueError once taken for an exit: fibers were killed)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


async def pidfd_wait(pidfd: int, or_done: asyncio.Future[Any] | None = None) -> None:
    """Return once the process behind ``pidfd`` has exited (or ``or_done``, when given, is
    done). The caller owns the fd. One future and a loop reader, no task: thousands wait
    at once in a mass stop."""
    if pidfd_exited(pidfd) or (or_done is not None and or_done.done()):
        return
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[None] = loop.create_future()

    def wake(_: object = None) -> None:
        # The reader goes at once: a pidfd stays readable, and until the waiter resumes
        # every poll would report it again (thousands, each poll, in a mass stop).
        loop.remove_reader(pidfd)
        set_done(woken)

    loop.add_reader(pidfd, wake)
    if or_done is not None:
        or_done.add_done_callback(wake)
    try:
        await woken
    finally:
        loop.remove_reader(pidfd)
        if or_done is not None:
            or_done.remove_done_callback(wake)


async def first_done(main: asyncio.Future[Any], *others: Awaitable[object]) -> bool:
    """Wait for ``main`` or any of ``others``; True when ``main`` is done. Cancels the others
    and returns only once they have finished unwinding, so what they hold is released: a
    ``pidfd_wait`` among them has removed its reader before the caller adds another on the
    same pidfd (the event loop keeps one reader per fd) or closes it."""
    tasks = [asyncio.ensure_future(o) for o in others]
    try:
        await asyncio.wait([main, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)
    return main.done()


def set_done(fut: asyncio.Future[None]) -> None:
    """Resolve ``fut`` with None unless it is done already (a loop reader or writer callback)."""
    if not fut.done():
        fut.set_result(None)


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3, the state,
    first); None when the process is gone."""
    try:  # one open, read and close (no buffered file: its fstat, ioctl and seeks)
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            text = os.read(fd, 4096)
        finally:
            os.close(fd)
    except OSError:
        return None
    return text.rpartition(b")")[2].decode(errors="replace").split()


def stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped now (by a signal such as SIGSTOP, or by a tracer)."""
    fields = _stat(pid)
    return fields is not None and fields[0] in ("T", "t")


def zombie_exit(pid: int, pidfd: int, parent: int | None = None) -> dict[str, object] | None:
    """The exit of a process that has exited but is not reaped yet, as the kernel keeps
    it: ``{"status": <wait status>, "cpu": <seconds, with reaped children>}``.

    ``pidfd`` must refer to ``pid``: it proves the numbers read are that
    process's (a pid is not reused before its process is reaped). With
    ``parent``, only a zombie still that process's child counts (one that
    died after its parent was re-parented first). None when the process is
    running, already reaped, not ``parent``'s, or its exit code is hidden from
    us (the kernel shows 0 to a reader that may not trace it: not root and
    not its exact uid and gid).
    """
    fields = _stat(pid)
    if fields is None or fields[0] != "Z" or len(fields) < 50 or not _may_read(pid):
        return None
    if parent is not None and fields[1] != str(parent):
        return None
    try:
        signal.pidfd_send_signal(pidfd, 0)  # still unreaped now, so it was when read
    except (ProcessLookupError, PermissionError):
        return None
    ticks = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return {"status": int(fields[49]), "cpu": ticks / _CLOCK_TICK}


def _may_read(pid: int) -> bool:
    """Whether the kernel shows us ``pid``'s exit code (ptrace read access): root, or
    every uid and gid of the process equal to ours."""
    if os.geteuid() == 0:
        return True
    want = {"Uid:": str(os.geteuid()), "Gid:": str(os.getegid())}
    try:
        with open(f"/proc/{pid}/status") as f:
            ids = {line.split(None, 1)[0]: line.split()[1:] for line in f
                   if line.startswith(("Uid:", "Gid:"))}
    except OSError:
        return False
    return all(ids.get(key) and set(ids[key]) == {value} for key, value in want.items())
