"""One task, one fiber: the client side shared by ``slurm_fiber.Executor`` and ``fiberctl map``.

``TaskRunner.run(task)`` turns one task into one Clone on the calling
thread's own connection to fiberd (kept open between tasks), waits for the
fiber's exit with the task's own deadline (past it, the fiber is stopped:
SIGTERM, ``stop_grace``, SIGKILL, and the outcome says it timed out), and
retries a retryable miss (cold, capacity, source_stale, ...) with a bounded
backoff (at most ``retries`` more tries, delays doubling from ``backoff`` up
to ``backoff_cap``, never shorter than the miss's ``retry_after``). It never
raises for what a task does; every end is an ``Outcome``.

Waiting like srun: with ``wait`` (seconds), a ``cold`` or ``capacity`` miss is retried for
as long as that from the task's first miss, however many tries that takes,
and, with ``wait_listening`` (a Slurm job: its fiberd may not listen yet), a
socket nobody listens on (missing, or refused) is tried again for as long
from the first failure; ``say`` is called once, with what the runner waits
for. A final miss, a refusal or a broken stream ends the task at once.

``TaskRunner.run_many(tasks)`` starts several tasks with one batch clone
(``clone_batch``, protocol v3: the grant resolved, a token verified and the
request paid once; each fiber still its own) on the same connection, takes
each fiber's exit as it comes (``done`` is called per task as it ends), and
retries the items that missed retryably as a smaller batch after the same
backoff. These are the only places where a task becomes a Clone.

With ``window`` W, ``run_many`` keeps at most W of its tasks running: each
batch of up to MAX_BATCH is sent with a window (protocol v5) and fiberd
starts the next task as one ends, with no round trip in between. ``cancel_pending``
(any thread) has every windowed batch start nothing more: the tasks not
started end as ``cancelled``; ``stop_all`` also stops the running ones.

Both take a ``result`` callback: given it, a call task's result (or
error) is passed to it as soon as the fiber has written it, before the
fiber's exit is in (the clone's ``early`` events, protocol v4); ``done`` still
comes at the end.

Every released fiberd speaks protocol v5 (0.1.0 on), so nothing here falls back
to an older one: a fiberd that refuses a version (``unsupported_version``) fails
the tasks with that refusal, as any other.

With ``server_uids`` (the Executor's: its own uid and root), every connection
is checked before anything is sent or read on it: the server's uid, from
SO_PEERCRED (the uid that made the listening socket), must be one of them,
else the task fails with ``UntrustedServer`` (an ``Unreachable``) naming it.
The Executor unpickles what a fiber sends back; a socket of another user (a
wrong ``$FIBERD_SOCKET``, a name planted where a job looks) would otherwise
run that user's pickle as the caller.

``caller_path()`` is what a call carries of its caller's import path
(``call.path``): the fiber puts it first on its ``sys.path`` (the entries safe
there), so a function importable here is importable there.

``wait_ready`` blocks until fiberd answers and says it is ready (``fiberctl
wait``, ``Executor.wait_ready``). Nothing here starts a thread; each
method says whether it blocks. Import cost is the client's only.
"""

from __future__ import annotations

import contextlib
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from slurm_fiber.client.connection import FiberdClient, Missed, Refused, Unreachable
from slurm_fiber.client.waits import DEFAULT_WAIT as DEFAULT_WAIT
from slurm_fiber.client.waits import WAITED
from slurm_fiber.protocol.limits import (
    EARLY_SINCE,
    MAX_BATCH,
    MAX_CALL_PATH,
    PICKLED_SINCE,
)
from slurm_fiber.protocol.replies import BatchStarted, Cancelled

