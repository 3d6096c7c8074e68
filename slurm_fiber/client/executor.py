"""``slurm_fiber.Executor``: a ``concurrent.futures.Executor`` whose every call is a fresh fiber.

Each ``submit(fn, *args, **kwargs)`` runs ``fn`` in its own fiber, forked
from the grant's warm template by the fiberd of this job or host (found as
``fiberctl`` finds it: ``socket=``, ``$FIBERD_SOCKET``, the job's fiberd
inside a Slurm job, the standalone default). So every task gets a clean
process in its own cgroup, confined to the grant, with the template's
imports already done.

How a call travels (a pickled call, protocol v2, docs/socket-protocol.md):
with this process's import path (``tasks.caller_path``: its ``sys.path``
entries that are not the interpreter's own, such as the script's directory,
the working directory and ``PYTHONPATH``), which the fiber puts first on its
own ``sys.path`` (each entry that is safe there: a directory only its uid or
root can write, ``core/templates/dirtrust.py``; the others named on the fiber's stderr);
a function importable here (a module-level function of a module
other than ``__main__``) goes by reference, ``module:qualname``, with its
arguments pickled; any other function (defined in ``__main__``, a lambda, a
closure) travels by value with its arguments, pickled by cloudpickle. The
fiber unpickles, calls, and pickles the value back (fiberd itself only passes
the text on). The pickled call is bounded by the protocol (``MAX_PICKLED``
characters of base64, ~72 KiB of pickle), and a result by the reply (16 MiB,
~12 MiB of pickle): pass bigger data by file name.
fiberd accepts a pickled call only from peers its socket already allows (its
own uid and root, or the configured ``allowed_uids``/``allowed_gids``), who
can already run any ``module:function`` of the grant: pickle adds no power.
The other way round, the Executor unpickles what comes back only from a
server it trusts: each connection's server uid (SO_PEERCRED, the uid that
made the listening socket) must be in ``server_uids``, by default the
caller's own uid and root (a job's fiberd runs as the job's user; a site may
run a host's fiberd as root). Any other uid fails the future with a
``FiberdError`` naming it before anything is sent or read; a site whose fiberd
runs as a service account passes ``server_uids={that uid}``.

What a future gives back: the value; the exception the function raised (its
remote traceback chained as ``__cause__``, a ``RemoteTraceback``) or a
``RemoteError`` when it does not unpickle here; ``FiberKilled`` naming the
signal when the fiber died by one (and why, when fiberd or the OOM killer
ended it: its deadline, a stop, ...); ``TaskTimeout`` when the per-task
``timeout`` passed (the fiber is stopped: SIGTERM, grace, SIGKILL);
``FiberMissed`` when fiberd started nothing (a retryable miss, or in a Slurm
job a fiberd not listening yet, is first waited through as srun waits for
resources: up to ``wait`` seconds, 300 by default, saying once on stderr what
it waits for; ``wait=None``: ``retries`` tries with a short backoff);
``FiberdError`` when fiberd refused or could not be reached. Fibers in flight:
up to ``max_workers`` (default: this machine's usable CPUs); worker threads:
as many at most, started on demand, each with one connection.
``map``'s ``chunksize`` is accepted and ignored: every call is its own fiber.
What a call prints is captured (its fiber's stdout and stderr are anonymous
memory files this process passes it) and is not lost: each future is a
``FiberFuture``, whose ``stdout()`` and ``stderr()`` give the text (as
submitit's ``job.stdout()``), complete once the future is done; with ``echo``
(the default) it is also written to this process's stdout and stderr when the
call's fiber ends, each call's whole (as GNU parallel groups a job's output),
where a ProcessPoolExecutor worker's prints would go.
A running call cannot be cancelled (as in concurrent.futures); if the calling
process dies, its connections close and fiberd sends each fiber it was
waiting for SIGHUP (the clone's ``hangup``).

``nodes="all"`` in a Slurm job of several nodes: calls go to every node of the job,
``max_workers`` at once on each, a node taking the next call when one of its slots is
free: this node's fiberd through its socket, each other node's through a relay that
``srun --overlap`` runs on it, whose stdin and stdout carry the socket protocol
(``slurm_fiber/client/nodes/``: nothing listens on the network, no credential is added; the
server uid check is made where that fiberd runs). A node lost while a call runs on it
(its relay or fiberd gone) is named once on stderr and gets no more calls; each of its
calls not settled runs again on another node (with none left, it fails with
``FiberdError``). Outside such a job, ``nodes="all"`` runs the calls here;
``nodes=None`` (the default) always does.

A worker that finds several calls pending (``map`` queues all its calls
before a worker starts) starts as many as there is room for under
``max_workers`` with one batch clone (``slurm_fiber.client.tasks.TaskRunner.
run_many``), each still its own fiber. A future is settled as soon as its fiber has written the
call's value or exception (the clone's ``early`` result events, protocol v4:
the fiber's exit, its cgroup's tidying and its audit record still follow);
its room under ``max_workers`` is freed
only once the fiber has ended.

With ``windows=True`` (off by default: the task-window prototype, docs/design.md "Task
windows"), a worker sends the calls pending as one *windowed* batch (``run_many(...,
window=room)``, protocol v5): fiberd, or with ``task_window = "template"`` the template,
starts the next call of it as one ends, with no round trip through this process. A
window holds ``room`` slots under ``max_workers`` (the ones free when it is sent, at
least 1; never more than its calls) and takes at most ``MAX_BATCH`` calls: all pending
when it holds every slot, else its slots' share of them (``ceil(pending * room /
max_workers)``, at least ``room``), so a window sent while others still run does not
take calls a slot they free would have started at once (guided self-scheduling). As its
calls end it gives a slot back each time fewer of its calls remain than slots it holds,
and another worker takes the calls still queued with it: ``max_workers`` fibers at
most, and no slot left idle while a queued call waits. What differs from sending calls
without windows: a window's size is fixed when it is sent (a slot freed elsewhere
meanwhile goes to queued calls, never to a window's own waiting ones); a call taken
into a window is not ``running()`` until it ends and cannot be cancelled with
``future.cancel()``, even before its fiber starts (fiberd cancels a window's calls only
together); ``shutdown(cancel_futures=True)`` has every window start nothing more
(``TaskRunner.cancel_pending``): its calls not started end cancelled, its running ones
finish. The future of a call sent in a window of several is settled when its fiber has
ended, not as soon as the call has written its value (no ``early`` events asked: each
costs fiberd one more event, and a slot frees only at the end anyway); a lone call's is
settled early, as without windows. Results, exceptions, captured output and echo are as
without windows. With a per-task ``timeout``, calls go as without windows (``windows``
is then False): a task window's fibers cannot be stopped one by one (a task-window
fiberd closes a window whole), so a call past its timeout could not be stopped.
``nodes="all"`` hands calls out one at a time per node, as without windows.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import os
import pickle
import queue
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from slurm_fiber.client.discovery import discover_socket
from slurm_fiber.client.nodes.handout import HandOut, JobNodes, Node, job_node_names
from slurm_fiber.client.tasks import (
    DEFAULT_WAIT,
    Outcome,
    Task,
    TaskRunner,
    caller_path,
    in_job,
    wait_ready,
)
from slurm_fiber.protocol.limits import MAX_BATCH, MAX_PICKLED

T = TypeVar("T")


class RemoteTraceback(Exception):
    """The fiber's traceback text, chained as ``__cause__`` of a re-raised exception."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text.rstrip()}\n"""'


