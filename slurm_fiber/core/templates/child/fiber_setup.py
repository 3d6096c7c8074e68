"""What a spare process does between its start and user code, and what an exec is given.

A fiber spare (forked in core/template_main.py) joins its cgroup leaf
(``join``), blocks on its order channel for one ``run`` order
(``await_order``), then takes the order's stdio, env and cwd and either
execs its argv (``exec_order``, writing an ``exec_failed`` record on
failure) or, in a call fiber, goes on to Python (``take_order``). Everything
between a spare's fork and its exec stays in C calls and plain dicts where it
can: each page the Python layers would touch there is a copy-on-write fault.
An exec fiber spawned straight into its leaf (core/exec_spawn.py) is given
its stdio, env and argv by the same functions (``stdio_fds``, ``exec_env``,
``exec_argv``), so it is the same whichever way it started. Exit codes are
the template's (module doc of core/template_main.py). Stdlib only; it holds
no state and starts no threads.
"""

from __future__ import annotations

import _signal
import _socket
import errno
import json
import os
from typing import TYPE_CHECKING

from slurm_fiber.core.templates import wire

if TYPE_CHECKING:
    from collections.abc import Callable

    Runner = Callable[[wire.Message, list[int], "ResultChannel"], int]

EXIT_CGROUP = 71
EXIT_SETUP = 72
EXIT_EXEC = 127  # not found, as a shell's "command not found"
EXIT_NOT_RUNNABLE = 126  # found but not runnable, as a shell's
_INT_SIZE = 4  # a C int, as SCM_RIGHTS carries descriptors
_FDS_SPACE = _socket.CMSG_SPACE(wire.MAX_FDS * _INT_SIZE)
_EXEC_DEFAULTS = (13, 25)  # SIGPIPE and SIGXFSZ, which Python ignores: default for a program


def write_control(cgroup: str, name: str, value: bytes) -> None:
    """Write ``value`` to the control file ``name`` of ``cgroup`` (a directory path), e.g.
    ``cgroup.procs`` ``0`` to join it. Raises OSError."""
    fd = os.open(f"{cgroup}/{name}", os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value)
    finally:
        os.close(fd)


def join(msg: wire.Message, enter: Callable[[str], None] | None = None) -> None:
    """Join the message's ``also`` groups (cgroup v1 mirrors: limits, devices), then its
    ``cgroup``, each by ``enter(group)`` (default: a write of ``0`` to its
    ``cgroup.procs``). Raises OSError naming the group that refused."""
    also = msg.get("also")
    cgroup = msg.get("cgroup")
    for path in [*(also if isinstance(also, list) else []), cgroup]:
        if isinstance(path, str):
            try:
                if enter is None:
                    write_control(path, "cgroup.procs", b"0")
                else:
                    enter(path)
            except OSError as e:
                raise OSError(e.errno, f"{path}: {e.strerror}") from None


def try_join(msg: wire.Message) -> OSError | None:
    """``join`` when the message names a cgroup; the error it raised, if any."""
    if isinstance(msg.get("cgroup"), str):
        try:
            join(msg)
        except OSError as e:
            return e
    return None


class ResultChannel:
    """A fiber's end of its order channel, which then carries its result record back.

    ``write`` sends the record, once, in datagrams of at most ``CHUNK`` bytes
    (SEQPACKET keeps each whole; fiberd joins them until end of file), blocking
    while fiberd's side is full, then shuts the channel for writing: fiberd sees
    end of file, so the whole record, at once, not only once this process has
    finished exiting (tearing down a fork of the big template takes a while),
    and a call's early ``result`` event goes out that much sooner. Closed when
    ``await_order`` returns, or at exec (close-on-exec).
    """

    CHUNK = 32 * 1024

    def __init__(self, sock: _socket.socket) -> None:
        self.sock = sock

    def write(self, text: str) -> None:
        """Send the record ``text`` and end the channel's writing side. Blocking; raises
        OSError (a second write: BrokenPipeError)."""
        data = text.encode()
        for start in range(0, len(data), self.CHUNK):
            self.sock.sendall(data[start:start + self.CHUNK])
        self.sock.shutdown(_socket.SHUT_WR)


