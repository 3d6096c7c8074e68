"""The code that runs INSIDE a warm template process (``python -m ...template_main``).

fiberd starts this module with ``--fd N`` (its end of a SEQPACKET
socketpair, see ``template_wire``) and ``--parent PID``, by the command
``command`` builds: ``python -P`` (the current directory is not put on
``sys.path``) with a PYTHONPATH stripped of entries anyone but fiberd's uid or
root could write. In order, the template:

0. rebuilds ``sys.path`` from the entries that are safe (``dirtrust`` over ``safefs``:
   absolute, existing, owned by fiberd's uid or root, writable by nobody
   else up from "/"), naming each dropped one on stderr (its log), and leaves
   a current directory that is not safe for "/"; so no directory another user
   can write is ever imported from, by the template or its fibers;
1. arms PR_SET_PDEATHSIG (SIGTERM: it dies with fiberd, even when fiberd is
   SIGKILLed) and leaves fiberd's session (a Ctrl-C at fiberd's terminal
   does not reach it);
2. reads the ``warm`` order, joins its cgroup leaf (before any grant code),
   imports ``preload``, runs ``warm``, then ``gc.freeze()``s its heap so
   fibers keep sharing it; reports ``ready``, or ``warm_failed`` with the
   error class and one line, and exits;
3. serves ``spare`` orders: each forks one *spare*, a fiber process made
   ahead of its Clone. The spare, before any user code, arms
   PR_SET_PDEATHSIG against the template, writes itself into its own cgroup,
   becomes a process-group leader, drops the template's sockets and signal
   set-up and reseeds RNGs (random by CPython's own at-fork hook; numpy if
   imported); then it blocks on its order channel (a SEQPACKET socket whose
   other end fiberd holds). Its order (one message, straight from fiberd)
   brings the fiber's id and its stdio fds; it takes its stdio
   (passed fds, or files under the state dir), env and cwd, then runs
   ``module:function`` with JSON arguments (its result record goes back on
   the order channel), or a pickled call (the order's ``pickled`` text,
   unpickled here, in the fiber, never in fiberd or the template; the
   function's value or exception goes back pickled), or execs an argv. End
   of file on the order channel dismisses the spare (exit 0). So the fork
   and the cgroup move, which costs an RCU grace period when moves are
   spaced out, are paid before the Clone, not during it;
4. reaps its children (``wait4``) and reports each exit, by spare id, with
   wait status and rusage. Before reaping a fiber it SIGKILLs what the fiber
   left running in its process group (while the unreaped leader holds the
   group's id, so the signal cannot reach a stranger that reused it): a
   fiber ends with its leader, uncarved as carved (where its cgroup is
   emptied). It exits when fiberd closes the socket, sends
   ``stop`` or SIGTERM, or dies (its death signal is SIGTERM). On the way
   out it SIGKILLs every child's cgroup (``cgroup.kill``) and process group,
   so a fiber's own children go too; a fiber whose template is SIGKILLed
   dies by its own death signal.

It runs NO threads of its own and must never start any: ``fork`` in a
threaded process is unsafe. Nothing that expires (tokens, control-plane
sockets) is held here; fiberd holds all of that.

Exit codes of a fiber that failed before user code: 70 (template gone),
71 (could not join its cgroup), 72 (unreadable order, or could not set up
stdio or cwd); of an exec that failed, as a shell's: 127 (not found), 126
(found but not runnable: permission, bad interpreter, format), with an
``exec_failed`` record (errno, its name, the path, the system's message, and
a missing ``#!`` interpreter's path) sent; of a call that raised: 1 (error
record sent). A spare that could not join its cgroup waits for its order
all the same and reports the error on its order channel.
"""

from __future__ import annotations

import _signal
import argparse
import base64
import contextlib
import errno
import gc
import importlib
import json
import os
import pickle
import select
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Mapping

from slurm_fiber.core import template_wire as wire
from slurm_fiber.core.dirtrust import safe_path_entry, trusted_owners
from slurm_fiber.core.prctl import die_with_parent
from slurm_fiber.safefs import UnsafePath, open_dir

_FIBER_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# Around each fork and in each spare, signal masks and dispositions are set with the C
# module ``_signal``: ``signal``'s wrappers turn every signal they return into an enum,
# Python code whose reference counting copies pages of the shared heap (~5 µs each here).
EXIT_CGROUP = 71
EXIT_SETUP = 72
EXIT_EXEC = 127  # not found, as a shell's "command not found"
EXIT_NOT_RUNNABLE = 126  # found but not runnable, as a shell's