class RemoteError(Exception):
    """The function raised in the fiber, and the exception could not be rebuilt here:
    ``type`` and ``message`` name it, ``traceback`` is the fiber's text."""

    def __init__(self, type_name: str, message: str, traceback: str = "") -> None:
        super().__init__(f"{type_name}: {message}")
        self.type, self.message, self.traceback = type_name, message, traceback


class FiberKilled(Exception):
    """The fiber died by a signal before it answered; ``signal`` is its number, ``reason``
    the exit event's ({"code", "message"}: why fiberd or the OOM killer ended it), or
    None when that was not fiberd's doing."""

    def __init__(self, fiber_id: str | None, signum: int,
                 reason: Mapping[str, object] | None = None) -> None:
        import signal as _signal

        try:
            name = _signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        why = f": {reason.get('message')}" if reason else ""
        super().__init__(f"fiber {fiber_id} was killed by {name}{why}")
        self.fiber_id, self.signal, self.signal_name = fiber_id, signum, name
        self.reason = dict(reason) if reason else None


class TaskTimeout(cf.TimeoutError):
    """The task ran past its per-task timeout; its fiber was stopped."""


class FiberMissed(Exception):
    """fiberd started no fiber for the task (``code``, ``reason``; ``retryable`` ones
    were retried first)."""

    def __init__(self, code: str, reason: str, retryable: bool, attempts: int) -> None:
        super().__init__(f"{code}: {reason} (after {attempts} tries)")
        self.code, self.reason, self.retryable, self.attempts = code, reason, retryable, attempts


