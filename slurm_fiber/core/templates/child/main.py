"""The code that runs INSIDE a warm template process (``python -m ...templates.child.main``).

fiberd starts it with ``--fd N`` (its end of a SEQPACKET socketpair, templates/wire.py)
and ``--parent PID``, by the command ``template_command`` builds (fiberd never imports
this module): ``python -P`` with a PYTHONPATH stripped of entries anyone but fiberd's
uid or root could write. In order, the template:

0. rebuilds ``sys.path`` from the safe entries only (``dirtrust`` over ``safefs``),
   naming each dropped one on stderr, and leaves an unsafe current directory for "/":
   no directory another user can write is imported from, by it or its fibers;
1. arms PR_SET_PDEATHSIG (SIGTERM: it dies with fiberd) and leaves fiberd's session;
2. reads the ``warm`` order, joins its cgroup leaf (before any grant code), imports
   ``preload``, runs ``warm``, chooses how it forks (child/lean_fork.py), then
   ``gc.freeze()``s its heap; reports ``ready``, or ``warm_failed`` (error class and
   one line) and exits;
3. serves ``spare`` orders: each forks a spare that, before any user code, arms its
   death signal, joins its own cgroup leaf, leads its own process group, drops the
   template's sockets and signal set-up and reseeds RNGs, then blocks on its order
   channel; its order (straight from fiberd) brings the fiber's id and stdio, and it
   runs ``module:function`` with JSON arguments, a pickled call (unpickled only in the
   fiber) or an exec; end of file on the channel dismisses it (exit 0);
3a. serves ``spawn`` orders: starts an exec fiber's program straight into its leaf
   (child/exec_spawn.py) and answers ``spawned`` (with the program's pidfd) or
   ``spawn_failed`` (fiberd then uses a spare, which reports the failure);
3b. serves task windows (child/window_run.py): starts their tasks itself, an exec task
   as a spawn, a call task forked as a spare is (``fork_call``: it joins its leaf and
   runs its order at once, its record on the result channel the window passed); every
   queued order is read before the windows' next starts, and a forked fiber closes the
   descriptors of the tasks not started;
4. reaps its children (``wait4``: by the pid SIGCHLD or fiberd's ``reap`` names, a full
   walk only as often as child/child_exits.py allows) and reports each exit with wait
   status and rusage, after SIGKILLing what the fiber left in its process group. It
   exits when fiberd closes the socket, sends ``stop`` or SIGTERM, or dies, and on the
   way out kills every child's cgroup and process group.

It runs no threads of its own and must never start any (``fork`` in a threaded process
is unsafe), and holds nothing that expires (fiberd holds tokens and sockets).

Exit codes of a fiber that failed before user code: 70 (template gone), 71 (could not
join its cgroup), 72 (unreadable order, or could not set up stdio or cwd); of an exec
that failed, as a shell's: 127 (not found), 126 (found but not runnable), with an
``exec_failed`` record sent; of a call that raised: 1 (error record sent). A spare that
could not join its cgroup waits for its order all the same and reports the error on
its order channel.
"""

from __future__ import annotations

import _signal
import _socket
import argparse
import base64
import contextlib
import gc
import importlib
import json
import os
import pickle
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable

from slurm_fiber.core.cgroups.held_files import HeldFiles
from slurm_fiber.core.templates import wire
from slurm_fiber.core.templates.child import exec_spawn
from slurm_fiber.core.templates.child.child_exits import ChildExits, sweep_due, sweep_wait
from slurm_fiber.core.templates.child.fiber_setup import (
    EXIT_SETUP,
    ResultChannel,
    await_order,
    error_record,
    exec_order,
    join,
    join_failed,
    take_order,
    try_join,
    write_control,
)
from slurm_fiber.core.templates.child.lean_fork import LeanFork
from slurm_fiber.core.templates.child.prctl import die_with_parent, no_new_privs
from slurm_fiber.core.templates.child.window_run import MAX_FDS as WINDOW_MAX_FDS
from slurm_fiber.core.templates.child.window_run import TaskWindow
from slurm_fiber.core.templates.dirtrust import safe_path_entry, trusted_owners
from slurm_fiber.protocol.framing import json_dumps
from slurm_fiber.safefs import UnsafePath, open_dir