def command(python: str, env: Mapping[str, str], fd: int,
            parent: int) -> tuple[list[str], dict[str, str], list[str]]:
    """The argv and env that start a template (fiberd's side), and the PYTHONPATH entries
    left out as unsafe (one line each, for fiberd's log)."""
    env = dict(env)
    dropped = []
    if env.get("PYTHONPATH"):
        kept = []
        for entry in env["PYTHONPATH"].split(os.pathsep):
            why = safe_path_entry(entry)
            if why is None:
                kept.append(entry)
            else:
                dropped.append(f"PYTHONPATH entry {entry!r} left out: {why}")
        env["PYTHONPATH"] = os.pathsep.join(kept)
    argv = [python, "-P", "-m", "slurm_fiber.core.template_main", "--fd", str(fd),
            "--parent", str(parent)]
    return argv, env, dropped


def safe_sys_path() -> None:
    """Keep only the safe ``sys.path`` entries (stderr names the others) and leave an
    unsafe current directory for "/". Called first thing in the template."""
    kept = []
    for entry in sys.path:
        why = safe_path_entry(entry)
        if why is None:
            kept.append(entry)
        elif entry and os.path.exists(entry):  # a missing entry goes without a word
            print(f"template: sys.path entry {entry!r} left out: {why}", file=sys.stderr)
    sys.path[:] = kept
    try:
        os.close(open_dir(os.getcwd(), trusted_owners=trusted_owners()))
    except OSError as err:
        why = str(err) if isinstance(err, UnsafePath) else (err.strerror or str(err))
        print(f"template: working directory is not safe ({why}); using /", file=sys.stderr)
        os.chdir("/")


def resolve(target: str) -> Callable[..., object]:
    """The callable named by "module:function" (dotted attributes allowed)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{target!r} is not 'module:function'")
    obj: object = sys.modules.get(module_name) or importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{target} is not callable")
    return obj


def _send(sock: socket.socket, msg: dict[str, object]) -> None:
    sock.sendall(wire.encode(msg))


def _write_control(cgroup: str, name: str, value: bytes) -> None:
    """Write ``value`` to the control file ``name`` of ``cgroup`` (a directory path), e.g.
    ``cgroup.procs`` ``0`` to join it. Raises OSError."""
    fd = os.open(f"{cgroup}/{name}", os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value)
    finally:
        os.close(fd)


def _join(msg: wire.Message) -> None:
    """Join the message's ``also`` groups (cgroup v1 mirrors: limits, devices), then its
    ``cgroup``. Raises OSError naming the group that refused."""
    also = msg.get("also")
    cgroup = msg.get("cgroup")
    for path in [*(also if isinstance(also, list) else []), cgroup]:
        if isinstance(path, str):
            try:
                _write_control(path, "cgroup.procs", b"0")
            except OSError as e:
                raise OSError(e.errno, f"{path}: {e.strerror}") from None


def _warm(order: wire.Message) -> None:
    cgroup = order.get("cgroup")
    if isinstance(cgroup, str):
        try:
            _join(order)
        except OSError as e:
            raise RuntimeError(f"cannot join cgroup {cgroup}: {e.strerror}") from None
    for name in order.get("preload") or []:
        importlib.import_module(str(name))
    warm = order.get("warm")
    if isinstance(warm, str) and warm:
        resolve(warm)()
    # A pickled call of a function defined by value (in ``__main__``, a closure) names
    # cloudpickle's helpers: imported once here (~13 ms), not in every such fiber.
    with contextlib.suppress(ImportError):
        import cloudpickle  # noqa: F401


class Server:
    """The template's fork-and-reap loop (blocking, single-threaded)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid = os.getpid()
        self.children: dict[int, tuple[str, str | None]] = {}  # pid -> (spare id, cgroup)
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wakeup fd fires
        signal.signal(signal.SIGTERM, self._terminate)

    def _terminate(self, *_: object) -> None:
        self.kill_all()
        os._exit(0)

    def kill_all(self) -> None:
        """SIGKILL every fiber with its descendants (cgroup and process group)."""
        for pid, (_, cgroup) in self.children.items():
            if cgroup is not None:
                with contextlib.suppress(OSError):
                    _write_control(cgroup, "cgroup.kill", b"1")
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)

    def close(self) -> None:
        """Drop the template's fds (in a fiber, before user code)."""
        self.sock.close()
        os.close(self.wake_r)
        os.close(self.wake_w)

    def serve(self) -> None:
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        poller.register(self.wake_r, select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd == self.wake_r:
                    self._drain_wakeups()
                    self.reap()
                elif not self.handle_request():
                    return

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def reap(self) -> None:
        """Collect every exited child and report it, its process group killed first."""
        while True:
            try:
                exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if exited is None:
                return
            pid = exited.si_pid
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)  # the zombie still holds the group's id
            _, status, ru = os.wait4(pid, 0)
            spare_id, _ = self.children.pop(pid, (None, None))
            _send(self.sock, {"t": "exit", "id": spare_id, "pid": pid, "status": status,
                              "cpu": ru.ru_utime + ru.ru_stime, "maxrss": ru.ru_maxrss * 1024})

    def handle_request(self) -> bool:
        """Serve one message; False when the parent is gone or said stop."""
        data, fds, _, _ = socket.recv_fds(self.sock, wire.MAX_MESSAGE + 1, wire.MAX_FDS)
        if not data:
            return False
        try:
            msg = wire.decode(data)
        except wire.WireError:
            msg = {"t": "unreadable"}
        if msg["t"] == "stop":
            return False
        if msg["t"] == "spare" and len(fds) == 1:
            self.spare(msg, fds[0])
        else:
            for fd in fds:
                os.close(fd)
        return True

    def spare(self, msg: dict[str, object], order_fd: int) -> None:
        """Fork one spare (see the module doc); answer ``spared`` or ``fork_failed``."""
        spare_id = str(msg.get("id"))
        sys.stdout.flush()
        sys.stderr.flush()
        # Signals that arrive before the child has reset its handlers wait, blocked,
        # and then meet the fiber's dispositions, never the template's.
        _signal.pthread_sigmask(_signal.SIG_BLOCK, _FIBER_SIGNALS)
        try:
            pid = os.fork()
        except OSError as e:
            _signal.pthread_sigmask(_signal.SIG_UNBLOCK, _FIBER_SIGNALS)
            os.close(order_fd)
            _send(self.sock, {"t": "fork_failed", "id": spare_id,
                              "error": type(e).__name__, "message": wire.one_line(e)})
            return
        if pid == 0:
            code = EXIT_SETUP
            try:
                code = run_spare(msg, order_fd, self)
            except BaseException:
                traceback.print_exc()  # to the fiber's stderr, else the template's log
                sys.stderr.flush()
            finally:
                os._exit(code)
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, _FIBER_SIGNALS)
        os.close(order_fd)
        # The child does this too; doing it on both sides means that once fiberd
        # hears "spared", the spare leads its own process group (no signal race).
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)
        cgroup = msg.get("cgroup")
        self.children[pid] = (spare_id, cgroup if isinstance(cgroup, str) else None)
        _send(self.sock, {"t": "spared", "id": spare_id, "pid": pid})


