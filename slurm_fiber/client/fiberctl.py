"""``fiberctl``: talk to the fiberd of this job or host.

``fiberctl run -- CMD...`` runs CMD as a fiber as if it ran here: this
terminal's stdin/stdout/stderr are passed to the fiber (SCM_RIGHTS), output
streams live, the exit status comes back as fiberctl's own, and signals
reach the fiber: Ctrl-C is forwarded as SIGINT; a second Ctrl-C sends
SIGKILL; a third stops waiting and exits 130 (the fiber has been sent
SIGKILL already). SIGTERM, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 are
forwarded as they are. If fiberctl itself dies, fiberd sends the fiber
SIGHUP, as a terminal hang-up would.

``fiberctl map [OPTIONS] -- CMD {}`` runs CMD once per argument, each in
its own fiber, as GNU parallel does (``fiberctl map --help``; the code lives
in slurm_fiber.client.fibermap, imported only when map runs). ``fiberctl wait
[--timeout S]`` returns once fiberd is ready (69: it never answered; 75: it
answered but is not ready).

Exit codes (every command; the table every slurm_fiber command shares, README
"Commands"): 0 success; 1 refused or failed: fiberd refused the request
(``code: reason`` printed; it was 65 before, see README), the fiber failed
(``call``: the function raised or the fiber died), ``kill``: the fiber had
already exited; 2 usage error; and fiberctl's own: 69 fiberd unreachable or
the connection broke; 75 a retryable miss (cold, capacity, source_stale,
fenced, denied); 77 a final miss (invalid_token, unknown_grant, expired,
warm_failed, closed, unenforceable); 130 gave up waiting after a third
Ctrl-C. ``run`` exits with the fiber's status (its exit code, 128+N when
signal N killed it, 127/126 when its exec failed, as a shell's), so a
command's own exit code can coincide with those above: the miss or refusal
line on stderr tells them apart.

Waiting like srun: ``run`` and ``call`` (and ``map``) wait through a
``cold`` or ``capacity`` miss, and in a Slurm job (or with ``--wait`` given)
through a fiberd not listening yet, for up to ``--wait S`` seconds (300 by
default: a job script that starts ``fiberd-run`` and runs at once never
notices), saying once on stderr what they wait for; then 75 (69) as before.
``--no-wait`` exits at once, as before issue 39. A final miss (unknown_grant,
...) and the other retryable ones (source_stale, fenced, denied,
audit_failed) exit at once.

Why a fiber ended, when fiberd ended it (a deadline, the lease's end, a
fence, the grant's removal, an epoch bump, ``fiberctl stop``, fiberd's
shutdown, a lost template) or the kernel's OOM killer did, ``run``, ``call``
and ``map`` say in one line on stderr (``fiberctl: fiber ID stopped: ...``);
an exec that failed is said as srun says it (``fiberctl: execve(): PATH:
No such file or directory``; status 127, or 126 when found but not
runnable, as a shell's). ``--quiet`` leaves those lines out; the status is
the same.

``fiberctl grants`` lists the grants fiberd holds (template state, fibers,
lease end, what of their limits is enforced); ``fiberctl inspect ID`` shows
one fiber's record; ``fiberctl kill ID [-s SIG]`` sends it a signal (default
TERM) without waiting, as kill(1); ``stop`` waits for it to go. Each takes
``--json``. ``fiberctl metrics`` prints fiberd's metrics (Prometheus text).

Global options (``--socket``, ``--json``, ``--grant``, ``--quiet``) may come
before the command as well as after it: ``fiberctl --socket PATH status``.
"""

from __future__ import annotations

import _signal
import _socket
import os
import sys
from types import FrameType, SimpleNamespace

from slurm_fiber.client.connection import FiberdClient, Missed, Refused, Unreachable
from slurm_fiber.client.discovery import discover_socket
from slurm_fiber.client.waits import DEFAULT_WAIT, WAITED
from slurm_fiber.protocol import requests as rq
from slurm_fiber.protocol.framing import json_dumps, json_loads
from slurm_fiber.protocol.limits import STDIO_NAMES

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (a per-task cost)
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Sequence
    from typing import NoReturn

EXIT_OK = 0
EXIT_FIBER_FAILED = 1
EXIT_USAGE = 2
EXIT_REFUSED = 1  # the shared table's "refused or failed"; 65 until fiberctl joined it
EXIT_UNREACHABLE = 69
EXIT_RETRYABLE_MISS = 75
EXIT_FINAL_MISS = 77
EXIT_ABANDONED = 130

EXIT_EPILOG = ("exit codes: 0 ok; 1 refused or failed (one line on stderr); 2 usage; "
               "69 fiberd unreachable; 75 retryable miss; 77 final miss; 130 gave up "
               "after a third Ctrl-C; run: the fiber's own status (126/127 exec failed, "
               "128+N signal N). See fiberctl --help.")

# run and call handle signals with the C module ``_signal`` (the import budget: ``signal``
# builds enums); the commands that name signals (kill, a failed forward) import ``signal``.
FORWARDED_SIGNALS = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP, _signal.SIGQUIT,
                     _signal.SIGUSR1, _signal.SIGUSR2)