_FIBER_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_SPARE_UNBLOCKS = (*_FIBER_SIGNALS, signal.SIGCHLD)  # SIGCHLD: the template's signalfd's
# Around each fork and in each spare, signal masks and dispositions are set with the C
# module ``_signal``: ``signal``'s wrappers turn every signal they return into an enum,
# Python code whose reference counting copies pages of the shared heap (~5 µs each here).


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


def _warm(order: wire.Message) -> None:
    cgroup = order.get("cgroup")
    if isinstance(cgroup, str):
        try:
            join(order)
        except OSError as e:
            raise RuntimeError(f"cannot join cgroup {cgroup}: {e.strerror}") from None
    for name in order.get("preload") or []:
        importlib.import_module(str(name))
    warm = order.get("warm")
    if isinstance(warm, str) and warm:
        resolve(warm)()
    # A pickled call of a function defined by value (in ``__main__``, a closure) names
    # cloudpickle's helpers: imported once here, in the warm template, not in every fiber.
    with contextlib.suppress(ImportError):
        import cloudpickle  # noqa: F401


class Server:
    """The template's fork-and-reap loop (blocking, single-threaded)."""

    def __init__(self, sock: socket.socket, home: wire.Message,
                 fork: Callable[[], int] = os.fork) -> None:
        """``home``: the ``warm`` order, whose ``cgroup`` and ``also`` are this process's
        own groups (a spawn comes back to them); ``fork`` forks each spare (core/lean_fork.py)."""
        self.sock = sock
        self.fork = fork
        self.pid = os.getpid()
        self.home = {"cgroup": home.get("cgroup"), "also": home.get("also")}
        self.doors = HeldFiles(exec_spawn.DOORS_KEPT)  # cgroup.procs kept for spawns
        self.children: dict[int, tuple[str, str | None]] = {}  # pid -> (spare id, cgroup)
        self.sock.set_inheritable(False)  # inherited from fiberd: no child may hold it
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w)
        # The handler makes a SIGCHLD delivered to another thread fire the wakeup fd; in
        # this thread SIGCHLD is blocked and read, with its pid, from ``exits``.
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, self._terminate)
        self.exits = ChildExits()
        self.signalled = False  # a SIGCHLD came since the last walk of all children
        self.walked_at = 0.0  # when the last walk ended (time.monotonic())
        self.walk_took = 0.0  # and the CPU seconds its looking took
        self.windows: dict[str, TaskWindow] = {}  # task windows (core/.../window_run.py)
        self.queued = select.poll()  # whether another message waits (``handle_requests``)
        self.queued.register(self.sock, select.POLLIN)

    def _terminate(self, *_: object) -> None:
        self.kill_all()
        os._exit(0)

    def kill_all(self) -> None:
        """SIGKILL every fiber with its descendants (cgroup and process group)."""
        for pid, (_, cgroup) in self.children.items():
            if cgroup is not None:
                with contextlib.suppress(OSError):
                    write_control(cgroup, "cgroup.kill", b"1")
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)

    def close(self) -> None:
        """Drop the template's fds (in a fiber, before user code), the descriptors of task
        windows' tasks not started among them."""
        for window in self.windows.values():
            window.forget_fds()
        self.sock.close()
        self.doors.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        self.exits.close()

    def serve(self) -> None:
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        poller.register(self.wake_r, select.POLLIN)
        poller.register(self.exits.fileno(), select.POLLIN)
        while True:
            wait = sweep_wait(self.signalled, time.monotonic(), self.walked_at, self.walk_took)
            if self.windows:
                wait = self.run_windows(wait)
            for fd, _ in poller.poll(None if wait is None else wait * 1000):
                if fd == self.exits.fileno():
                    for pid in self.exits.pids():
                        self.reap(pid)
                    self.signalled = True
                elif fd == self.wake_r:
                    self._drain_wakeups()
                    self.signalled = True
                elif not self.handle_requests():
                    return
            if sweep_due(self.signalled, time.monotonic(), self.walked_at, self.walk_took):
                self.walk()

    def run_windows(self, wait: float | None) -> float | None:
        """One pass over the task windows (core/templates/child/window_run.py): kill what
        ran its seconds, start what may start, send each one's report; the poll's wait,
        shortened to the next window's due time."""
        for window in list(self.windows.values()):
            window.enforce()
            window.pump(self.home, set(_SPARE_UNBLOCKS), self.doors, self._adopt,
                        self.fork_call)
            due = window.enforce()  # with what started now
            window.report()
            if window.done:
                del self.windows[window.id]
            elif due is not None:
                wait = due if wait is None else min(wait, due)
        return wait

    def _adopt(self, pid: int, key: str, cgroup: str | None) -> None:
        self.children[pid] = (key, cgroup)

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def walk(self) -> None:
        """Collect every exited child (a walk of all of them in the kernel, per exit and
        once more), reporting each. The CPU of the last, empty walk is what ``sweep_due``
        spaces walks by: the cost of looking, not of the reaping a mass exit needs
        anyway, nor the time this process waited for a CPU meanwhile."""
        while True:
            start = time.thread_time()
            try:
                exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                exited = None
            if exited is None:
                break
            self._collect(exited.si_pid)
        self.walk_took = time.thread_time() - start
        self.walked_at = time.monotonic()
        self.signalled = False

    def reap(self, pid: int) -> None:
        """Collect and report child ``pid`` if it has exited (no walk of the others); a pid
        that is no child of this process, or still running, is left alone."""
        try:
            exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if exited is not None:
            self._collect(pid)

    def _collect(self, pid: int) -> None:
        """Reap exited child ``pid`` and report it, its process group killed first."""
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)  # the zombie still holds the group's id
        _, status, ru = os.wait4(pid, 0)
        spare_id, _ = self.children.pop(pid, (None, None))
        cpu = ru.ru_utime + ru.ru_stime
        if any(w.ended(pid, status, cpu, ru.ru_maxrss * 1024) for w in self.windows.values()):
            return  # in the window's next report
        _send(self.sock, {"t": "exit", "id": spare_id, "pid": pid, "status": status,
                          "cpu": ru.ru_utime + ru.ru_stime, "maxrss": ru.ru_maxrss * 1024})

    def handle_requests(self) -> bool:
        """Serve every message queued on the socket (``handle_request`` each); False when
        the parent is gone or said stop. All of them before the windows' next pump: a
        ``window_close`` queued behind another order is read before a fiber the close
        killed is reaped and its place refilled."""
        while self.handle_request():
            if not self.queued.poll(0):
                return True
        return False

    def handle_request(self) -> bool:
        """Serve one message; False when the parent is gone or said stop."""
        # Close-on-exec from the start: a received fd must reach no program but the one
        # it was sent for.
        data, fds, _, _ = socket.recv_fds(self.sock, wire.MAX_MESSAGE + 1, WINDOW_MAX_FDS,
                                          socket.MSG_CMSG_CLOEXEC)
        if not data:
            return False
        try:
            msg = wire.decode(data)
        except wire.WireError:
            msg = {"t": "unreadable"}
        if msg["t"] == "stop":
            return False
        if msg["t"] == "reap" and isinstance(msg.get("pid"), int):
            self.reap(msg["pid"])
        if msg["t"] in ("window", "window_close", "window_extend", "window_ack"):
            self.window_order(msg, fds)
        elif msg["t"] == "spare" and len(fds) == 1:
            self.spare(msg, fds[0])
        elif msg["t"] == "spawn":
            self.spawn(msg, fds)
        else:
            for fd in fds:
                os.close(fd)
        return True

    def window_order(self, msg: dict[str, object], fds: list[int]) -> None:
        """Open, close or extend a task window (core/templates/child/window_run.py); a
        window order that cannot be read is answered with a ``done`` report starting nothing."""
        window_id = str(msg.get("id"))
        if msg["t"] == "window":
            try:
                self.windows[window_id] = TaskWindow.from_message(
                    msg, fds, lambda m: _send(self.sock, m))
            except ValueError as e:
                _send(self.sock, {"t": "window_report", "id": window_id, "starts": [],
                                  "ends": [], "done": True, "error": str(e)})
            return
        for fd in fds:
            os.close(fd)
        window = self.windows.get(window_id)
        if window is None:
            return
        if msg["t"] == "window_close":
            window.close()
        elif msg["t"] == "window_ack":
            window.acked()
        elif isinstance(left := msg.get("left"), int | float):
            window.extend(float(left))

    def spare(self, msg: dict[str, object], order_fd: int) -> None:
        """Fork one spare (see the module doc); answer ``spared`` or ``fork_failed``."""
        spare_id = str(msg.get("id"))
        try:
            pid = self._fork_fiber(lambda: run_spare(msg, order_fd, self))
        except OSError as e:
            os.close(order_fd)
            _send(self.sock, {"t": "fork_failed", "id": spare_id,
                              "error": type(e).__name__, "message": wire.one_line(e)})
            return
        os.close(order_fd)
        cgroup = msg.get("cgroup")
        self.children[pid] = (spare_id, cgroup if isinstance(cgroup, str) else None)
        _send(self.sock, {"t": "spared", "id": spare_id, "pid": pid})

    def fork_call(self, order: dict[str, object], stdio: list[int], result_fd: int,
                  cgroup: str | None, also: list[str]) -> int:
        """Fork a task window's call fiber (core/templates/child/window_run.py): as a
        spare is forked, the child joins ``cgroup`` (and ``also``), leads its own process
        group, drops the template's descriptors and runs ``order`` as a spare runs its
        order (``run_fiber``), its record on ``result_fd``, then exits with its code. The
        caller closes ``stdio`` and ``result_fd`` and adopts the pid. Raises OSError when
        the fork fails."""
        return self._fork_fiber(lambda: run_window_call(
            order, stdio, result_fd, {"cgroup": cgroup, "also": also}, self))

    def _fork_fiber(self, run: Callable[[], int]) -> int:
        """Fork a fiber that runs ``run`` and exits with its code (a traceback, if it
        raises, to the fiber's stderr); the child's pid, leading its own process group.
        Raises OSError when the fork fails."""
        sys.stdout.flush()
        sys.stderr.flush()
        # Signals that arrive before the child has reset its handlers wait, blocked,
        # and then meet the fiber's dispositions, never the template's.
        _signal.pthread_sigmask(_signal.SIG_BLOCK, _FIBER_SIGNALS)
        try:
            pid = self.fork()
        except OSError:
            _signal.pthread_sigmask(_signal.SIG_UNBLOCK, _FIBER_SIGNALS)
            raise
        if pid == 0:
            code = EXIT_SETUP
            try:
                code = run()
            except BaseException:
                traceback.print_exc()  # to the fiber's stderr, else the template's log
                sys.stderr.flush()
            finally:
                os._exit(code)
        _signal.pthread_sigmask(_signal.SIG_UNBLOCK, _FIBER_SIGNALS)
        # The child does this too; doing it on both sides means that once fiberd
        # hears of the fiber, it leads its own process group (no signal race).
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)
        return pid

    def spawn(self, msg: dict[str, object], stdio: list[int]) -> None:
        """Start an exec fiber's program in its leaf (core/exec_spawn.py) with the passed
        ``stdio`` (closed here); answer ``spawned`` with its pidfd, or ``spawn_failed``.
        The program is a child of this process, as a spare is: ``reap`` collects and
        reports it. Raises Stranded (this process cannot go on: it exits)."""
        spare_id = str(msg.get("id"))
        try:
            pid = exec_spawn.spawn(msg, stdio, self.home, set(_SPARE_UNBLOCKS), self.doors)
        except exec_spawn.Refused as e:
            _send(self.sock, {"t": "spawn_failed", "id": spare_id, "message": str(e)})
            return
        finally:
            for fd in stdio:
                os.close(fd)
        cgroup = msg.get("cgroup")
        self.children[pid] = (spare_id, cgroup if isinstance(cgroup, str) else None)
        pidfd = os.pidfd_open(pid)  # before any reap: it names this child, race-free
        try:
            socket.send_fds(self.sock, [wire.encode({"t": "spawned", "id": spare_id,
                                                     "pid": pid})], [pidfd])
        finally:
            os.close(pidfd)


