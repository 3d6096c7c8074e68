"""What a spare process does between its start and user code, shared by both kinds.

A fiber spare (forked in core/template_main.py) and an exec stub
(core/exec_stub.py, spawned by the template) do the same before user code:
join their cgroup leaf (``join``), block on their order channel for one
``run`` order (``await_order``), take the order's stdio, env and cwd
(``take_order``) and, in exec mode, exec its argv (``exec_argv``), writing
an ``exec_failed`` record on failure. Having one copy keeps an exec fiber
identical whichever kind of spare it started from. Exit codes are the
template's (module doc of core/template_main.py). Stdlib only and light: an
exec stub imports it at start, ahead of its Clone; it holds no state and
starts no threads.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket

from slurm_fiber.core import template_wire as wire

TYPE_CHECKING = False  # typing is not imported at run time: an exec stub starts lean
if TYPE_CHECKING:
    from collections.abc import Callable

    Runner = Callable[[wire.Message, list[int], "ResultChannel"], int]

EXIT_CGROUP = 71
EXIT_SETUP = 72
EXIT_EXEC = 127  # not found, as a shell's "command not found"
EXIT_NOT_RUNNABLE = 126  # found but not runnable, as a shell's


def write_control(cgroup: str, name: str, value: bytes) -> None:
    """Write ``value`` to the control file ``name`` of ``cgroup`` (a directory path), e.g.
    ``cgroup.procs`` ``0`` to join it. Raises OSError."""
    fd = os.open(f"{cgroup}/{name}", os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value)
    finally:
        os.close(fd)


def join(msg: wire.Message) -> None:
    """Join the message's ``also`` groups (cgroup v1 mirrors: limits, devices), then its
    ``cgroup``. Raises OSError naming the group that refused."""
    also = msg.get("also")
    cgroup = msg.get("cgroup")
    for path in [*(also if isinstance(also, list) else []), cgroup]:
        if isinstance(path, str):
            try:
                write_control(path, "cgroup.procs", b"0")
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

    ``write`` sends the text in datagrams of at most ``CHUNK`` bytes
    (SEQPACKET keeps each whole; fiberd joins them until end of file), and
    blocks while fiberd's side is full. Closed when ``await_order`` returns, or at
    exec (close-on-exec).
    """

    CHUNK = 32 * 1024

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def write(self, text: str) -> None:
        data = text.encode()
        for start in range(0, len(data), self.CHUNK):
            self.sock.sendall(data[start:start + self.CHUNK])


def await_order(order_fd: int, msg: wire.Message, joined: OSError | None,
                run: Runner) -> int:
    """Block on the order channel ``order_fd`` for one ``run`` order and ``run`` it (with
    its stdio fds and the result channel); ``msg`` is the spare's own (its cgroup),
    ``joined`` why joining it failed. Returns the exit code: 0 when dismissed (end of
    file), EXIT_SETUP for anything but a ``run`` and EXIT_CGROUP when the join had
    failed (each with an error record sent), else ``run``'s. The channel is closed
    on return."""
    channel = socket.socket(fileno=order_fd)
    # Closed here, not left to the finalizer, whose ResourceWarning (formatted even when
    # filtered out) cost a call fiber about a twentieth of its CPU.
    with channel:
        channel.setblocking(True)
        channel.set_inheritable(False)
        data, fds, _, _ = socket.recv_fds(channel, wire.MAX_MESSAGE + 1, wire.MAX_FDS)
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
            write_error(result, OSError(joined.errno, f"cannot join cgroup {msg.get('cgroup')}: "
                                                      f"{joined.strerror}"))
            return EXIT_CGROUP
        return run(order, fds, result)


def take_order(order: wire.Message, stdio: list[int], result: ResultChannel) -> bool:
    """Take the order's stdio, env (and SLURM_FIBER_ID) and cwd; False (error record
    written) when one cannot be set up."""
    try:
        setup_stdio(order, stdio)
        env = order.get("env") or {}
        os.environ.update({str(k): str(v) for k, v in dict(env).items()})
        os.environ["SLURM_FIBER_ID"] = str(order.get("id"))
        if order.get("cwd"):
            os.chdir(str(order["cwd"]))
    except OSError as e:
        write_error(result, e)
        return False
    return True


def setup_stdio(msg: wire.Message, passed: list[int]) -> None:
    """Make fds 0/1/2 the passed fds, else /dev/null and files under ``out_dir``."""
    flags = msg.get("stdio") or [False, False, False]
    out_dir = msg.get("out_dir")
    passed_iter = iter(passed)
    for target, given in enumerate(list(flags)[:3]):
        if given:
            fd = next(passed_iter)
        elif target == 0 or not isinstance(out_dir, str):
            fd = os.open(os.devnull, os.O_RDWR)
        else:
            suffix = "out" if target == 1 else "err"
            path = f"{out_dir}/fiber-{msg.get('id')}.{suffix}"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, target)
        os.close(fd)


def exec_argv(msg: wire.Message, result: ResultChannel) -> int:
    """Exec the order's argv (SIGPIPE and SIGXFSZ back to default first); on failure the
    ``exec_failed`` record and a shell's exit code."""
    argv = [str(a) for a in msg.get("argv") or []]
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    # A plain dict: execve reads os.environ, a Python-level mapping, once per PATH entry
    # tried, which cost an exec stub about a tenth of its CPU.
    env = dict(os.environ)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        failure = exec_failure(argv[0], e)
        result.write(json.dumps({"ok": False, "exec_failed": failure}))
        return EXIT_EXEC if failure["code"] == EXIT_EXEC else EXIT_NOT_RUNNABLE
    except IndexError as e:
        write_error(result, e)
    return EXIT_EXEC


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
    import traceback  # only on this path: an exec stub starts without it

    tb = "".join(traceback.format_exception(exc))[-4000:]
    return {"type": type(exc).__name__, "message": wire.one_line(exc), "traceback": tb}


def write_error(result: ResultChannel, exc: BaseException) -> None:
    """Write ``exc``'s record (``ok`` false) on the result channel."""
    result.write(json.dumps({"ok": False, "error": error_record(exc)}))