SOCKET_HELP = ("fiberd's socket. Default: $FIBERD_SOCKET, else inside a Slurm job the "
               "job's fiberd on this node (started by `srun --overlap fiberd-run`), else "
               "$FIBERD_STATE_DIR/fiberd.sock or /var/lib/slurm-fiber/fiberd.sock.")


class Exit(Exception):
    """Leave fiberctl with ``code`` (the line, if any, is already printed)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def fail(code: int, line: str) -> Exit:
    """Print one line on stderr and return the Exit to raise."""
    print(line, file=sys.stderr)
    return Exit(code)


class Abandoned(Exception):
    """The user pressed Ctrl-C a third time: stop waiting for the fiber."""


class answers:  # lower case: used as the function it was, ``with answers():``
    """Turn client failures into one stderr line and the documented exit code: a context
    manager that raises ``Exit`` for Missed, Refused, Unreachable and Abandoned and lets
    everything else through. (A class, not contextlib.contextmanager: contextlib's import
    costs a fiberctl started per task more than this whole class.)"""

    def __enter__(self) -> None:
        return None

    def __exit__(self, _kind: object, e: BaseException | None, _tb: object) -> None:
        if isinstance(e, Missed):
            raise fail(EXIT_RETRYABLE_MISS if e.retryable else EXIT_FINAL_MISS,
                       f"{e.code}: {e.reason}") from None
        if isinstance(e, Refused):
            raise fail(EXIT_REFUSED, f"{e.code}: {e.reason}") from None
        if isinstance(e, Unreachable):
            raise fail(EXIT_UNREACHABLE, f"fiberctl: {e}") from None
        if isinstance(e, Abandoned):
            raise fail(EXIT_ABANDONED,
                       "fiberctl: stopped waiting; the fiber was sent SIGKILL") from None


def grant_fields(grant: str | None, token: str | None, env: list[str]) -> dict[str, object]:
    """The clone fields naming the grant and env additions; raises Exit(2) on bad input."""
    grant, token_text, additions = grant_parts(grant, token, env)
    fields: dict[str, object] = {}
    if grant:
        fields["grant"] = grant
    if token_text is not None:
        fields["token"] = token_text
    if additions:
        fields["env"] = additions
    return fields


def grant_parts(grant: str | None, token: str | None,
                env: list[str]) -> tuple[str | None, str | None, dict[str, str]]:
    """The grant named, the token read from the file named, and the env additions;
    raises Exit(2) on bad input."""
    text: str | None = None
    if grant and token:
        raise fail(EXIT_USAGE, "fiberctl: give --grant or --token, not both")
    if token:
        try:
            with open(token, encoding="utf-8") as fh:
                text = fh.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise fail(EXIT_USAGE, f"fiberctl: cannot read token file {token}: {why}; "
                       "--token wants a file holding one grant token") from None
    additions: dict[str, str] = {}
    for item in env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise fail(EXIT_USAGE, f"fiberctl: --env wants KEY=VALUE, got {item!r}")
        additions[key] = value
    return grant or None, text, additions


def clone_request(args: argparse.Namespace, call: rq.CallTarget | None = None,
                  exec: rq.ExecTarget | None = None) -> rq.Clone:
    """The waited, hung-up-on-exit clone ``run`` and ``call`` send; raises Exit(2) on bad
    input."""
    grant, token, env = grant_parts(args.grant, args.token, args.env)
    return rq.Clone(call=call, exec=exec, grant=grant, token=token, env=env, wait=True,
                    hangup=True)


def open_stdio() -> dict[str, int]:
    """This process's stdin/stdout/stderr descriptors that are open, by name."""
    out: dict[str, int] = {}
    for fd, name in enumerate(STDIO_NAMES):
        try:
            os.fstat(fd)
        except OSError:
            continue
        out[name] = fd
    return out


