"""Exec stubs: small spare processes that only exec, so an exec fiber does not fork the
big warm template only to exec.

The template (core/template_main.py, ``Server.stub``) asks its *stub maker*
for each stub (``StubMaker.make``). The maker is one small process per
template process, started on the first request with ``os.posix_spawn``
(vfork-cheap however big the template is) as ``python -I -S -c BOOT LIB
PARENT FD``: isolated (no PYTHON* variables, no user site, no current or
script directory on ``sys.path``), no ``site`` (no ``.pth`` file runs), with
``sys.path`` holding the standard library and ``LIB`` only, the directory the
template imported slurm_fiber from, which the template has checked is safe
(``dirtrust``). Its env (but LD_BIND_NOW, which the maker alone runs with:
``_BIND_NOW``), cwd, signal mask (but SIGCHLD, which the template blocks
for its own use) and ignored signals are the template's (exec resets the template's
handlers); it dies with the template (PR_SET_PDEATHSIG, SIGKILL) and, being in the
template's process group, with its group kill.

For each request the maker clones itself with ``CLONE_PARENT``: the stub is
a copy of the small maker (a cheap clone, no copy of the template's heap)
whose parent is the *template*, so the template reaps it and reports its
exit (status, rusage) exactly as a forked spare's. The stub then, before
its order: arms PR_SET_PDEATHSIG (SIGKILL) against the template with the race
closed (core/prctl.py), joins its cgroup leaf (v1 mirrors first), leads its
own process group (the template sets it too, so it holds once the template
answers ``spared``) and blocks on its order channel; the order runs as a
forked spare's would (core/fiber_setup.py): stdio, env, cwd, exec, or an
``exec_failed`` record. It refuses anything but an exec order (EXIT_SETUP,
error record).

Two things only the raw system calls do, so stubs run only on machines whose
call numbers are known here (``SUPPORTED``; elsewhere exec fibers fork from
the template as before): ``clone`` with CLONE_PARENT (Python has no clone),
and putting back at default the two signals glibc keeps for itself (32 and
33: glibc's ``posix_spawn`` leaves them ignored in the maker, an ignored
signal stays ignored across exec, and ``sigaction()`` refuses them). The
maker is single-threaded and a stub runs no Python but this module's before
its exec, so cloning without CPython's after-fork hooks is safe here; the
maker runs no user code.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import socket
import sys

from slurm_fiber.core import template_wire as wire
from slurm_fiber.core.fiber_setup import (
    EXIT_SETUP,
    ResultChannel,
    await_order,
    exec_order,
    try_join,
    write_error,
)
from slurm_fiber.core.prctl import die_with_parent

# (rt_sigaction, clone) system call numbers; clone's flags come first on all of these.
_CALLS = {"x86_64": (13, 56), "aarch64": (134, 220), "riscv64": (134, 220),
          "ppc64le": (173, 120)}.get(os.uname().machine)
SUPPORTED = _CALLS is not None  # whether exec stubs can run here (module doc)
_GLIBC_SIGNALS = (32, 33)  # SIGCANCEL, SIGSETXID: refused by sigaction(), not by the kernel
_CLONE_PARENT = 0x00008000
# The maker starts with every symbol bound (ld.so's LD_BIND_NOW): a stub then finds its
# libc and libpython calls bound, where lazy binding would write the GOT of each library
# it first calls after the clone, a copy-on-write fault and a symbol search each.
_BIND_NOW = "LD_BIND_NOW"
_syscall = ctypes.PyDLL(None, use_errno=True).syscall  # with the GIL held: a clone keeps it
_syscall.restype = ctypes.c_long

# What the maker's interpreter runs: LIB on sys.path, then serve() with the rest of argv.
BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
        "from slurm_fiber.core.exec_stub import serve; sys.exit(serve(sys.argv[2:]))")


class StubMaker:
    """The template's side: one maker process, started on first use; blocking, for the
    template's single-threaded loop."""

    def __init__(self, python: str, lib: str, timeout: float) -> None:
        self.python, self.lib, self.timeout = python, lib, timeout
        self.sock: socket.socket | None = None
        self.pid: int | None = None

    def make(self, msg: wire.Message, order_fd: int) -> int:
        """Have the maker clone one stub for the ``stub`` message ``msg`` (its id, cgroup
        and v1 mirrors) with its order channel ``order_fd`` (not closed here); the stub's
        pid, a child of this process. Raises OSError (one line) when the maker cannot;
        a maker that fails to answer within ``timeout`` is killed, a new one started next
        time."""
        if self.sock is None:
            self._start()
        assert self.sock is not None
        try:
            socket.send_fds(self.sock, [wire.encode(msg)], [order_fd])
            data = self.sock.recv(wire.MAX_MESSAGE + 1)
        except OSError as e:
            self.close()
            raise OSError(e.errno, f"the exec stub maker: {e.strerror or e}") from None
        if not data:
            self.close()
            raise OSError("the exec stub maker is gone")
        reply = wire.decode(data)
        if reply["t"] != "spared":
            raise OSError(f"the exec stub maker cannot clone: {reply.get('message')}")
        return int(reply["pid"])

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            theirs.set_inheritable(True)
            env = dict(os.environ)
            bound_by_us = "1" if _BIND_NOW not in env else ""
            env.setdefault(_BIND_NOW, "1")
            argv = [self.python, "-I", "-S", "-c", BOOT, self.lib, str(os.getpid()),
                    str(theirs.fileno()), bound_by_us]
            try:
                self.pid = os.posix_spawn(self.python, argv, env,
                                          setsigmask=_mask_without_sigchld())
            except OSError:
                ours.close()
                raise
        ours.settimeout(self.timeout)
        self.sock = ours

    def forget(self) -> None:
        """In a forked child of the template: drop the socket before user code (the maker
        stays the template's)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def close(self) -> None:
        """Let the maker go (it exits at end of file; killed if it is not answering).
        The template's reaper collects it."""
        self.forget()
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.pid = None