def run_spare(msg: dict[str, object], order_fd: int, server: Server) -> int:
    """In the forked child: confine, wait for the order, run it. Returns the exit code
    (never user code's)."""
    die_with_parent(server.pid)
    joined: OSError | None = None
    cgroup = msg.get("cgroup")
    if isinstance(cgroup, str):
        try:
            _join(msg)  # its v1 groups too: a spare pays these moves, not a Clone
        except OSError as e:
            joined = e
    os.setpgid(0, 0)
    _signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        _signal.signal(sig, _signal.SIG_DFL)
    _signal.signal(signal.SIGINT, _signal.default_int_handler)
    _signal.pthread_sigmask(_signal.SIG_UNBLOCK, _FIBER_SIGNALS)
    server.close()
    _reseed()
    channel = socket.socket(fileno=order_fd)
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
        _write_error(result, ValueError("the spare's order was unreadable or not a run order"))
        return EXIT_SETUP
    if joined is not None:
        _write_error(result, OSError(joined.errno, f"cannot join cgroup {cgroup}: "
                                                   f"{joined.strerror}"))
        return EXIT_CGROUP
    return run_fiber(order, fds, result)


class ResultChannel:
    """A fiber's end of its order channel, which then carries its result record back.

    ``write`` sends the text in datagrams of at most ``CHUNK`` bytes
    (SEQPACKET keeps each whole; fiberd joins them until end of file), and
    blocks while fiberd's side is full. Closed when the fiber exits, or at
    exec (close-on-exec).
    """

    CHUNK = 32 * 1024

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def write(self, text: str) -> None:
        data = text.encode()
        for start in range(0, len(data), self.CHUNK):
            self.sock.sendall(data[start:start + self.CHUNK])


def run_fiber(order: wire.Message, stdio: list[int], result: ResultChannel) -> int:
    """Take the order's stdio, env and cwd, then run it. Returns the exit code."""
    try:
        _setup_stdio(order, stdio)
        env = order.get("env") or {}
        os.environ.update({str(k): str(v) for k, v in dict(env).items()})
        os.environ["SLURM_FIBER_ID"] = str(order.get("id"))
        if order.get("cwd"):
            os.chdir(str(order["cwd"]))
    except OSError as e:
        _write_error(result, e)
        return EXIT_SETUP
    if order.get("mode") == "exec":
        return _exec(order, result)
    return _call(order, result)