class SignalForwarder:
    """Forwards this process's signals to one fiber, over separate connections.

    Installed around a waited clone (main thread only). Signals that arrive
    before the fiber has started are held and sent once it has. Ctrl-C
    escalates: SIGINT, then SIGKILL, then Abandoned is raised in the main
    thread. A forward that fails prints one line and is not retried.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fiber_id: str | None = None
        self.held: list[int] = []
        self.interrupts = 0
        self.saved: dict[int, object] = {}

    def __enter__(self) -> SignalForwarder:
        for signum in FORWARDED_SIGNALS:
            self.saved[signum] = _signal.signal(signum, self.on_signal)
        return self

    def __exit__(self, *_exc: object) -> None:
        for signum, handler in self.saved.items():
            _signal.signal(signum, handler)

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if signum == _signal.SIGINT:
            self.interrupts += 1
            if self.interrupts >= 3:
                raise Abandoned
            if self.interrupts == 2:
                signum = _signal.SIGKILL
        if self.fiber_id is None:
            self.held.append(signum)
        else:
            self.forward(signum)

    def attach(self, fiber_id: str) -> None:
        """The fiber has started: forward what was held, then every later signal."""
        self.fiber_id = fiber_id
        held, self.held = self.held, []
        for signum in held:
            self.forward(signum)

    def forward(self, signum: int) -> None:
        try:
            with FiberdClient(self.path, timeout=5.0) as client:
                client.signal_fiber(str(self.fiber_id), signum)
        except (Unreachable, Refused) as e:
            import signal

            print(f"fiberctl: could not forward {signal.Signals(signum).name}: {e}",
                  file=sys.stderr)




def wait_bound(args: argparse.Namespace) -> tuple[float | None, bool]:
    """(seconds run/call wait through retryable misses, None for --no-wait; whether a
    socket nobody listens on is waited for too: in a Slurm job, or --wait given)."""
    if args.no_wait:
        return None, False
    if args.wait is None:
        return DEFAULT_WAIT, bool(os.environ.get("SLURM_JOB_ID"))
    try:
        seconds = float(args.wait)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise fail(EXIT_USAGE, f"fiberctl: --wait wants seconds, got {args.wait!r}")
    return seconds, True


def clone_and_wait(path: str, request: rq.Clone, wait: float | None = None,
                   listening: bool = False) -> dict[str, object]:
    """Clone with this process's stdio and signals attached; the exit event when it ends.
    With ``wait``, a cold or capacity miss (and, with ``listening``, a socket nobody listens
    on yet) is tried again for up to ``wait`` seconds, as srun waits for resources,
    saying once on stderr what for; a signal meanwhile stops the wait (128+N)."""
    import time

    with SignalForwarder(path) as forwarder:
        start, delay, said = time.monotonic(), 0.05, False
        while True:
            client: FiberdClient | None = None
            try:
                client = FiberdClient(path)
                fiber = client.clone(request, stdio=open_stdio(), wait=True)
                break
            except (Missed, Unreachable) as err:
                if client is not None:
                    client.close()
                waiting = wait is not None and (
                    err.code in WAITED if isinstance(err, Missed) else client is None and listening
                    and isinstance(err.__cause__, FileNotFoundError | ConnectionRefusedError))
                left = (wait or 0.0) - (time.monotonic() - start)
                if not waiting or left <= 0:
                    raise
                if not said:
                    what = (f"{err.code}: {err.reason}" if isinstance(err, Missed)
                            else f"fiberd to listen at {path}")
                    print(f"fiberctl: waiting up to {wait:g} s for {what}", file=sys.stderr,
                          flush=True)
                    said = True
                if forwarder.held:
                    raise fail(128 + forwarder.held[0], "fiberctl: stopped waiting for "
                               "fiberd (signal); nothing was started") from None
                after = err.miss.get("retry_after") if isinstance(err, Missed) else None
                pause = max(delay, after if isinstance(after, int | float) else 0.0)
                time.sleep(max(0.0, min(pause, left, 1.0)))
                delay = min(1.0, delay * 2)
            except BaseException:
                if client is not None:
                    client.close()
                raise
        with client:
            forwarder.attach(fiber.id)
            return client.wait_exit()


def end_line(end: dict[str, object]) -> str | None:
    """The one line saying why a fiber ended, from its exit event; None when it ended by
    itself (an exit, or a signal fiberd did not send and no OOM kill)."""
    failed = end.get("exec_failed")
    if isinstance(failed, dict):
        interp = failed.get("interpreter")
        bad = f"{interp}: bad interpreter: " if interp else ""
        return f"fiberctl: execve(): {failed.get('path')}: {bad}{failed.get('message')}"
    reason = end.get("reason")
    if isinstance(reason, dict):
        verb = "ended" if reason.get("code") in ("oom", "signal") else "stopped"
        return f"fiberctl: fiber {end.get('fiber_id')} {verb}: {reason.get('message')}"
    return None


def say_end(end: dict[str, object], quiet: bool) -> None:
    """Print ``end_line`` on stderr, unless ``quiet`` or there is nothing to say."""
    line = None if quiet else end_line(end)
    if line is not None:
        print(line, file=sys.stderr)


def run(args: argparse.Namespace) -> None:
    """Run CMD as a fiber (exec mode), here: stdio passed, signals forwarded, its exit status
    returned (128+N if signal N killed it). Runs in this directory."""
    if not args.cmd:
        raise fail(EXIT_USAGE, "fiberctl run: give the command after --: fiberctl run -- CMD")
    request = clone_request(args, exec=rq.ExecTarget(tuple(args.cmd), os.getcwd()))
    path = discover_socket(args.socket)
    with answers():
        end = clone_and_wait(path, request, *wait_bound(args))
    say_end(end, args.quiet)
    error = end.get("error")
    if isinstance(error, dict) and not args.quiet:  # its set-up failed before the exec
        print(f"fiberctl: fiber {end.get('fiber_id')} did not start: {error.get('type')}: "
              f"{error.get('message')}", file=sys.stderr)
    if args.json:  # after the fiber's own output: its exit event, one line
        print(json_dumps(end), flush=True)
    raise Exit(int(end.get("status", 255)))  # type: ignore[call-overload]


def command_path() -> list[str]:
    """The import path a command's call carries (``call.path``): the working directory,
    then ``$PYTHONPATH``'s entries (absolute), as ``python -m`` here would import."""
    cwd = os.getcwd()
    out = [cwd]
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        path = os.path.normpath(os.path.join(cwd, entry))
        if path not in out:
            out.append(path)
    return out


