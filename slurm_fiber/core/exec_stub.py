"""An exec stub: a small spare process that only execs, so an exec fiber does not fork
the big warm template only to exec.

The template (core/template_main.py, ``Server.stub``) starts it ahead of a
Clone with ``os.posix_spawn`` (vfork-cheap however big the template is) as
``python -I -S -c BOOT LIB PARENT SPARE``: isolated (no PYTHON* variables, no
user site, no current directory or script directory on ``sys.path``), no
``site`` (no ``.pth`` file runs), with ``sys.path`` holding the standard
library and ``LIB`` only, the directory the template imported slurm_fiber
from, which the template has checked is safe (``dirtrust``). The spawn
gives it its own process group; its signal mask and ignored signals are the
template's, as a forked spare's are (exec resets the template's handlers);
its env and cwd are the template's (the grant's env and its devices'
variables), its order channel rides along as an inherited fd. Before reading its order it arms
PR_SET_PDEATHSIG (SIGKILL) against the template with the race closed
(core/prctl.py), puts back at default the two signals glibc keeps for
itself (32 and 33: glibc's ``posix_spawn`` leaves them ignored in the child,
and an ignored signal stays ignored across exec; only the raw
``rt_sigaction`` system call can touch them, so stubs run only on machines
whose call number is known here, ``SUPPORTED``) and joins its cgroup leaf
(v1 mirrors first); then it blocks
on its order channel and runs the order as a forked spare would
(core/fiber_setup.py): stdio, env, cwd, exec, or an ``exec_failed`` record.
It refuses anything but an exec order (EXIT_SETUP, error record). The
template is its parent: it reaps it and reports its exit like any spare's.
"""

from __future__ import annotations

import ctypes
import os

from slurm_fiber.core import template_wire as wire
from slurm_fiber.core.fiber_setup import (
    EXIT_SETUP,
    ResultChannel,
    await_order,
    exec_argv,
    take_order,
    try_join,
    write_error,
)
from slurm_fiber.core.prctl import die_with_parent

_RT_SIGACTION = {"x86_64": 13, "aarch64": 134, "riscv64": 134, "ppc64le": 173,
                 "s390x": 174}.get(os.uname().machine)
SUPPORTED = _RT_SIGACTION is not None  # whether stubs can run here (module doc)
_GLIBC_SIGNALS = (32, 33)  # SIGCANCEL, SIGSETXID: refused by sigaction(), not by the kernel

# What the interpreter runs: LIB on sys.path, then main() with the rest of argv.
BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
        "from slurm_fiber.core.exec_stub import main; sys.exit(main(sys.argv[2:]))")


def command(python: str, lib: str, parent: int, spare: wire.Message, order_fd: int) -> list[str]:
    """The argv that starts a stub for the ``stub`` message ``spare`` (its id, cgroup and
    v1 mirrors) with its order channel at ``order_fd`` (inherited)."""
    return [python, "-I", "-S", "-c", BOOT, lib, str(parent), str(order_fd),
            wire.encode(spare).decode()]


def main(argv: list[str]) -> int:
    """The stub's life (argv: PARENT ORDER_FD SPARE). Returns its exit code, or never
    returns (it became the fiber's program)."""
    parent, order_fd, spare = int(argv[0]), int(argv[1]), wire.decode(argv[2].encode())
    die_with_parent(parent)
    _default_glibc_signals()
    joined = try_join(spare)
    return await_order(order_fd, spare, joined, _run)


def _default_glibc_signals() -> None:
    """Set glibc's internal signals to SIG_DFL with the raw system call. Raises OSError."""
    syscall = ctypes.CDLL(None, use_errno=True).syscall
    zeroed = ctypes.create_string_buffer(64)  # a kernel sigaction, all zero: SIG_DFL
    for sig in _GLIBC_SIGNALS:
        if syscall(_RT_SIGACTION, sig, zeroed, None, 8) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"rt_sigaction({sig}): {os.strerror(err)}")


def _run(order: wire.Message, stdio: list[int], result: ResultChannel) -> int:
    if order.get("mode") != "exec":
        write_error(result, ValueError("an exec stub runs exec orders only"))
        return EXIT_SETUP
    if not take_order(order, stdio, result):
        return EXIT_SETUP
    return exec_argv(order, result)