def await_order(order_fd: int, msg: wire.Message, joined: OSError | None,
                run: Runner) -> int:
    """Block on the order channel ``order_fd`` for one ``run`` order and ``run`` it (with
    its stdio fds and the result channel); ``msg`` is the spare's own (its cgroup),
    ``joined`` why joining it failed. Returns the exit code: 0 when dismissed (end of
    file), EXIT_SETUP for anything but a ``run`` and EXIT_CGROUP when the join had
    failed (each with an error record sent), else ``run``'s. The channel is closed
    on return (or at exec)."""
    # The C socket type and recvmsg, not socket.socket and socket.recv_fds: this runs
    # right after a fork, where every page the Python layers touch is a copy-on-write
    # fault (about 30 fewer per fiber). Closed here, not left to a finalizer, whose
    # ResourceWarning (formatted even when filtered out) cost a call fiber about a
    # twentieth of its CPU.
    channel = _socket.socket(fileno=order_fd)
    try:
        channel.setblocking(True)
        os.set_inheritable(order_fd, False)
        data, fds = _receive(channel)
        if not data:
            return 0  # dismissed before it was used
        try:
            order = wire.decode(data)
        except wire.WireError:
            order = {}
        result = ResultChannel(channel)
        if order.get("t") != "run":
            for fd in fds:
                os.close(fd)
            write_error(result, ValueError("the spare's order was unreadable or not a run order"))
            return EXIT_SETUP
        if joined is not None:
            return join_failed(result, msg, joined)
        return run(order, fds, result)
    finally:
        channel.close()


def join_failed(result: ResultChannel, cgroup: wire.Message, joined: OSError) -> int:
    """Write why a fiber could not join ``cgroup``'s cgroup on ``result``; EXIT_CGROUP."""
    write_error(result, OSError(joined.errno, f"cannot join cgroup {cgroup.get('cgroup')}: "
                                              f"{joined.strerror}"))
    return EXIT_CGROUP


def _receive(channel: _socket.socket) -> tuple[bytes, list[int]]:
    """One datagram from ``channel`` and the descriptors that rode along (as
    ``socket.recv_fds``). Blocks."""
    data, ancillary, _, _ = channel.recvmsg(wire.MAX_MESSAGE + 1, _FDS_SPACE)
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            whole = len(payload) - len(payload) % _INT_SIZE
            fds += memoryview(payload[:whole]).cast("i").tolist()
    return data, fds


def take_order(order: wire.Message, stdio: list[int], result: ResultChannel) -> bool:
    """Take the order's stdio, env (and SLURM_FIBER_ID, into ``os.environ``) and cwd, as a
    call fiber runs; False (error record written) when one cannot be set up."""
    try:
        setup_stdio(order, stdio)
        os.environ.update(order_env(order))
        if order.get("cwd"):
            os.chdir(str(order["cwd"]))
    except OSError as e:
        write_error(result, e)
        return False
    return True


def order_env(order: wire.Message) -> dict[str, str]:
    """The variables the order adds to the spare's environment: its ``env`` and
    ``SLURM_FIBER_ID``."""
    env = {str(k): str(v) for k, v in dict(order.get("env") or {}).items()}
    env["SLURM_FIBER_ID"] = str(order.get("id"))
    return env


def setup_stdio(msg: wire.Message, passed: list[int]) -> None:
    """Make fds 0/1/2 the order's stdio (``stdio_fds``)."""
    for target, fd in enumerate(stdio_fds(msg, passed)):
        os.dup2(fd, target)
        os.close(fd)


def stdio_fds(msg: wire.Message, passed: list[int]) -> list[int]:
    """The order's stdin, stdout and stderr as three fds the caller owns: the passed fds,
    else /dev/null and files under ``out_dir``. Raises OSError (those opened so far
    closed)."""
    flags = msg.get("stdio") or [False, False, False]
    out_dir = msg.get("out_dir")
    passed_iter = iter(passed)
    fds: list[int] = []
    try:
        for target, given in enumerate(list(flags)[:3]):
            if given:
                fds.append(next(passed_iter))
            elif target == 0 or not isinstance(out_dir, str):
                fds.append(os.open(os.devnull, os.O_RDWR))
            else:
                suffix = "out" if target == 1 else "err"
                path = f"{out_dir}/fiber-{msg.get('id')}.{suffix}"
                fds.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    except OSError:
        for fd in fds:
            if fd not in passed:
                os.close(fd)
        raise
    return fds