def call(args: argparse.Namespace) -> None:
    """Call MODULE:FUNC in the grant's warm interpreter and print its JSON result. It is
    imported as ``python -m`` here would: the working directory and $PYTHONPATH first."""
    try:
        values = json_loads(args.json_args) if args.json_args is not None else []
    except ValueError as e:
        raise fail(EXIT_USAGE, f"fiberctl: JSON_ARGS is not JSON: {e}") from None
    if isinstance(values, list):
        target = rq.CallTarget(args.target, args=tuple(values), path=tuple(command_path()))
    elif isinstance(values, dict):
        target = rq.CallTarget(args.target, kwargs=values, path=tuple(command_path()))
    else:
        raise fail(EXIT_USAGE, "fiberctl: JSON_ARGS must be a JSON array or object")
    request = clone_request(args, call=target)
    with answers():
        end = clone_and_wait(discover_socket(args.socket), request, *wait_bound(args))
    say_end(end, args.quiet)
    error = end.get("error")
    if args.json:  # the whole exit event (fiber_id, status, result or error), one line
        print(json_dumps(end))
    if isinstance(error, dict):
        raise fail(EXIT_FIBER_FAILED, f"{error.get('type')}: {error.get('message')}")
    if not args.json:
        print(json_dumps(end.get("result")))


class connected:  # lower case: used as the function it was
    """A client of the discovered fiberd, closed on the way out; its failures (connecting,
    talking, closing) exit as ``answers`` says."""

    def __init__(self, socket: str | None) -> None:
        self.socket = socket
        self.client: FiberdClient | None = None

    def __enter__(self) -> FiberdClient:
        with answers():
            self.client = FiberdClient(discover_socket(self.socket))
        return self.client

    def __exit__(self, kind: object, e: BaseException | None, tb: object) -> None:
        try:
            if self.client is not None:
                self.client.close()
        except BaseException as failure:  # replaces ``e``, as it would leaving a with block
            answers().__exit__(type(failure), failure, failure.__traceback__)
            raise
        answers().__exit__(kind, e, tb)


FIBER_COLUMNS = ("id", "pid", "grant", "state", "exit_status", "started")


def fiber_row(record: dict[str, object]) -> str:
    values = dict(record)
    exit_record = values.get("exit")
    if "exit_status" not in values and isinstance(exit_record, dict):
        code, signum = exit_record.get("exit_code"), exit_record.get("signal")
        values["exit_status"] = code if code is not None else (
            f"SIG{signum}" if signum is not None else "-")
    started = values.get("started")
    if isinstance(started, int | float):
        values["started"] = age(time_now_boot() - started)
    return "  ".join(f"{values.get(c, '-')!s:<{w}}" for c, w in zip(
        FIBER_COLUMNS, (24, 8, 24, 10, 11, 12), strict=True)).rstrip()


def time_now_boot() -> float:
    import time

    return time.clock_gettime(time.CLOCK_BOOTTIME)


def list_fibers(args: argparse.Namespace) -> None:
    """List the fibers fiberd tracks (id, pid, grant, state, exit status, when started);
    --all: with the ended ones fiberd still remembers (its history settings)."""
    with connected(args.socket) as client:
        if args.json:
            print(json_dumps(list(client.iter_fibers(ended=args.all))))
            return
        print(fiber_row({c: c.upper() for c in FIBER_COLUMNS}))
        for record in client.iter_fibers(ended=args.all):  # page by page: no huge reply
            print(fiber_row(record))


def stop(args: argparse.Namespace) -> None:
    """Stop fiber ID (SIGTERM, grace, SIGKILL); returns once it is gone."""
    with connected(args.socket) as client:
        record = client.stop_fiber(args.fiber_id, args.grace)
    print(json_dumps(record) if args.json else f"stopped {args.fiber_id}")


def inspect_fiber(args: argparse.Namespace) -> None:
    """Show fiber ID's record (pid, grant, state, exit, cpu time, ...), one field a line."""
    with connected(args.socket) as client:
        record = client.inspect_fiber(args.fiber_id)
    if args.json:
        print(json_dumps(record))
        return
    for key, value in record.items():
        if key in ("started", "deadline") and isinstance(value, int | float):
            print(f"{key}: {when(boot_to_wall(value))}")  # fiberd's CLOCK_BOOTTIME
        else:
            print(f"{key}: {value if isinstance(value, str) else json_dumps(value)}")


def boot_to_wall(at: float) -> float:
    """A time on CLOCK_BOOTTIME (fiberd's records: this host's, as fiberd is this host's)
    as wall time."""
    import time

    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - at)


def when(wall: float) -> str:
    """A wall time for people: ISO 8601 (UTC) and how long ago or ahead."""
    import time

    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall))
    return f"{iso} ({age(time.time() - wall)})"