def run_spare(msg: dict[str, object], order_fd: int, server: Server) -> int:
    """In the forked child: confine, wait for the order, run it. Returns the exit code
    (never user code's)."""
    joined = _confine(msg, server)  # its v1 groups too: a spare pays these moves, not a Clone
    return await_order(order_fd, msg, joined, run_fiber)


def _confine(cgroup: wire.Message, server: Server) -> OSError | None:
    """In a forked fiber (a spare, a window's call): die with the template, join
    ``cgroup`` (its cgroup and v1 mirrors), lead a process group, take back the default
    signal handling and drop the template's server. Why joining failed, or None."""
    die_with_parent(server.pid)
    joined = try_join(cgroup)
    os.setpgid(0, 0)
    _signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        _signal.signal(sig, _signal.SIG_DFL)
    _signal.signal(signal.SIGINT, _signal.default_int_handler)
    _signal.pthread_sigmask(_signal.SIG_UNBLOCK, _SPARE_UNBLOCKS)
    server.close()
    _reseed()
    return joined


def run_window_call(order: wire.Message, stdio: list[int], result_fd: int,
                    leaf: wire.Message, server: Server) -> int:
    """In a task window's forked call fiber: confine as a spare does (its ``leaf``: cgroup
    and v1 mirrors), then run ``order`` with its ``stdio``, the record on ``result_fd``.
    Returns the exit code (never user code's); EXIT_CGROUP, with an error record, when
    the leaf could not be joined."""
    joined = _confine(leaf, server)
    channel = _socket.socket(fileno=result_fd)
    try:
        channel.setblocking(True)
        result = ResultChannel(channel)
        if joined is not None:
            return join_failed(result, leaf, joined)
        return run_fiber(order, stdio, result)
    finally:
        channel.close()