CANCEL_POLL = 0.05  # seconds between two looks at cancel_pending while a window has tasks
# not started (the thread that reads the stream sends the cancel on it)
CANCEL_SETTLE = 5.0  # stop_all waits at most this long for each window's cancel
Early = Callable[[int, dict[str, object]], None]  # (task index, its result event)
Opener = Callable[[float | None], FiberdClient]  # a connection made otherwise (timeout)
PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (fiberctl map's start)
if TYPE_CHECKING:
    from collections.abc import Collection
    from typing import TypeVar

    V = TypeVar("V")




def in_job(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this runs in a Slurm job (whose fiberd may not listen yet)."""
    return bool((os.environ if environ is None else environ).get("SLURM_JOB_ID"))


def caller_path(entries: Sequence[str] | None = None) -> list[str]:
    """The import path a call carries: ``entries`` (default ``sys.path``) without the
    interpreter's own (below its prefixes: the standard library, site-packages), each
    made absolute ("" is the working directory), in order, no repeats, at most
    MAX_CALL_PATH."""
    import sys

    own = tuple({os.path.join(p, "lib") + os.sep for p in (
        sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)})
    out: list[str] = []
    for entry in sys.path if entries is None else entries:
        path = os.path.abspath(entry or os.curdir)
        if not (path + os.sep).startswith(own) and path not in out:
            out.append(path)
    return out[:MAX_CALL_PATH]


class UntrustedServer(Unreachable):
    """The server at the socket runs as a uid the caller does not trust (SO_PEERCRED)."""


def server_uid(client: FiberdClient) -> int:
    """The uid of the process that made the socket ``client`` is connected to."""
    import _socket

    _pid, uid, _gid = PEERCRED.unpack(client.sock.getsockopt(
        _socket.SOL_SOCKET, _socket.SO_PEERCRED, PEERCRED.size))
    return uid


def connect(socket: str, server_uids: Collection[int] | None,
            timeout: float | None = 30.0, opener: Opener | None = None) -> FiberdClient:
    """A client of ``socket``; with ``server_uids``, only when the server runs as one of
    them (else the connection is closed, nothing sent or read, and UntrustedServer raised).
    With ``opener`` (another node's fiberd over Slurm: slurm_fiber/client/nodes/link.py), the
    connection is its, the server's uid checked where that fiberd runs. Raises
    Unreachable."""
    if opener is not None:
        return opener(timeout)
    client = FiberdClient(socket, timeout=timeout)
    if server_uids is None:
        return client
    try:
        uid = server_uid(client)
    except OSError as err:
        client.close()
        raise Unreachable(f"cannot tell who serves {socket}: {err.strerror or err}") from err
    if uid not in server_uids:
        client.close()
        trusted = " or ".join(str(u) for u in sorted(server_uids))
        raise UntrustedServer(
            f"the server at {socket} runs as uid {uid}, not uid {trusted}: nothing it sends "
            "is unpickled (a fiberd of another uid: give Executor(server_uids=...))")
    return client


class Task:
    """What one fiber runs: the clone's ``call`` or ``exec`` field (exactly one), the
    descriptors to pass (``stdin``/``stdout``/``stderr`` → fd, owned by the caller) and
    a per-task timeout in seconds (None: none). Immutable, compared and hashed by value.

    A plain class, not a dataclass: fiberctl imports it, and its import budget
    (tests/cli/test_fiberctl.py) leaves dataclasses out."""

    call: Mapping[str, object] | None
    exec: Mapping[str, object] | None
    stdio: Mapping[str, int]
    timeout: float | None

    def __init__(self, call: Mapping[str, object] | None = None,
                 exec: Mapping[str, object] | None = None,
                 stdio: Mapping[str, int] | None = None, timeout: float | None = None) -> None:
        for name, value in (("call", call), ("exec", exec),
                            ("stdio", {} if stdio is None else stdio), ("timeout", timeout)):
            object.__setattr__(self, name, value)

    def _values(self) -> tuple[object, ...]:
        return self.call, self.exec, self.stdio, self.timeout

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"cannot assign to field {name!r} of a frozen Task")

    def __eq__(self, other: object) -> bool:
        return other._values() == self._values() if type(other) is Task else NotImplemented

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return (f"Task(call={self.call!r}, exec={self.exec!r}, stdio={self.stdio!r}, "
                f"timeout={self.timeout!r})")


class Outcome:
    """How one task ended. Exactly one of: ``exit`` (the exit event: status, exit_code,
    signal, result or error), ``miss`` (the last miss, retries spent or final),
    ``failure`` (fiberd refused, ``refused`` true, or could not be reached: one line),
    or ``cancelled`` (a windowed batch's task that never started: ``cancel_pending``).
    ``timed_out``: the
    runner stopped the fiber at the task's timeout (``exit`` then tells how it died).
    ``started`` is the wall time the task's fiber started (its last try's; fiberd's
    record of the fork, taken to wall time here), ``runtime`` the seconds from there to
    its end as seen here (the exit event's arrival): the task's own run, as GNU
    parallel's joblog counts it, however long it waited in a batch or window. A task
    that never started counts from its first request. ``start_mono``: that start on
    CLOCK_BOOTTIME (fiberd's clock), None while no fiber started. Compared by value.
    A plain class, as Task is."""

    FIELDS = ("exit", "miss", "failure", "refused", "cancelled", "timed_out", "fiber_id",
              "attempts", "started", "runtime", "start_mono")
    __hash__ = None  # type: ignore[assignment]  # mutable

    def __init__(self, exit: dict[str, object] | None = None, miss: Missed | None = None,
                 failure: str | None = None, refused: bool = False, cancelled: bool = False,
                 timed_out: bool = False, fiber_id: str | None = None, attempts: int = 0,
                 started: float = 0.0, runtime: float = 0.0,
                 start_mono: float | None = None) -> None:
        self.exit, self.miss, self.failure, self.refused = exit, miss, failure, refused
        self.cancelled, self.timed_out, self.fiber_id = cancelled, timed_out, fiber_id
        self.attempts, self.started, self.runtime = attempts, started, runtime
        self.start_mono = start_mono

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self.FIELDS)

    def __eq__(self, other: object) -> bool:
        return other._values() == self._values() if type(other) is Outcome else NotImplemented

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.FIELDS)
        return f"Outcome({shown})"

    @property
    def status(self) -> int | None:
        """The shell's view of the fiber's end (exit code or 128+signal), None if none ran."""
        status = self.exit.get("status") if self.exit else None
        return status if isinstance(status, int) else None

    @property
    def ok(self) -> bool:
        """The fiber ran and ended with status 0 and no error, in time."""
        return (self.status == 0 and not self.timed_out and self.exit is not None
                and self.exit.get("error") is None)


class TaskRunner:
    """Runs tasks as fibers of one fiberd (``socket``), under ``grant`` or ``token`` (or
    the only grant held) with ``env`` added. Thread-safe: each thread gets its own
    connection. ``stop_all`` stops every fiber it is running now (from any thread)."""

    def __init__(self, socket: str | os.PathLike[str], *, grant: str | None = None,
                 token: str | None = None, env: Mapping[str, str] | None = None,
                 retries: int = 5, backoff: float = 0.05, backoff_cap: float = 2.0,
                 stop_grace: float = 1.0,
                 sleep: Callable[[float], None] = time.sleep,
                 server_uids: Collection[int] | None = None, wait: float | None = None,
                 wait_listening: bool = False,
                 say: Callable[[str], None] | None = None,
                 opener: Opener | None = None) -> None:
        self.socket = os.fspath(socket)
        self.opener = opener  # connections made by it (``socket`` names them in messages)
        self.server_uids = frozenset(server_uids) if server_uids is not None else None
        self.wait, self.wait_listening, self.say = wait, wait_listening, say
        self._said = False
        self._unheard: float | None = None  # when connecting first failed (wait_listening)
        self.base: dict[str, object] = {}
        if grant is not None:
            self.base["grant"] = grant
        if token is not None:
            self.base["token"] = token
        if env:
            self.base["env"] = dict(env)
        self.retries, self.backoff, self.backoff_cap = retries, backoff, backoff_cap
        self.stop_grace = stop_grace
        self.sleep = sleep
        self._local = threading.local()
        self._lock = threading.Lock()
        self._running: set[str] = set()
        self._clients: list[FiberdClient] = []
        self._windows: set[_Batch] = set()  # windowed batches with tasks not started
        self.cancelling = False  # cancel_pending: windowed batches start nothing more
        self.stopping = False  # stop_all: fibers that start from now on are stopped too

    # ------------------------------------------------------------ public

    def run(self, task: Task,
            result: Callable[[dict[str, object]], None] | None = None) -> Outcome:
        """Run ``task`` in one fiber and wait for its end (blocks; never raises for what
        the task or fiberd does). A retryable miss is retried; a final one is returned.
        ``result`` gets a call's result event before the end (module doc)."""
        outcome = Outcome(started=time.time())
        begun = time.monotonic()
        fields = {**self.base, **_what(task)}
        if task.call is not None and "pickled" in task.call:
            fields["v"] = PICKLED_SINCE
        delay = self.backoff
        first_miss: float | None = None
        while True:
            outcome.attempts += 1
            asked = task.call is not None and result is not None
            try:
                self._run_once(self._early(fields) if asked else fields, task, outcome,
                               (lambda _, event: result(event)) if result else None)
                break
            except Missed as miss:
                first_miss = time.monotonic() if first_miss is None else first_miss
                if not miss.retryable or not self._again(first_miss, outcome.attempts, miss):
                    outcome.miss = miss
                    break
                self.sleep(min(self.backoff_cap, max(delay, _retry_after(miss))))
                delay = min(self.backoff_cap, delay * 2)
            except (Refused, Unreachable) as err:
                self._drop_client()
                outcome.failure, outcome.refused = str(err), isinstance(err, Refused)
                break
        _ran(outcome, begun)
        return outcome

    def run_many(self, tasks: Sequence[Task],
                 done: Callable[[int, Outcome], None] | None = None,
                 result: Early | None = None, window: int | None = None) -> list[Outcome]:
        """Run ``tasks``, started by batch clones of at most MAX_BATCH on this thread's
        connection, and wait for every end (blocks; never raises for what a task or fiberd
        does). ``done(i, outcome)`` is called as task i ends (on this thread);
        ``result(i, event)`` as a call task's result comes, before (module doc).
        With ``window``, at most that many run at once (module doc). Retryable misses are
        retried together, as ``run`` retries one."""
        if len(tasks) > MAX_BATCH:
            return self._in_slices(tasks, MAX_BATCH, done, result, window)
        window = window if window is not None and window < len(tasks) else None
        outcomes = [Outcome(started=time.time()) for _ in tasks]
        begun = time.monotonic()
        pending, delay = list(range(len(tasks))), self.backoff
        first_miss: dict[int, float] = {}
        while pending and (len(tasks) > 1 or window is not None):
            if self.cancelling:
                for i in pending:
                    outcomes[i].cancelled = True
                    self._end(i, outcomes[i], begun, done)
                return outcomes
            for i in pending:
                outcomes[i].attempts += 1
                outcomes[i].miss = None
            asked = result is not None and any(tasks[i].call is not None for i in pending)
            try:
                retry = self._batch_once(tasks, pending, outcomes, begun, done,
                                         result if asked else None, window)
            except Refused as err:
                self._fail(pending, outcomes, err, begun, done)
                return outcomes
            except Unreachable as err:
                self._fail(pending, outcomes, err, begun, done)
                return outcomes
            for i in retry:
                first_miss.setdefault(i, time.monotonic())
            pending = [i for i in retry
                       if self._again(first_miss[i], outcomes[i].attempts, outcomes[i].miss)]
            for i in set(retry) - set(pending):
                self._end(i, outcomes[i], begun, done)
            window = window if window is not None and window < len(pending) else None
            if pending:
                wanted = max(_retry_after(outcomes[i].miss) for i in pending)
                self.sleep(min(self.backoff_cap, max(delay, wanted)))
                delay = min(self.backoff_cap, delay * 2)
        for i in pending:  # one task: one Clone
            outcomes[i] = self.run(tasks[i], partial(result, i) if result else None)
            if done is not None:
                done(i, outcomes[i])
        return outcomes

    def cancel_pending(self) -> None:
        """Have every windowed batch of this runner start nothing more, from any thread
        (each is cancelled by the thread reading it within CANCEL_POLL): the tasks it had
        not started end ``cancelled``; those running go on. Later ``run_many`` calls start
        nothing either."""
        self.cancelling = True

    def _in_slices(self, tasks: Sequence[Task], size: int,
                   done: Callable[[int, Outcome], None] | None, result: Early | None,
                   window: int | None) -> list[Outcome]:
        """``run_many`` over consecutive slices of ``size`` tasks, one after another."""
        out: list[Outcome] = []
        for at in range(0, len(tasks), size):
            out += self.run_many(tasks[at:at + size], _shifted(done, at),
                                 _shifted(result, at), window)
        return out

    def stop(self, fiber_id: str) -> None:
        """Stop one fiber (SIGTERM, ``stop_grace``, SIGKILL) on a connection of its own;
        blocks until it is gone. A fiber already gone is not an error."""
        with contextlib.suppress(Refused, Unreachable), \
                connect(self.socket, self.server_uids, self.stop_grace + 30,
                        self.opener) as client:
            client.stop_fiber(fiber_id, self.stop_grace)

    def stop_all(self) -> int:
        """Stop every fiber this runner is waiting for now, and any a windowed batch starts
        before its cancel (``cancel_pending``) arrives; how many were asked to stop."""
        self.stopping = True
        self.cancel_pending()
        with self._lock:
            windows = [b for b in self._windows if b.reader is not threading.current_thread()]
        for batch in windows:  # a fiber that ends now must not make room for another
            batch.settled.wait(CANCEL_SETTLE)  # (this thread's cancels at its next event)
        with self._lock:
            running = list(self._running)
        for fiber_id in running:
            self.stop(fiber_id)
        return len(running)

    def close(self) -> None:
        """Close every connection the runner opened (call once no thread runs a task)."""
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()

    # ------------------------------------------------------------ internals

    def _client(self) -> FiberdClient:
        """This thread's connection; a new one when fiberd has closed the old (it closes
        idle connections, 300 s by default): an idle connection with anything to read has
        been closed by fiberd, which never reads a request sent on it afterwards."""
        client = getattr(self._local, "client", None)
        if client is not None and select.select([client.sock], [], [], 0)[0]:
            self._drop_client()
            client = None
        if client is None:
            client = self._connect()
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        return client

    def _connect(self) -> FiberdClient:
        """A new connection; with ``wait`` and ``wait_listening``, tried again (every 0.2 s)
        while nobody listens on the socket, for ``wait`` seconds from the first failure.
        Raises Unreachable."""
        while True:
            try:
                client = connect(self.socket, self.server_uids, opener=self.opener)
            except UntrustedServer:
                raise
            except Unreachable as err:
                if self.wait is None or not self.wait_listening or not isinstance(
                        err.__cause__, FileNotFoundError | ConnectionRefusedError):
                    raise
                now = time.monotonic()
                with self._lock:
                    self._unheard = now if self._unheard is None else self._unheard
                    since = self._unheard
                if now - since >= self.wait:
                    raise Unreachable(f"{err} (waited {self.wait:g} s)") from err
                self._tell(f"fiberd to listen at {self.socket}")
                self.sleep(min(0.2, since + self.wait - now))
                continue
            with self._lock:
                self._unheard = None
            return client

    def _again(self, first_miss: float, attempts: int, miss: Missed | None) -> bool:
        """Whether a task that missed retryably (first at ``first_miss``, ``attempts``
        tries so far) is tried again: within ``retries`` tries, or (``wait``) within
        ``wait`` seconds of its first miss."""
        if self.wait is None or miss is None or miss.code not in WAITED:
            return attempts <= self.retries
        if time.monotonic() - first_miss >= self.wait:
            return False
        if miss is not None:
            self._tell(f"{miss.code}: {miss.reason}")
        return True

    def _tell(self, what: str) -> None:
        """Say, once per runner, what it waits for."""
        with self._lock:
            said, self._said = self._said, True
        if not said and self.say is not None:
            self.say(f"waiting up to {self.wait:g} s for {what}")

    def _drop_client(self) -> None:
        client = getattr(self._local, "client", None)
        self._local.client = None
        if client is not None:
            client.close()
            with self._lock:
                if client in self._clients:
                    self._clients.remove(client)

    def _batch_once(self, tasks: Sequence[Task], pending: list[int], outcomes: list[Outcome],
                    begun: float, done: Callable[[int, Outcome], None] | None,
                    result: Early | None, window: int | None = None) -> list[int]:
        """One batch clone of ``pending`` (asking for early results when ``result`` is
        given; with ``window``, a windowed one) and the wait for its fibers; the tasks that
        missed retryably (their ``miss`` set, not ended). Raises Refused, Unreachable for
        the request as a whole."""
        client = self._client()
        fields = self.base if result is None else self._early(self.base)
        started = client.clone_batch(
            [{"key": str(i), **_what(tasks[i])} for i in pending],
            stdio=[tasks[i].stdio for i in pending], wait=True, hangup=True, window=window,
            **fields)
        batch = _Batch(tasks, outcomes, begun, done, result,
                       set(pending) if window is not None else set())
        with self._lock:
            self._windows.add(batch)
        try:
            self._answered(batch, started.items)
            self._wait_all(client, batch)
        finally:
            with self._lock:
                self._windows.discard(batch)
            batch.settled.set()
        return batch.retry

    def _answered(self, batch: _Batch, entries: list[dict[str, object]]) -> None:
        """Take a ``started`` event's entries: a fiber is waited for (and stopped at once
        after ``stop_all``), a retryable miss goes to ``batch.retry``, anything else ends
        its task."""
        for entry in entries:
            i = int(str(entry.get("key")))
            batch.unanswered.discard(i)
            if not batch.unanswered:
                batch.settled.set()
            outcome = batch.outcomes[i]
            fiber, miss, error = entry.get("fiber"), entry.get("miss"), entry.get("error")
            if isinstance(fiber, dict):
                batch.watch(str(fiber.get("id")), i, fiber.get("started"))
                with self._lock:
                    self._running.add(str(fiber.get("id")))
                if self.stopping:
                    self.stop(str(fiber.get("id")))
                continue
            if isinstance(miss, dict):
                outcome.miss = Missed(miss)
                if outcome.miss.retryable:
                    batch.retry.append(i)
                    continue
            elif isinstance(error, dict):
                outcome.failure, outcome.refused = str(Refused(error)), True
            self._end(i, outcome, batch.begun, batch.done)

    def _wait_all(self, client: FiberdClient, batch: _Batch) -> None:
        """Take each running fiber's exit event as it comes (and, of a windowed batch, the
        ``started`` events of its later tasks); stop those past their task's timeout (they
        then end as timed out); cancel a windowed batch's tasks not started once
        ``cancel_pending`` is called. Raises Unreachable (Refused: a cancel refused)."""
        try:
            while batch.running or batch.unanswered:
                poll = CANCEL_POLL if batch.unanswered and not batch.cancelled else None
                try:
                    if batch.unanswered and self.cancelling and not batch.cancelled:
                        batch.cancelled = True
                        self._cancelled(batch, client.cancel(within=30).keys)
                        continue
                    event, end = client.wait_event(within=batch.within(poll))
                except TimeoutError:
                    for fid in batch.overdue():
                        batch.outcomes[batch.running[fid]].timed_out = True
                        self.stop(fid)
                    continue
                if event == "started":
                    self._answered(batch, BatchStarted.from_json(end).items)
                    continue
                if event == "cancelled":  # came after ``cancel`` stopped waiting for it
                    self._cancelled(batch, Cancelled.from_json(end).keys)
                    continue
                fid = str(end.get("fiber_id"))
                if event == "result":
                    if batch.result is not None and fid in batch.running:
                        batch.result(batch.running[fid], end)
                    continue
                i = batch.ended(fid)
                with self._lock:
                    self._running.discard(fid)
                batch.outcomes[i].exit = end
                self._end(i, batch.outcomes[i], batch.begun, batch.done)
        finally:
            with self._lock:
                self._running.difference_update(batch.running)

    def _cancelled(self, batch: _Batch, keys: list[str]) -> None:
        """The tasks fiberd will not start (a ``cancelled`` event's keys) end so."""
        for key in keys:
            i = int(key)
            if i not in batch.unanswered:
                continue
            batch.unanswered.discard(i)
            batch.outcomes[i].cancelled = True
            self._end(i, batch.outcomes[i], batch.begun, batch.done)
        batch.settled.set()  # nothing more starts

    @staticmethod
    def _end(i: int, outcome: Outcome, begun: float,
             done: Callable[[int, Outcome], None] | None) -> None:
        _ran(outcome, begun)
        if done is not None:
            done(i, outcome)

    def _fail(self, pending: list[int], outcomes: list[Outcome], err: Exception, begun: float,
              done: Callable[[int, Outcome], None] | None) -> None:
        """The batch request failed as a whole: every task of it not ended yet fails so."""
        self._drop_client()
        for i in pending:
            o = outcomes[i]
            ended = o.exit is not None or o.failure is not None or (
                o.miss is not None and not o.miss.retryable)
            if not ended:
                o.miss, o.failure, o.refused = None, str(err), isinstance(err, Refused)
                self._end(i, o, begun, done)

    def _run_once(self, fields: dict[str, object], task: Task, outcome: Outcome,
                  result: Early | None) -> None:
        """One Clone and its wait. Raises Missed, Refused, Unreachable."""
        client = self._client()
        fiber = client.clone(stdio=task.stdio, wait=True, hangup=True, **fields)
        batch = _Batch([task], [outcome], time.monotonic(), None, result, set())
        batch.watch(fiber.id, 0, fiber.get("started"))
        with self._lock:
            self._running.add(fiber.id)
        if self.stopping:  # stop_all came while this clone was on its way
            self.stop(fiber.id)
        self._wait_all(client, batch)

    @staticmethod
    def _early(fields: dict[str, object]) -> dict[str, object]:
        """A copy of ``fields`` asking for early results (at protocol v4)."""
        return {**fields, "early": True, "v": EARLY_SINCE}  # v4 speaks every earlier v


class _Batch:
    """One batch's wait (or one Clone's): the tasks and their outcomes, the fibers running
    (id → task index) with their deadlines, the tasks fiberd has not answered yet (a
    windowed batch's not started) and the retryable misses to try again."""

    def __init__(self, tasks: Sequence[Task], outcomes: list[Outcome], begun: float,
                 done: Callable[[int, Outcome], None] | None, result: Early | None,
                 unanswered: set[int]) -> None:
        self.tasks, self.outcomes, self.begun = tasks, outcomes, begun
        self.done, self.result = done, result
        self.unanswered = unanswered
        self.running: dict[str, int] = {}
        self.due: dict[str, float] = {}
        self.retry: list[int] = []
        self.cancelled = False  # a cancel was sent
        self.reader = threading.current_thread()  # the thread that reads its events
        self.settled = threading.Event()  # nothing more will start: cancelled, all answered
        if not unanswered:
            self.settled.set()

    def watch(self, fiber_id: str, i: int, started: object = None) -> None:
        """Task i runs as ``fiber_id``, started at ``started`` (its record's, on fiberd's
        CLOCK_BOOTTIME; None: now): wait for it, until its timeout."""
        self.running[fiber_id] = i
        self.outcomes[i].fiber_id = fiber_id
        _started_at(self.outcomes[i], started)
        if (timeout := self.tasks[i].timeout) is not None:
            self.due[fiber_id] = time.monotonic() + timeout

    def ended(self, fiber_id: str) -> int:
        """The fiber's task, no longer waited for."""
        self.due.pop(fiber_id, None)
        return self.running.pop(fiber_id)

    def within(self, poll: float | None) -> float | None:
        """How long the next wait may last: to the first deadline, at most ``poll``."""
        if not self.due:
            return poll
        left = max(0.001, min(self.due.values()) - time.monotonic())
        return left if poll is None else min(left, poll)

    def overdue(self) -> list[str]:
        """The fibers past their deadline, each given once."""
        now = time.monotonic()
        late = [fid for fid, at in self.due.items() if at <= now]
        for fid in late:
            del self.due[fid]
        return late


def _boot() -> float:
    """Now on CLOCK_BOOTTIME, the clock of fiberd's records (core/clock.py)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _started_at(outcome: Outcome, started: object) -> None:
    """The task's fiber started at ``started`` (fiberd's record: CLOCK_BOOTTIME at its
    fork; this host's clock, as fiberd is this host's): its start, on both clocks."""
    now = _boot()
    at = float(started) if isinstance(started, int | float) and 0 < started <= now else now
    outcome.start_mono = at
    outcome.started = time.time() - (now - at)


def _ran(outcome: Outcome, begun: float) -> None:
    """Set ``runtime``: from the fiber's start (else from ``begun``, monotonic) to now."""
    if outcome.start_mono is not None:
        outcome.runtime = max(0.0, _boot() - outcome.start_mono)
    else:
        outcome.runtime = time.monotonic() - begun


def _what(task: Task) -> dict[str, object]:
    """The clone fields saying what ``task`` runs (its ``call`` or ``exec``)."""
    if task.call is not None:
        return {"call": dict(task.call)}
    return {"exec": dict(task.exec or {})}


def _shifted(done: Callable[[int, V], None] | None, by: int) -> Callable[[int, V], None] | None:
    """``done`` (or ``result``) for a slice of the tasks starting at ``by``."""
    if done is None:
        return None
    return lambda i, value: done(i + by, value)


def _retry_after(miss: Missed | None) -> float:
    """The seconds a retryable miss asks to wait (0 when it does not say)."""
    after = miss.miss.get("retry_after") if miss is not None else None
    return float(after) if isinstance(after, int | float) else 0.0


class NotReady(TimeoutError):
    """fiberd did not become ready in time; ``reachable`` says whether it answered."""

    def __init__(self, reason: str, reachable: bool) -> None:
        super().__init__(reason)
        self.reachable = reachable


def wait_ready(socket: str | os.PathLike[str], timeout: float | None, *,
               grant: str | None = None, poll: float = 0.05) -> dict[str, object]:
    """Block until fiberd at ``socket`` answers ``ready`` true (with ``grant``: until that
    grant's template is ready); its ``status``. Polls with a delay growing from ``poll``
    to 0.5 s. Raises NotReady when ``timeout`` seconds pass first (None: wait forever)."""
    end = None if timeout is None else time.monotonic() + timeout
    last = "fiberd is not reachable"
    reachable = False
    while True:
        try:
            with FiberdClient(socket, timeout=5.0) as client:
                reachable = True
                ready = client.ready().ready
                status = client.status().data
            templates = status.get("templates")
            state = templates.get(grant) if isinstance(templates, dict) and grant else None
            if ready and (grant is None or state == "ready"):
                return status
            last = (f"grant {grant!r}'s template is {state or 'not admitted'}" if ready
                    else "no template is ready yet")
        except (Unreachable, Refused) as err:
            last = str(err)
        if end is not None and time.monotonic() >= end:
            raise NotReady(f"fiberd not ready after {timeout:g} s: {last}", reachable)
        pause = poll if end is None else max(0.0, min(poll, end - time.monotonic()))
        time.sleep(pause)
        poll = min(0.5, poll * 1.5)