def _mask_without_sigchld() -> set[int]:
    """The calling thread's signal mask but SIGCHLD, which the template blocks to read it
    from a signalfd (core/child_exits.py): the maker, its stubs and their programs must
    not inherit that block (a shell would never see its children exit)."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    mask.discard(signal.SIGCHLD)
    return set(mask)


def serve(argv: list[str]) -> int:
    """The maker's loop (argv: PARENT FD BOUND): one stub per request, until end of file.
    BOUND non-empty: LD_BIND_NOW was set for the maker alone, and leaves its environment
    (so no stub's program inherits it) before any stub. Returns its exit code."""
    parent, fd = int(argv[0]), int(argv[1])
    if argv[2:3] == ["1"]:
        os.environ.pop(_BIND_NOW, None)
    # Whatever else the template let through posix_spawn is no stub's business: every
    # stub, and the program it execs, starts with stdio and its order channel only.
    os.closerange(3, fd)
    os.closerange(fd + 1, os.sysconf("SC_OPEN_MAX"))
    die_with_parent(parent)
    _default_glibc_signals()
    gc.disable()  # a collection in a stub would touch, and so copy, the maker's whole heap
    gc.freeze()
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    sock.set_inheritable(False)
    while True:
        data, fds, _, _ = socket.recv_fds(sock, wire.MAX_MESSAGE + 1, 1)
        if not data:
            return 0
        try:
            if len(fds) != 1:
                raise OSError("a stub request needs exactly its order channel")
            msg = wire.decode(data)
            pid = _clone_parent()
        except (OSError, wire.WireError) as e:
            for fd_ in fds:
                os.close(fd_)
            sock.send(wire.encode({"t": "fork_failed", "message": wire.one_line(e)}))
            continue
        if pid == 0:
            code = EXIT_SETUP
            try:
                sock.close()
                code = _stub(parent, msg, fds[0])
            except BaseException as e:
                print(f"exec stub: {wire.one_line(e)}", file=sys.stderr)
            finally:
                os._exit(code)
        os.close(fds[0])
        sock.send(wire.encode({"t": "spared", "pid": pid}))


def _stub(parent: int, msg: wire.Message, order_fd: int) -> int:
    """In a fresh stub (a child of the template): confine, wait for the order, run it."""
    die_with_parent(parent)
    joined = try_join(msg)
    os.setpgid(0, 0)
    return await_order(order_fd, msg, joined, _run)


def _run(order: wire.Message, stdio: list[int], result: ResultChannel) -> int:
    if order.get("mode") != "exec":
        write_error(result, ValueError("an exec stub runs exec orders only"))
        return EXIT_SETUP
    return exec_order(order, stdio, result)


def _clone_parent() -> int:
    """Clone this process as a sibling (CLONE_PARENT): 0 in the clone, its pid here.
    Raises OSError."""
    assert _CALLS is not None
    flags = _CLONE_PARENT | signal.SIGCHLD  # the exit signal the template's reaper waits for
    pid = int(_syscall(ctypes.c_long(_CALLS[1]), ctypes.c_ulong(flags), None, None, None,
                       ctypes.c_ulong(0)))
    if pid < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"clone: {os.strerror(err)}")
    return pid


def _default_glibc_signals() -> None:
    """Set glibc's internal signals to SIG_DFL with the raw system call. Raises OSError."""
    assert _CALLS is not None
    zeroed = ctypes.create_string_buffer(64)  # a kernel sigaction, all zero: SIG_DFL
    for sig in _GLIBC_SIGNALS:
        if _syscall(ctypes.c_long(_CALLS[0]), sig, zeroed, None, 8) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"rt_sigaction({sig}): {os.strerror(err)}")