def run_fiber(order: wire.Message, stdio: list[int], result: ResultChannel) -> int:
    """Take the order's stdio, env and cwd, then run it. Returns the exit code."""
    if order.get("mode") == "exec":
        return exec_order(order, stdio, result)
    if not take_order(order, stdio, result):
        return EXIT_SETUP
    return _call(order, result)


def _reseed() -> None:
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def caller_path(entries: object) -> None:
    """Put a call's import path (the order's ``path``: the caller's directories) first
    on ``sys.path``, in its order, each entry only when ``safe_path_entry`` finds it safe
    here (the others named on the fiber's stderr), so the fiber imports as its caller
    would and never from a directory another user can write."""
    if not isinstance(entries, list) or not entries:
        return
    kept: list[str] = []
    for entry in entries:
        if not isinstance(entry, str) or entry in sys.path or entry in kept:
            continue
        why = safe_path_entry(entry)
        if why is None:
            kept.append(entry)
        elif os.path.exists(entry):
            print(f"fiber: the caller's sys.path entry {entry!r} left out: {why}",
                  file=sys.stderr)
    sys.path[:0] = kept


def _call(msg: wire.Message, result: ResultChannel) -> int:
    caller_path(msg.get("path"))
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
        record = json_dumps({"ok": True, **run()})
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
    error = error_record(exc)
    if pickled:
        exc.__traceback__ = None  # the record carries it as text; frames do not pickle
        with contextlib.suppress(Exception):
            error["pickled"] = _pickle(exc)
    result.write(json.dumps({"ok": False, "error": error}))