def _setup_stdio(msg: wire.Message, passed: list[int]) -> None:
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


def _reseed() -> None:
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _exec(msg: wire.Message, result: ResultChannel) -> int:
    argv = [str(a) for a in msg.get("argv") or []]
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    try:
        os.execvpe(argv[0], argv, os.environ)
    except OSError as e:
        failure = exec_failure(argv[0], e)
        result.write(json.dumps({"ok": False, "exec_failed": failure}))
        return EXIT_EXEC if failure["code"] == EXIT_EXEC else EXIT_NOT_RUNNABLE
    except IndexError as e:
        _write_error(result, e)
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
    with contextlib.suppress(OSError), open(found, "rb") as f:
        line = f.readline(256)
        if line.startswith(b"#!"):
            words = line[2:].split()
            if words:
                out["interpreter"] = words[0].decode(errors="replace")
    return out


def _call(msg: wire.Message, result: ResultChannel) -> int:
    pickled = msg.get("pickled")
    if isinstance(pickled, str):
        return _answer(result, lambda: _call_pickled(msg, pickled), pickled=True)
    args = msg.get("args") or []
    kwargs = msg.get("kwargs") or {}
    return _answer(result, lambda: {"result": resolve(str(msg.get("target")))(
        *list(args), **dict(kwargs))})


def _answer(result: ResultChannel, run: Callable[[], dict[str, object]], *,
            pickled: bool = False) -> int:
    """Run a call (``run`` returns the record's ``result`` member) and write its record:
    ``ok`` with the result, the exit of a SystemExit, or the raised error (pickled beside
    its text for a pickled call). The fiber's exit code: 0, SystemExit's, 130 on
    KeyboardInterrupt, else 1."""
    code = 0
    try:
        record = json.dumps({"ok": True, **run()})
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        record = json.dumps({"ok": code == 0, "result": None, "exit": code})
    except KeyboardInterrupt as e:
        _write_error(result, e, pickled=pickled)
        return 130
    except BaseException as e:
        _write_error(result, e, pickled=pickled)
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    result.write(record)
    return code


def _call_pickled(msg: wire.Message, pickled: str) -> dict[str, object]:
    """A pickled call (protocol v2): ``pickled`` holds ``(args, kwargs)`` for the order's
    ``target``, else ``(function, args, kwargs)``. The record's ``result`` is
    ``{"pickled": base64}`` of the value; a raised exception travels pickled beside its
    text (when it pickles), through ``_answer``."""
    payload = pickle.loads(base64.b64decode(pickled))
    target = msg.get("target")
    if isinstance(target, str):
        function, (args, kwargs) = resolve(target), payload
    else:
        function, args, kwargs = payload
    return {"result": {"pickled": _pickle(function(*args, **kwargs))}}


def _pickle(value: object) -> str:
    """``value`` pickled as base64 text (cloudpickle for what pickle cannot: lambdas, ...).
    Raises what both raise."""
    try:
        data = pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        import cloudpickle

        data = cloudpickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    return base64.b64encode(data).decode()


def _write_error(result: ResultChannel, exc: BaseException, pickled: bool = False) -> None:
    tb = "".join(traceback.format_exception(exc))[-4000:]
    error: dict[str, object] = {"type": type(exc).__name__, "message": wire.one_line(exc),
                                "traceback": tb}
    if pickled:
        exc.__traceback__ = None  # the text above carries it; frames do not pickle
        with contextlib.suppress(Exception):
            error["pickled"] = _pickle(exc)
    result.write(json.dumps({"ok": False, "error": error}))


def main(argv: list[str] | None = None) -> int:
    """Entry point; fiberd is the only caller. Returns the template's exit code."""
    parser = argparse.ArgumentParser(prog="slurm_fiber.core.template_main")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    opts = parser.parse_args(argv)
    safe_sys_path()
    die_with_parent(opts.parent, signal.SIGTERM)
    os.setsid()
    sock = socket.socket(fileno=opts.fd)
    sock.setblocking(True)
    data = sock.recv(wire.MAX_MESSAGE + 1)
    if not data:
        return 0
    try:
        _warm(wire.decode(data))
    except BaseException as e:
        _send(sock, {"t": "warm_failed", "error": type(e).__name__,
                     "message": wire.one_line(e)})
        return 1
    gc.collect()
    gc.freeze()
    _send(sock, {"t": "ready", "pid": os.getpid(), "modules": len(sys.modules)})
    server = Server(sock)
    server.serve()
    server.kill_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