def age(seconds: float) -> str:
    """``3 s ago``, ``in 2 min``, ``5 h ago``, ``2 d ago``."""
    ahead, span = seconds < 0, abs(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if span >= size:
            text = f"{span / size:.0f} {unit}"
            break
    else:
        text = f"{span:.0f} s"
    return f"in {text}" if ahead else f"{text} ago"


def logs(args: argparse.Namespace) -> None:
    """Print fiber ID's output (its stdout here, its stderr on stderr) from the files fiberd
    keeps when a Clone passed no descriptors; --follow: as it comes, until the fiber ended.
    A file is read only when it is a regular file of fiberd's uid (or root), opened without
    following a link. Exit 1 when the fiber has no such files (its output went where its
    caller pointed it)."""
    import re
    import time

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}", args.fiber_id):
        raise fail(EXIT_USAGE, f"fiberctl logs: {args.fiber_id!r} is not a fiber id")
    path = discover_socket(args.socket)
    with connected(args.socket) as client:
        owner = _server_uid(client)
        try:
            record: dict[str, object] | None = dict(client.inspect_fiber(args.fiber_id))
        except Refused as e:
            if e.code != "not_found":
                raise
            record = None  # ended and forgotten: its files, if kept, are in the state dir
    if record is not None:
        names = (record.get("stdout"), record.get("stderr"))
    else:
        base = os.path.join(os.path.dirname(path), "fibers", f"fiber-{args.fiber_id}")
        names = (f"{base}.out", f"{base}.err")
    files = [_open_output(name, owner) if isinstance(name, str) else None for name in names]
    if record is None and files == [None, None]:
        raise fail(EXIT_FIBER_FAILED, f"fiberctl logs: fiberd knows no fiber {args.fiber_id} "
                   "and keeps no output of one")
    if record is not None and names == (None, None):
        raise fail(EXIT_FIBER_FAILED, f"fiberctl logs: fiber {args.fiber_id}'s output went "
                   "to the descriptors its caller passed, not to fiberd's files")
    sinks = (sys.stdout.buffer, sys.stderr.buffer)
    offsets = [0, 0]
    collected: list[bytes] = [b"", b""]
    running = record is not None and record.get("state") in ("running", "stopping")
    try:
        while True:
            for n, fd in enumerate(files):
                while fd is not None and (chunk := os.pread(fd, 1 << 16, offsets[n])):
                    offsets[n] += len(chunk)
                    if args.json:
                        collected[n] += chunk
                    else:
                        sinks[n].write(chunk)
                        sinks[n].flush()
            if not (args.follow and running):
                break
            time.sleep(0.2)
            running = _still_running(args.socket, args.fiber_id)
    finally:
        for fd in files:
            if fd is not None:
                os.close(fd)
    if args.json:
        print(json_dumps({"fiber": args.fiber_id, "stdout": collected[0].decode(errors="replace"),
                          "stderr": collected[1].decode(errors="replace")}))


def _server_uid(client: FiberdClient) -> int:
    import struct

    creds = struct.Struct("3i")
    return int(creds.unpack(client.sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED,
                                                   creds.size))[1])


def _open_output(name: str, owner: int) -> int | None:
    """``name`` opened for reading when it is a regular file of fiberd's uid ``owner`` (or
    root), not reached through a final link; None otherwise (missing: an empty output
    removed, or never written)."""
    import stat

    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid not in (owner, 0):
        os.close(fd)
        return None
    return fd


def _still_running(socket: str | None, fiber_id: str) -> bool:
    with connected(socket) as client:
        try:
            return client.inspect_fiber(fiber_id).state in ("running", "stopping")
        except Refused:
            return False


def signal_number(word: str) -> int:
    """A signal from a number or a name ("TERM", "SIGTERM", "term"); raises Exit(2)."""
    import signal

    if word.isdigit():
        number = int(word)
        if number in {int(s) for s in signal.Signals}:
            return number
    else:
        name = word.upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name in signal.Signals.__members__:
            return int(signal.Signals[name])
    raise fail(EXIT_USAGE, f"fiberctl: {word!r} is not a signal (a number, or a name: "
               "TERM, SIGINT, ...)")


def kill(args: argparse.Namespace) -> None:
    """Send fiber ID a signal (default SIGTERM), as kill(1) does: exit 0 when it was
    delivered, 1 when the fiber had already exited. ``stop`` waits for it to go."""
    import signal

    signum = signal_number(args.signal)
    name = signal.Signals(signum).name
    with connected(args.socket) as client:
        delivered = client.signal_fiber(args.fiber_id, signum).delivered
    if args.json:
        print(json_dumps({"fiber": args.fiber_id, "signal": name, "delivered": delivered}))
    elif delivered:
        print(f"sent {name} to {args.fiber_id}")
    if not delivered:
        raise fail(EXIT_FIBER_FAILED,
                   f"fiberctl: fiber {args.fiber_id} has already exited; {name} not sent")