class FiberdError(Exception):
    """fiberd refused the request or could not be reached (one line)."""


def reference(fn: Callable[..., object]) -> str | None:
    """``module:qualname`` when ``fn`` can be found by name in another interpreter
    (a module-level function or class of a module other than ``__main__``), else None."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    owner: object = sys.modules.get(module)
    for part in qualname.split("."):
        owner = getattr(owner, part, None)
    return f"{module}:{qualname}" if owner is fn else None


def _dumps(value: object) -> bytes:
    try:
        return pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        import cloudpickle

        return cloudpickle.dumps(value, pickle.HIGHEST_PROTOCOL)


def encode_call(fn: Callable[..., object], args: tuple[object, ...],
                kwargs: Mapping[str, object]) -> dict[str, object]:
    """The clone's ``call`` field for ``fn(*args, **kwargs)`` (see the module doc).
    Raises TypeError/PicklingError when it does not pickle, ValueError when too big."""
    target = reference(fn)
    if target is not None:
        data = _dumps((tuple(args), dict(kwargs)))
    else:
        import cloudpickle

        data = cloudpickle.dumps((fn, tuple(args), dict(kwargs)), pickle.HIGHEST_PROTOCOL)
    text = base64.b64encode(data).decode()
    if len(text) > MAX_PICKLED:
        raise ValueError(f"the call pickles to {len(data)} bytes; a pickled call holds at "
                         f"most {MAX_PICKLED * 3 // 4} (pass big data by file name)")
    call: dict[str, object] = {"pickled": text}
    if target is not None:
        call["target"] = target
    return call


def decode_outcome(outcome: Outcome) -> object:
    """The call's value from a finished task, or raise what the future should (see the
    module doc)."""
    if outcome.failure is not None:
        raise FiberdError(outcome.failure)
    if outcome.miss is not None:
        m = outcome.miss
        raise FiberMissed(m.code, m.reason, m.retryable, outcome.attempts)
    end = outcome.exit or {}
    if outcome.timed_out:
        raise TaskTimeout(f"fiber {outcome.fiber_id} ran past its timeout and was stopped")
    error = end.get("error")
    if isinstance(error, dict):
        signum = end.get("signal")
        if isinstance(signum, int) and error.get("type") in ("FiberDied", "FiberLost"):
            reason = end.get("reason")
            raise FiberKilled(outcome.fiber_id, signum,
                              reason if isinstance(reason, dict) else None)
        raise _remote_exception(error)
    result = end.get("result")
    if isinstance(result, dict) and isinstance(result.get("pickled"), str):
        return pickle.loads(base64.b64decode(result["pickled"]))
    return result  # a fiber that called sys.exit(0): None


def _remote_exception(error: Mapping[str, object]) -> BaseException:
    text = str(error.get("traceback") or "")
    found: BaseException | None = None
    if isinstance(error.get("pickled"), str):
        try:
            found = pickle.loads(base64.b64decode(str(error["pickled"])))
        except Exception:
            found = None
    if not isinstance(found, BaseException):
        found = RemoteError(str(error.get("type")), str(error.get("message")), text)
    if text:
        found.__cause__ = RemoteTraceback(text)
    return found


class Executor(cf.Executor):
    """Runs each submitted call in a fresh fiber (see the module doc).

    ``socket``: fiberd's socket (default: discovered as fiberctl does); ``grant`` /
    ``token``: which grant (default: the home's own); ``env``: added to each fiber's
    environment; ``timeout``: per-task seconds (None: none); ``retries``: how many
    times a retryable miss is retried; ``max_workers``: fibers in flight at once;
    ``server_uids``: the uids fiberd may run as (default: this process's uid and root;
    see the module doc); ``wait``: seconds a call waits through retryable misses
    (cold, capacity; in a Slurm job also a fiberd not listening yet), saying once on
    stderr what it waits for (None: ``retries`` tries with a short backoff, as before);
    ``echo``: write what each call printed to this process's stdout and stderr;
    ``nodes``: "all" for every node of this Slurm job (see the module doc); ``windows``:
    send pending calls as windowed batches (a prototype, off by default; not with a
    ``timeout``: the module doc).
    """

    def __init__(self, max_workers: int | None = None, *,
                 socket: str | os.PathLike[str] | None = None, grant: str | None = None,
                 token: str | None = None, env: Mapping[str, str] | None = None,
                 timeout: float | None = None, retries: int = 5,
                 stop_grace: float = 1.0,
                 server_uids: Collection[int] | None = None,
                 wait: float | None = DEFAULT_WAIT, echo: bool = True,
                 nodes: str | None = None, windows: bool = False) -> None:
        if max_workers is not None and max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        if nodes not in (None, "all"):
            raise ValueError(f"nodes must be None or 'all', not {nodes!r}")
        self.max_workers = max_workers or len(os.sched_getaffinity(0))
        self.socket: Path = Path(discover_socket(socket))
        self.grant = grant
        self.timeout = timeout
        self.echo = echo
        self.windows = windows and timeout is None  # (the module doc: a timeout)
        self.runner = TaskRunner(self.socket, grant=grant, token=token, env=env,
                                 retries=retries, stop_grace=stop_grace,
                                 server_uids=trusted_servers(server_uids), wait=wait,
                                 wait_listening=in_job(), say=_say)
        self._work: queue.SimpleQueue[tuple[FiberFuture[Any], Task] | None] = \
            queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = threading.Semaphore(0)  # a worker is (or will be) free for a call
        self._free = 0  # (windows) workers not in a window: waiting for a slot or a call
        self._slots = threading.Semaphore(self.max_workers)  # fibers that may start now
        self._lock = threading.Lock()
        self._deferring = 0  # map() is queueing its calls: start workers once all are in
        self._shutdown = False
        self._nodes: HandOut[tuple[FiberFuture[Any], Task]] | None = None
        if nodes == "all":
            self._nodes = _every_node(self, socket, grant=grant, token=token, env=env,
                                      retries=retries, stop_grace=stop_grace,
                                      server_uids=trusted_servers(server_uids), wait=wait,
                                      wait_listening=in_job(), say=_say)

    def __repr__(self) -> str:
        return (f"Executor(socket={str(self.socket)!r}, max_workers={self.max_workers}, "
                f"windows={self.windows})")

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until fiberd answers and a template (``grant``'s, if given) is ready.
        Raises ``TimeoutError`` (``slurm_fiber.client.tasks.NotReady``) after ``timeout`` s."""
        wait_ready(self.socket, timeout, grant=self.grant)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> FiberFuture[T]:
        """Schedule ``fn(*args, **kwargs)`` in its own fiber; its Future (a FiberFuture:
        ``stdout()``, ``stderr()``). A call that does not pickle fails its future, not this
        method. Raises RuntimeError after shutdown."""
        future: FiberFuture[T] = FiberFuture()
        try:
            call = encode_call(fn, args, kwargs)
            call["path"] = caller_path()
            task = Task(call=call, timeout=self.timeout)
        except Exception as err:
            future.set_exception(err)
            return future
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if self._nodes is not None:
                self._nodes.put((future, task))
                return future
            self._work.put((future, task))
            if not self._deferring:
                self._worker_wanted()
        return future

    def map(self, fn: Callable[..., T], *iterables: Any, timeout: float | None = None,
            chunksize: int = 1) -> Iterator[T]:
        """As ``concurrent.futures.Executor.map``; every call is queued before a worker is
        started for them, so the first worker starts as many as ``max_workers`` allows in
        one batch clone."""
        with self._lock:
            self._deferring += 1
        try:
            return super().map(fn, *iterables, timeout=timeout, chunksize=chunksize)
        finally:
            with self._lock:
                self._deferring -= 1
                self._worker_wanted()

    def _worker_wanted(self) -> None:
        """A call was queued: start a worker for it unless one is (or will be) free
        (lock held). With windows, one is free exactly when it is in no window."""
        if self.windows:
            if self._free == 0:
                self._add_worker()
        elif not self._idle.acquire(blocking=False):
            self._add_worker()

    def _add_worker(self) -> None:
        """Start one more worker thread, up to ``max_workers`` (lock held)."""
        if len(self._threads) < self.max_workers and not self._shutdown:
            thread = threading.Thread(target=self._window_worker if self.windows
                                      else self._worker, daemon=True,
                                      name=f"slurm-fiber-executor-{len(self._threads)}")
            if self.windows:
                self._free += 1
            thread.start()
            self._threads.append(thread)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new work; with ``cancel_futures``, pending futures are cancelled (running
        fibers finish); with ``wait``, block until every worker is done."""
        with self._lock:
            self._shutdown = True
            if self._nodes is not None:
                self._every_node_shutdown(wait, cancel_futures)
                return
            if cancel_futures:
                while True:
                    try:
                        item = self._work.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
                if self.windows:
                    self.runner.cancel_pending()  # windows' calls not started: cancelled
            for _ in self._threads:
                self._work.put(None)
            threads = list(self._threads)
        if wait:
            for thread in threads:
                thread.join()
            self.runner.close()

    def _worker(self) -> None:
        """Wait for room under ``max_workers``, take a pending call and every other one
        pending that there is room for; start them as one batch (and another worker, for
        calls still queued); settle each future as its result comes, and free its room
        as its fiber ends."""
        while True:
            self._slots.acquire()
            item = self._work.get()
            if item is None:
                self._slots.release()
                return
            taken = [item]
            while self._slots.acquire(blocking=False):
                try:
                    more = self._work.get_nowait()
                except queue.Empty:
                    more = None
                else:
                    if more is None:
                        self._work.put(None)  # another worker's stop: leave it for it
                if more is None:
                    self._slots.release()
                    break
                taken.append(more)
            if not self._work.empty():
                with self._lock:
                    self._add_worker()
            running = [(f, t) for f, t in taken if f.set_running_or_notify_cancel()]
            for _ in range(len(taken) - len(running)):  # cancelled while pending
                self._call_ended()
            futures = [f for f, _ in running]
            pipes = [(os.memfd_create("fiber-stdout"), os.memfd_create("fiber-stderr"))
                     for _ in running]
            try:
                self.runner.run_many(
                    [Task(call=t.call, timeout=t.timeout,
                          stdio={"stdout": out, "stderr": err})
                     for (_, t), (out, err) in zip(running, pipes, strict=True)],
                    partial(self._ended, futures, pipes), partial(self._written, futures, pipes))
            finally:
                for out, err in pipes:
                    os.close(out)
                    os.close(err)

    def _written(self, futures: list[FiberFuture[Any]], pipes: list[tuple[int, int]], n: int,
                 event: dict[str, object]) -> None:
        """The ``n``th call of a batch has written its result (its fiber still ending):
        settle its future now, with what it printed so far (all a call prints before it
        returns: the fiber flushes first); its room stays taken until the fiber ended."""
        futures[n].captured(*pipes[n], str(event.get("fiber_id")))
        _settle(futures[n], Outcome(exit=event, fiber_id=str(event.get("fiber_id"))))

    def _ended(self, futures: list[FiberFuture[Any]], pipes: list[tuple[int, int]], n: int,
               outcome: Outcome) -> None:
        """The ``n``th call of a batch has ended: its output whole (echoed, with ``echo``),
        its future settled (unless its result came first), its room freed."""
        future = futures[n]
        future.captured(*pipes[n], outcome.fiber_id)
        if self.echo:
            _echo(future.stdout(), future.stderr())
        _settle(future, outcome)
        self._call_ended()

    def _call_ended(self) -> None:
        self._slots.release()
        self._idle.release()

    # ------------------------------------------------------------ windows=True

    def _window_worker(self) -> None:
        """Wait for a slot under ``max_workers`` and a pending call; take it with the other
        calls pending for one window (``_take_window``) and run them as one windowed batch
        (and start another worker, for calls still queued); settle each future as its
        result comes, and give slots back as the window's calls end (``_WindowSlots``)."""
        while True:
            self._slots.acquire()
            item = self._work.get()
            with self._lock:
                self._free -= 1
            if item is None:
                self._slots.release()
                return
            taken, room = self._take_window(item)
            with self._lock:
                if not self._work.empty():
                    self._worker_wanted()
            calls = [(f, t) for f, t in taken if f.take()]
            if self.runner.cancelling:  # shutdown(cancel_futures=True): start nothing
                for future, _ in calls:
                    future.cancel_taken()
                calls = []
            slots = _WindowSlots(room, len(calls), self._slot_back)
            futures = [f for f, _ in calls]
            pipes = [(os.memfd_create("fiber-stdout"), os.memfd_create("fiber-stderr"))
                     for _ in calls]
            try:
                if calls:
                    self.runner.run_many(
                        [Task(call=t.call, timeout=t.timeout,
                              stdio={"stdout": out, "stderr": err})
                         for (_, t), (out, err) in zip(calls, pipes, strict=True)],
                        partial(self._window_ended, futures, pipes, slots),
                        partial(self._written, futures, pipes) if len(calls) == 1 else None,
                        window=slots.held)
            finally:
                slots.close()
                for out, err in pipes:
                    os.close(out)
                    os.close(err)
                with self._lock:
                    self._free += 1  # this worker is free for the next window

    def _take_window(self, first: tuple[FiberFuture[Any], Task]
                     ) -> tuple[list[tuple[FiberFuture[Any], Task]], int]:
        """(A slot held and ``first`` taken.) The calls of one window and the slots it
        holds: as many more slots as are free now, up to the calls pending; every pending
        call up to MAX_BATCH when it holds all ``max_workers``, else its slots' share of
        them (the module doc). Slots beyond the calls taken are given back."""
        pending = 1 + self._work.qsize()
        room = 1
        while room < min(self.max_workers, pending) and self._slots.acquire(blocking=False):
            room += 1
        share = max(room, -(-pending * room // self.max_workers))
        taken = [first]
        while len(taken) < min(MAX_BATCH, share):
            try:
                more = self._work.get_nowait()
            except queue.Empty:
                break
            if more is None:
                self._work.put(None)  # another worker's stop: leave it for it
                break
            taken.append(more)
        for _ in range(room - len(taken)):
            self._slots.release()
        return taken, min(room, len(taken))

    def _slot_back(self) -> None:
        """A window gave a slot back: another worker may take queued calls with it."""
        self._slots.release()
        with self._lock:
            if not self._work.empty():
                self._worker_wanted()

    def _window_ended(self, futures: list[FiberFuture[Any]], pipes: list[tuple[int, int]],
                      slots: _WindowSlots, n: int, outcome: Outcome) -> None:
        """The ``n``th call of a window has ended (or was cancelled before it started):
        its output whole (echoed), its future settled or cancelled, a slot given back
        when fewer of the window's calls remain than slots it holds."""
        future = futures[n]
        if outcome.cancelled:
            future.cancel_taken()
        else:
            future.captured(*pipes[n], outcome.fiber_id)
            if self.echo:
                _echo(future.stdout(), future.stderr())
            _settle(future, outcome)
        slots.ended()

    # ------------------------------------------------------------ nodes="all"

    def _on_node(self, node: Node, item: tuple[FiberFuture[Any], Task]) -> bool:
        """Run one call on ``node`` (a HandOut worker); False when the node was lost
        before the call was settled (it then runs on another node)."""
        future, task = item
        if future.done() or (not future.running() and
                             not future.set_running_or_notify_cancel()):
            return True
        out, err = os.memfd_create("fiber-stdout"), os.memfd_create("fiber-stderr")
        try:
            outcome = node.runner.run(
                Task(call=task.call, timeout=task.timeout, stdio={"stdout": out, "stderr": err}),
                lambda event: self._written([future], [(out, err)], 0, event))
            if outcome.failure is not None and not outcome.refused and not future.done():
                assert self._nodes is not None
                self._nodes.nodes.lose(node, outcome.failure)
                return False
            if outcome.exit is not None:
                node.runner.wait_listening = False  # reached: a fiberd gone now is lost
            future.captured(out, err, outcome.fiber_id)
            if self.echo:
                _echo(future.stdout(), future.stderr())
            _settle(future, outcome)
            return True
        finally:
            os.close(out)
            os.close(err)

    def _every_node_shutdown(self, wait: bool, cancel_futures: bool) -> None:
        """(``nodes="all"``, lock held) shutdown's: queued calls cancelled or run."""
        assert self._nodes is not None
        if cancel_futures:
            for future, _task in self._nodes.drain():
                future.cancel()
        self._nodes.shutdown(wait)
        if wait:
            self._nodes.nodes.close()


class _WindowSlots:
    """The slots under ``max_workers`` one window holds for its calls not ended yet: each
    time one ends, slots are given back (``give``, once per slot) until no more are held
    than calls remain; ``close`` gives back the rest. Used by its window's thread only."""

    def __init__(self, held: int, calls: int, give: Callable[[], None]) -> None:
        self.held, self.left, self._give = held, calls, give
        while self.held > max(self.left, 1):
            self._back()

    def ended(self) -> None:
        """One of the window's calls ended."""
        self.left -= 1
        while self.held > self.left:
            self._back()

    def close(self) -> None:
        """The window is over: every slot it still holds given back."""
        while self.held:
            self._back()

    def _back(self) -> None:
        self.held -= 1
        self._give()


class FiberFuture(cf.Future[T]):
    """A ``concurrent.futures.Future`` of one call, with what its fiber printed. Taken
    into a task window (``Executor(windows=True)``), it cannot be cancelled by ``cancel``
    any more; only its window's cancel (``cancel_taken``) ends it so."""

    def __init__(self) -> None:
        super().__init__()
        self.fiber_id: str | None = None
        self._out, self._err = "", ""
        self._taken = False
        self._taking = threading.Lock()

    def cancel(self) -> bool:
        """As ``concurrent.futures.Future.cancel``; False once taken into a window."""
        with self._taking:
            if self._taken:
                return self.cancelled()
            return super().cancel()

    def take(self) -> bool:
        """Mark it taken into a window; False (its waiters told) when it was cancelled
        first."""
        with self._taking:
            if not self.cancelled():
                self._taken = True
                return True
        return self.set_running_or_notify_cancel()

    def cancel_taken(self) -> None:
        """Its window started nothing more before it (shutdown with ``cancel_futures``):
        it ends cancelled, its waiters told."""
        if cf.Future.cancel(self):
            self.set_running_or_notify_cancel()

    def stdout(self) -> str:
        """What the call wrote to its stdout (complete once the future is done)."""
        return self._out

    def stderr(self) -> str:
        """What the call wrote to its stderr (complete once the future is done)."""
        return self._err

    def captured(self, out: int, err: int, fiber_id: str | None) -> None:
        """Take what the fiber wrote to its memory files ``out`` and ``err`` so far."""
        self.fiber_id = fiber_id or self.fiber_id
        self._out = _read_all(out).decode(errors="replace")
        self._err = _read_all(err).decode(errors="replace")


def _read_all(fd: int) -> bytes:
    """Everything written to ``fd`` (a memfd the fiber wrote through its own offset)."""
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


_ECHO = threading.Lock()


def _echo(out: str, err: str) -> None:
    """One call's output, whole, on this process's stdout and stderr."""
    with _ECHO:
        if out:
            sys.stdout.write(out)
            sys.stdout.flush()
        if err:
            sys.stderr.write(err)
            sys.stderr.flush()


def _say(line: str) -> None:
    print(f"slurm_fiber.Executor: {line}", file=sys.stderr, flush=True)


def _every_node(executor: Executor, socket: str | os.PathLike[str] | None,
                **runner: Any) -> HandOut[tuple[FiberFuture[Any], Task]] | None:
    """``nodes="all"``: calls handed to every node of this multi-node Slurm job, each with
    ``max_workers`` slots (slurm_fiber/client/nodes/); None outside one (the calls run here).
    Raises RuntimeError when the job's nodes cannot be listed."""
    try:
        names = job_node_names()
    except Exception as err:
        raise RuntimeError(f"nodes='all': cannot list the job's nodes: {err}") from err
    if len(names) < 2:
        return None
    nodes = JobNodes.start(names, os.fspath(socket) if socket else None, _say, **runner)

    def fail(item: tuple[FiberFuture[Any], Task], why: str) -> None:
        _settle(item[0], Outcome(failure=why))

    return HandOut(nodes, executor.max_workers, executor._on_node, fail)


def trusted_servers(uids: Collection[int] | None) -> frozenset[int]:
    """The server uids an Executor trusts: ``uids``, by default its own uid and root."""
    return frozenset(uids) if uids is not None else frozenset({os.getuid(), 0})


def _settle(future: cf.Future[Any], outcome: Outcome) -> None:
    """Give ``future`` the call's value or exception, unless it has one already."""
    if future.done():
        return
    try:
        future.set_result(decode_outcome(outcome))
    except BaseException as err:
        future.set_exception(err)