def exec_order(order: wire.Message, stdio: list[int], result: ResultChannel) -> int:
    """Run an exec order: its stdio and cwd, then exec its argv with this process's
    environment plus the order's (``os.environ`` itself is left as it is) and SIGPIPE and
    SIGXFSZ at default. Returns only on failure: EXIT_SETUP (error record written), or a
    shell's exit code with the ``exec_failed`` record.

    Between the fork and the exec, only C calls and plain dicts: each page the Python
    layers (``os.environ``'s mapping, ``os.execvpe``, ``signal``'s enums) would touch is a
    copy-on-write fault, and together they cost an exec fiber about 100."""
    try:
        setup_stdio(order, stdio)
        if order.get("cwd"):
            os.chdir(str(order["cwd"]))
        env = exec_env(order)
        argv = exec_argv(order)
    except (OSError, ValueError) as e:
        write_error(result, e)
        return EXIT_SETUP
    for sig in _EXEC_DEFAULTS:
        _signal.signal(sig, _signal.SIG_DFL)
    try:
        _execvpe(argv, env)
    except ValueError as e:  # a NUL in argv or env, an "=" in a name: execve's refusal
        write_error(result, e)
        return EXIT_SETUP
    except OSError as e:
        failure = exec_failure(argv[0].decode("utf-8", "surrogateescape"), e)
        result.write(json.dumps({"ok": False, "exec_failed": failure}))
        return EXIT_EXEC if failure["code"] == EXIT_EXEC else EXIT_NOT_RUNNABLE
    return EXIT_EXEC  # not reached: _execvpe returns only by raising


def exec_env(order: wire.Message) -> dict[bytes, bytes]:
    """The environment an exec order's program gets: this process's plus the order's
    (``order_env``), as the plain bytes dict execve takes. ``os.environ`` itself is left as
    it is."""
    env = _environ_bytes()
    for key, value in order_env(order).items():
        env[key.encode("utf-8", "surrogateescape")] = value.encode("utf-8", "surrogateescape")
    return env


def exec_argv(order: wire.Message) -> list[bytes]:
    """An exec order's argv as bytes. Raises ValueError when it is empty."""
    argv = [str(a).encode("utf-8", "surrogateescape") for a in order.get("argv") or []]
    if not argv:
        raise ValueError("the exec order has no argv")
    return argv


def _environ_bytes() -> dict[bytes, bytes]:
    """``os.environ`` as the plain bytes dict execve takes. CPython keeps exactly that
    behind the mapping (``_data``, kept in step by every change through it); elsewhere
    the mapping is copied."""
    data = getattr(os.environ, "_data", None)
    if isinstance(data, dict):
        return dict(data)
    return {os.fsencode(k): os.fsencode(v) for k, v in os.environ.items()}


def _execvpe(argv: list[bytes], env: dict[bytes, bytes]) -> None:
    """``os.execvpe(argv[0], argv, env)``, same search and errors: a name with a slash is
    exec'd as it is, else each directory of ``env``'s PATH (``os.defpath`` without one)
    in turn; when none runs, the first error that was not "no such file" is raised, else
    the last. A directory without the file is passed over with ``access``, not a failed
    execve. Raises OSError; does not return."""
    name = argv[0]
    if b"/" in name:
        os.execve(name, argv, env)
    first: OSError | None = None
    last: OSError | None = None
    for directory in env.get(b"PATH", os.defpath.encode()).split(b":"):
        path = directory + b"/" + name if directory else name
        if not os.access(path, os.F_OK):
            continue
        try:
            os.execve(path, argv, env)
        except OSError as e:
            last = e
            if first is None and not isinstance(e, (FileNotFoundError, NotADirectoryError)):
                first = e
    raise first or last or FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)


def exec_failure(name: str, err: OSError) -> dict[str, object]:
    """What an exec of ``name`` that raised ``err`` tells: errno, its symbolic name, the
    path (as given), the system's message, the shell's exit ``code`` (127 not found, else
    126) and, when ``name`` exists but its ``#!`` interpreter does not, ``interpreter``."""
    number = err.errno or 0
    out: dict[str, object] = {"errno": number, "name": errno.errorcode.get(number, "?"),
                              "path": name, "message": os.strerror(number) if number else
                              str(err), "code": EXIT_NOT_RUNNABLE}
    if number not in (errno.ENOENT, errno.ENOTDIR):
        return out
    found = name if "/" in name else next(
        (p for d in os.get_exec_path() if os.path.isfile(p := os.path.join(d, name))), None)
    if found is None or not os.path.isfile(found):
        out["code"] = EXIT_EXEC
        return out
    try:
        with open(found, "rb") as f:
            line = f.readline(256)
    except OSError:
        return out
    words = line[2:].split() if line.startswith(b"#!") else []
    if words:
        out["interpreter"] = words[0].decode(errors="replace")
    return out


def error_record(exc: BaseException) -> dict[str, object]:
    """The ``error`` member of a failed fiber's record: type, one line, traceback."""
    import traceback  # only on this path

    tb = "".join(traceback.format_exception(exc))[-4000:]
    return {"type": type(exc).__name__, "message": wire.one_line(exc), "traceback": tb}


def write_error(result: ResultChannel, exc: BaseException) -> None:
    """Write ``exc``'s record (``ok`` false) on the result channel."""
    result.write(json.dumps({"ok": False, "error": error_record(exc)}))