GRANT_COLUMNS = ("uid", "state", "fibers", "lease_end", "expired")


def grant_row(values: Sequence[object]) -> str:
    return "  ".join(f"{v!s:<{w}}" for v, w in zip(
        values, (24, 10, 6, 34, 7), strict=True)).rstrip()


def grants(args: argparse.Namespace) -> None:
    """List the grants fiberd holds: uid, template state, fibers, lease end, and what of
    each grant's limits is enforced (NOT enforced ones named)."""
    with connected(args.socket) as client:
        listed = client.list_grants().grants
    if args.json:
        print(json_dumps(listed))
        return
    print(grant_row([c.upper() for c in GRANT_COLUMNS]))
    for record in listed:
        template = record.get("template")
        state = template.get("state") if isinstance(template, dict) else record.get("state")
        end = record.get("lease_end")
        print(grant_row([record.get("uid", "-"), state or "-", record.get("fibers", "-"),
                         when(end) if isinstance(end, int | float) else "-",
                         record.get("expired", "-")]))
        enforcement = record.get("enforcement")
        if isinstance(enforcement, dict):
            print(f"  enforcement: {describe_enforcement(enforcement)}")


def metrics(args: argparse.Namespace) -> None:
    """Print fiberd's metrics in the Prometheus text format (``--json``: the reply, with its
    content type)."""
    with connected(args.socket) as client:
        reply = client.metrics()
    if args.json:
        print(json_dumps(reply.to_json()))
    else:
        sys.stdout.write(reply.text)


def status(args: argparse.Namespace) -> None:
    """Show fiberd's status, health and readiness."""
    with connected(args.socket) as client:
        report = {"status": client.status().data, "health": client.health().data,
                  "ready": client.ready().ready}
    if args.json:
        print(json_dumps(report))
        return
    print(f"ready: {report['ready']}")
    for section in ("status", "health"):
        for key, value in report[section].items():  # type: ignore[attr-defined]
            if section == "status" and key == "enforcement" and isinstance(value, dict):
                for line in enforcement_lines(value):
                    print(f"status.enforcement.{line}")
                continue
            if section == "status" and key == "cgroups" and isinstance(value, dict):
                # which backend, and where stop, emptiness, limits and devices live
                print(f"status.cgroups.enforced: {value.get('enforced')}")
            print(f"{section}.{key}: {json_dumps(value)}")


def enforcement_lines(enforcement: dict[str, object]) -> list[str]:
    """``status``'s enforcement section, one line each: strict_limits, what this host
    enforces for a grant asking every limit, and each grant's record."""
    lines = [f"strict_limits: {json_dumps(enforcement.get('strict_limits'))}"]
    host = enforcement.get("host")
    if isinstance(host, dict):
        lines.append(f"host: {describe_enforcement(host)}")
    grants = enforcement.get("grants")
    for uid, record in (grants.items() if isinstance(grants, dict) else []):
        if isinstance(record, dict):
            lines.append(f"grants.{uid}: {describe_enforcement(record)}")
    return lines


def describe_enforcement(record: dict[str, object]) -> str:
    """An enforcement record for people: each limit asked for (every limit, in the host's
    record) with what enforces it or "NOT enforced (why)", then how devices are confined."""
    parts = []
    limits = record.get("limits")
    for name, entry in (limits.items() if isinstance(limits, dict) else []):
        if not isinstance(entry, dict) or ("asked" in entry and entry["asked"] is None):
            continue
        by = entry.get("enforced_by")
        parts.append(f"{name} by {by}" if by else
                     f"{name} NOT enforced ({entry.get('not_enforced')})")
    devices = record.get("devices")
    confined = devices.get("confined_by") if isinstance(devices, dict) else None
    return "; ".join([*(parts or ["no limits asked"]), f"devices: {confined}"])


def wait(args: argparse.Namespace) -> None:
    """Wait until fiberd answers and a template (--grant's, if given) is ready: exit 0;
    after --timeout S, 69 when fiberd never answered, else 75."""
    from slurm_fiber.client.tasks import NotReady, wait_ready

    try:
        status = wait_ready(discover_socket(args.socket), args.timeout, grant=args.grant)
    except NotReady as e:
        if args.json:
            print(json_dumps({"ready": False, "reachable": e.reachable, "reason": str(e)}))
        raise fail(EXIT_RETRYABLE_MISS if e.reachable else EXIT_UNREACHABLE,
                   f"fiberctl: {e}") from None
    if args.json:
        print(json_dumps({"ready": True, "status": status}))