def main(argv: list[str] | None = None) -> int:
    """Entry point; fiberd is the only caller. Returns the template's exit code."""
    parser = argparse.ArgumentParser(prog="slurm_fiber.core.templates.child.main")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--no-new-privs", action="store_true")
    opts = parser.parse_args(argv)
    if opts.no_new_privs:  # a root fiberd's (core/identity.py): before any grant code
        no_new_privs()
    safe_sys_path()
    die_with_parent(opts.parent, signal.SIGTERM)
    os.setsid()
    forker = LeanFork()
    sock = socket.socket(fileno=opts.fd)
    sock.setblocking(True)
    data = sock.recv(wire.MAX_MESSAGE + 1)
    if not data:
        return 0
    try:
        warm = wire.decode(data)
        _warm(warm)
    except BaseException as e:
        _send(sock, {"t": "warm_failed", "error": type(e).__name__,
                     "message": wire.one_line(e)})
        return 1
    why = forker.ready()
    if why is not None:
        print(f"template: forking with os.fork: {why}", file=sys.stderr)
    gc.collect()
    gc.freeze()
    _send(sock, {"t": "ready", "pid": os.getpid(), "modules": len(sys.modules)})
    server = Server(sock, warm, forker.fork)
    try:
        server.serve()
    except exec_spawn.Stranded as e:
        print(f"template: {e}; exiting", file=sys.stderr)
    server.kill_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
