"""Exec fibers spawned straight into their cgroup leaf: no spare process, no copy of the template.

An exec fiber's program needs nothing of the warm template's memory, so the
template (core/template_main.py, ``Server.spawn``) does not fork for it:
``spawn`` moves the template itself into the fiber's leaf (v1 mirrors first,
as a spare joins), starts the program with ``subprocess.Popen``, which
``vfork``s and execs (the child shares the template's memory until its exec,
so the start costs the same however big the template is), and moves the
template back to its own groups, all before it answers (each move a write to a
``cgroup.procs`` descriptor it keeps open: core/held_files.py). The program is born
in its leaf and is the template's child: reaped and reported as a spare is.

It gets what an exec fiber forked from a spare gets (core/fiber_setup.py,
``exec_order``): the template's environment plus the order's and
``SLURM_FIBER_ID``; the order's cwd; its stdio (the passed fds, else
/dev/null and files under ``out_dir``) and no other descriptor; its own
process group; the signal dispositions the template inherited (what it
ignores stays ignored) with SIGPIPE and SIGXFSZ at default; the signals a
spare unblocks unblocked (``unblocked``). ``os.posix_spawn`` would be
cheaper still, but glibc's leaves its two internal signals ignored in the
program, which no exec gives.

One thing differs and is not enforced here: the program has no death signal
(PR_SET_PDEATHSIG is set by a process on itself, and this one runs no code
of ours before its exec). A template that exits on ``stop`` or SIGTERM kills
it with its other children (``Server.kill_all``); one that dies otherwise
leaves it to fiberd, which kills it (its cgroup when carved) once it sees
the template gone (core/fibers.py).

``spawn`` raises ``Refused`` (one line) when the program cannot start as
ordered: not found or not runnable, a cwd it cannot enter, stdio that cannot
be opened, a leaf that cannot be joined. fiberd then starts the fiber from a
forked spare, which fails the same way and reports it exactly as before
(exit code, ``exec_failed`` or error record). A template that cannot move
back to its own groups cannot go on serving from a fiber's leaf: ``spawn``
raises ``Stranded`` and the template exits (fiberd re-warms it).
"""

from __future__ import annotations

import _signal
import os
import subprocess

from slurm_fiber.core.cgroups.held_files import HeldFiles
from slurm_fiber.core.templates import wire
from slurm_fiber.core.templates.child.fiber_setup import exec_argv, exec_env, join, stdio_fds

DOORS_KEPT = 32  # groups whose cgroup.procs a template keeps open (its own and those of
# the leaves it spawned into last: four per leaf on a hybrid host)


class Refused(Exception):
    """The program cannot be started as ordered (one line); a forked spare will say how."""


class Stranded(Exception):
    """The template could not move back to its own cgroups (one line)."""


def move(doors: HeldFiles, msg: wire.Message) -> None:
    """Move this process into the message's groups, as ``fiber_setup.join`` does, each
    move a write through ``doors``' kept descriptors. Raises OSError naming the group."""
    join(msg, lambda group: doors.write(group, "cgroup.procs", b"0"))


def spawn(msg: wire.Message, passed: list[int], home: wire.Message,
          unblocked: set[int], doors: HeldFiles) -> int:
    """Start the ``spawn`` message ``msg``'s exec ``order`` in its ``cgroup`` (and ``also``
    mirrors), with the passed stdio fds ``passed`` (not closed here); the program's pid,
    a child of this process, not yet reaped. ``home``: this process's own groups, in the
    same form (``cgroup``, ``also``; no ``cgroup``: uncarved, no move). The signals
    ``unblocked`` are unblocked in the program (and in this process while it starts);
    ``doors`` (``HeldFiles``) moves this process. Blocking, for the template's single-threaded loop.
    Raises Refused or Stranded."""
    order = msg.get("order")
    if not isinstance(order, dict) or order.get("mode") != "exec":
        raise Refused("a spawn carries an exec order")
    try:
        argv = exec_argv(order)
        env = exec_env(order)
        stdio = stdio_fds(order, passed)
    except (OSError, ValueError) as e:
        raise Refused(wire.one_line(e)) from None
    try:
        return _start_in(msg, home, argv, env, stdio, order.get("cwd") or None, unblocked,
                         doors)
    finally:
        for fd in stdio:
            if fd not in passed:
                os.close(fd)


def _start_in(msg: wire.Message, home: wire.Message, argv: list[bytes],
              env: dict[bytes, bytes], stdio: list[int], cwd: object,
              unblocked: set[int], doors: HeldFiles) -> int:
    """Join ``msg``'s groups, start the program, go back ``home``. Raises Refused, Stranded."""
    carved = isinstance(msg.get("cgroup"), str)
    if carved and not isinstance(home.get("cgroup"), str):
        raise Refused("the template has no cgroup of its own to come back to")
    try:
        if carved:
            move(doors, msg)
        blocked = unblocked & _signal.pthread_sigmask(_signal.SIG_BLOCK, [])
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, blocked)
        try:
            child = subprocess.Popen(
                argv, stdin=stdio[0], stdout=stdio[1], stderr=stdio[2], close_fds=True,
                cwd=cwd if isinstance(cwd, str) else None, env=env, restore_signals=True,
                process_group=0)
        finally:
            _signal.pthread_sigmask(_signal.SIG_BLOCK, blocked)
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        if carved:
            _go_home(home, doors)
        raise Refused(wire.one_line(e)) from None
    # Reaped by the template's own reaper (wait4, by pid), never through Popen: a Popen that
    # thinks its child runs would poll that pid when collected, and could reap another.
    child.returncode = 0
    if carved:
        _go_home(home, doors)
    return child.pid


def _go_home(home: wire.Message, doors: HeldFiles) -> None:
    """Move back to this process's own groups. Raises Stranded."""
    if not isinstance(home.get("cgroup"), str):
        return
    try:
        move(doors, home)
    except OSError as e:
        raise Stranded(f"cannot move back to its own cgroup: {wire.one_line(e)}") from None