# run's and call's options: flags, dest, kind (value, append, flag), metavar, help.
# Both argparse (build_parser) and quick_parse read them.
RUN_OPTIONS: tuple[tuple[tuple[str, ...], str, str, str | None, str], ...] = (
    (("-S", "--socket"), "socket", "value", "PATH", SOCKET_HELP),
    (("-g", "--grant"), "grant", "value", None,
     "admitted grant UID to run under (default: the only one)"),
    (("-t", "--token"), "token", "value", "FILE", "file holding a grant token (JWS)"),
    (("-e", "--env"), "env", "append", "KEY=VALUE",
     "added to the fiber's env (repeatable; device visibility variables are the grant's)"),
    (("-q", "--quiet"), "quiet", "flag", None,
     "do not say why the fiber ended (the status is the same)"),
    (("--wait",), "wait", "value", "S",
     f"wait through retryable misses (cold, capacity; in a Slurm job, or given, a fiberd "
     f"not listening yet) up to S seconds (default {DEFAULT_WAIT:g}), saying once on "
     "stderr what for; a final miss exits at once"),
    (("--no-wait",), "no_wait", "flag", None,
     "exit at once on a retryable miss (75) or an unreachable fiberd (69)"),
    (("--json",), "json", "flag", None,
     "run: after the fiber's output, its exit event as one JSON line; call: the exit "
     "event (result or error) instead of the bare result"),
)


def _run_options(parser: argparse.ArgumentParser) -> None:
    for flags, dest, kind, metavar, text in RUN_OPTIONS:
        if kind == "flag":
            parser.add_argument(*flags, dest=dest, action="store_true", help=text)
        elif kind == "append":
            parser.add_argument(*flags, dest=dest, action="append", default=[],
                                metavar=metavar, help=text)
        else:
            parser.add_argument(*flags, dest=dest, metavar=metavar, help=text)


def quick_parse(words: Sequence[str]) -> SimpleNamespace | None:
    """``run`` or ``call`` parsed without argparse (whose import and parser building cost a
    fiberctl started per task more than its request does), when its words are plain: the
    RUN_OPTIONS, as separate words or ``--long=value``, and the positionals (``run``:
    everything after ``--`` as is). None for anything else (help, a mistake, another
    command): ``parse`` then parses and says what is wrong, as before."""
    if words[:1] not in (["run"], ["call"]):
        return None
    by_flag = {flag: (dest, kind) for flags, dest, kind, _, _ in RUN_OPTIONS for flag in flags}
    values: dict[str, object] = {"socket": None, "grant": None, "token": None, "env": [],
                                 "quiet": False, "wait": None, "no_wait": False,
                                 "json": False}
    positionals: list[str] = []
    rest = list(words[1:])
    closed = False  # an option came after the positionals: argparse takes no more of them
    while rest:
        word = rest.pop(0)
        if word == "--" and words[0] == "run":
            positionals += rest
            break
        if not word.startswith("-") or word == "-":
            if closed:
                return None
            positionals.append(word)
            continue
        closed = bool(positionals)
        name, eq, value = word.partition("=")
        if name not in by_flag:
            return None
        dest, kind = by_flag[name]
        if kind == "flag":
            if eq:
                return None
            values[dest] = True
            continue
        if not eq:
            if not rest or rest[0].startswith("-"):
                return None
            value = rest.pop(0)
        if kind == "append":
            values[dest] = [*values[dest], value]  # type: ignore[misc]
        else:
            values[dest] = value
    if words[0] == "run":
        return SimpleNamespace(command="run", handler=run, cmd=positionals, **values)
    if not 1 <= len(positionals) <= 2:
        return None
    return SimpleNamespace(command="call", handler=call, target=positionals[0],
                           json_args=positionals[1] if len(positionals) > 1 else None, **values)


def help_formatter(prog: str) -> argparse.HelpFormatter:
    """argparse's RawDescriptionHelpFormatter at the width shutil.get_terminal_size gives
    (COLUMNS, else standard output's terminal, else 80), found without shutil: argparse
    imports it (with bz2 and lzma) each time it makes a formatter without a width, which
    every parser does as its arguments are added."""
    import argparse

    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return argparse.RawDescriptionHelpFormatter(prog, width=(columns or 80) - 2)


def build_parser() -> argparse.ArgumentParser:
    """fiberctl's command line (argparse, imported only here: run and call, started per
    task, are parsed by quick_parse when they can be)."""
    import argparse

    parser = argparse.ArgumentParser(prog="fiberctl", description=__doc__,
                                     formatter_class=help_formatter)
    from slurm_fiber.version import version_line

    parser.add_argument("--version", action="version", version=version_line("fiberctl"),
                        help="print the version and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    handlers: list[tuple[str, Callable[[argparse.Namespace], None], str]] = [
        ("run", run, "run CMD as a fiber, here (fiberctl run [OPTIONS] -- CMD ...)"),
        ("call", call, "call MODULE:FUNC in the warm interpreter, print its JSON result"),
        ("ls", list_fibers, "list the fibers fiberd tracks"),
        ("inspect", inspect_fiber, "one fiber's record (fiberctl inspect ID)"),
        ("stop", stop, "stop a fiber (SIGTERM, grace, SIGKILL)"),
        ("kill", kill, "send a fiber a signal (fiberctl kill ID [-s SIG])"),
        ("grants", grants, "list the grants fiberd holds, with what is enforced"),
        ("status", status, "fiberd's status, health and readiness"),
        ("metrics", metrics, "fiberd's metrics, Prometheus text format"),
        ("wait", wait, "wait until fiberd is ready (fiberctl wait [--timeout S])"),
        ("logs", logs, "a fiber's output (fiberctl logs ID [--follow])"),
    ]
    # Listed for --help only: main() hands "map" to slurm_fiber.client.fibermap, which has its
    # own parser and is imported only when map runs.
    commands.add_parser("map", add_help=False, formatter_class=help_formatter,
                        help="one fiber per argument, as GNU parallel "
                        "(fiberctl map [OPTIONS] -- CMD {}; fiberctl map --help)")
    for name, handler, summary in handlers:
        sub = commands.add_parser(name, help=summary, description=handler.__doc__,
                                  epilog=EXIT_EPILOG, formatter_class=help_formatter)
        sub.set_defaults(handler=handler)
        if name in ("run", "call"):
            _run_options(sub)
        else:
            sub.add_argument("-S", "--socket", metavar="PATH", help=SOCKET_HELP)
        if name in ("ls", "inspect", "stop", "kill", "grants", "status", "metrics", "wait",
                    "logs"):
            sub.add_argument("--json", action="store_true", help="print JSON for machines")
        if name == "ls":
            sub.add_argument("-a", "--all", action="store_true",
                             help="with the ended fibers fiberd still remembers")
        if name == "run":
            sub.add_argument("cmd", nargs="*", metavar="CMD", help="the command and its args")
        elif name == "call":
            sub.add_argument("target", metavar="MODULE:FUNC")
            sub.add_argument("json_args", nargs="?", metavar="JSON_ARGS",
                             help="a JSON array (positional) or object (keyword)")
        elif name == "inspect":
            sub.add_argument("fiber_id", metavar="ID")
        elif name == "logs":
            sub.add_argument("fiber_id", metavar="ID")
            sub.add_argument("-f", "--follow", action="store_true",
                             help="go on printing as it comes, until the fiber has ended")
        elif name == "kill":
            sub.add_argument("fiber_id", metavar="ID")
            sub.add_argument("-s", "--signal", default="TERM", metavar="SIG",
                             help="a signal number or name (default: TERM)")
        elif name == "stop":
            sub.add_argument("fiber_id", metavar="ID")
            sub.add_argument("--grace", type=float, help="seconds between SIGTERM and SIGKILL")
        elif name == "wait":
            sub.add_argument("--timeout", type=float, metavar="S",
                             help="give up after S seconds (default: wait forever)")
            sub.add_argument("-g", "--grant", help="wait for this grant's template")
    return parser


GLOBAL_VALUED = ("-S", "--socket", "-g", "--grant")
GLOBAL_FLAGS = ("--json", "-q", "--quiet")


def hoist(argv: Sequence[str]) -> list[str]:
    """``argv`` with the global options given before the command moved after it, so
    ``fiberctl --socket PATH status`` means ``fiberctl status --socket PATH``. A value
    missing after one is left for argparse to name."""
    words = list(argv)
    front: list[str] = []
    while words and words[0].startswith("-"):
        word = words[0]
        name = word.split("=", 1)[0]
        if name in GLOBAL_FLAGS or (name in GLOBAL_VALUED and "=" in word):
            front.append(words.pop(0))
        elif word in GLOBAL_VALUED:
            front.extend(words[:2])
            del words[:2]
        elif word in ("-h", "--help"):
            return [word]
        else:
            return words  # not a global option: argparse names it
    if not words:
        return front
    return [words[0], *front, *words[1:]]


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv`` (global options before the command hoisted after it); for ``run``,
    everything after the first ``--`` is the command as is."""
    words = hoist(argv)
    tail: list[str] | None = None
    if words[:1] == ["run"] and "--" in words:
        cut = words.index("--")
        words, tail = words[:cut], words[cut + 1:]
    args = build_parser().parse_args(words)
    if tail is not None:
        args.cmd = [*args.cmd, *tail]
    return args


PER_TASK = ("run", "call")  # the commands a job starts once per task


def main(argv: Sequence[str] | None = None, *, teardown: bool = True) -> None:
    """Run fiberctl with ``argv`` (default: this process's arguments); exits with the
    documented code. With ``teardown`` False, ``run`` and ``call`` leave without the
    interpreter's teardown (``leave``): the console script's way, never a caller's."""
    words = hoist(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["map"]:
        from slurm_fiber.client.fibermap import main as map_main

        sys.exit(map_main(words[1:]))
    args = quick_parse(words) or parse(words)
    try:
        args.handler(args)
        code = EXIT_OK
    except Exit as done:
        code = done.code
    if not teardown and args.command in PER_TASK:
        leave(code)
    sys.exit(code)


def leave(code: int) -> NoReturn:
    """Exit with ``code`` at once, without the interpreter's teardown (which frees every
    module fiberctl imported; docs/benchmarks.md has its cost). Their only buffered output
    is stdout's and stderr's (no thread, file or atexit handler of theirs is left), so both
    are flushed first; when that fails (a closed pipe), the ordinary exit happens instead
    and reports it as it always does."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        sys.exit(code)
    os._exit(code)


def command() -> None:
    """The ``fiberctl`` console script."""
    main(teardown=False)
