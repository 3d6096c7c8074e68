"""``fiberctl map``: GNU parallel's job for fibers: one fresh fiber per argument.

    fiberctl map [-j N] [--joblog FILE [--resume | --resume-failed]] [--results DIR]
                 [--retries K] [--halt WHEN,WHY] [--tag] [-k] [--timeout S]
                 [-a FILE]... [--range A-B] [--colsep REGEX] [--dry-run]
                 [--bar | --eta | --progress] [--call MODULE:FUNC] [--json]
                 [--nodes all [--split dynamic|rr] [--via spool|relay]]
                 [-g GRANT | -t FILE] [-e KEY=VALUE]... [-S SOCKET] [-q]
                 [--] CMD [ARG...] [::: ARGS | :::+ ARGS | :::: FILES | ::::+ FILES]...

Arguments come as GNU parallel takes them (slurm_fiber/client/mapinput.py):
``::: a b``, ``:::: FILE`` and ``-a FILE`` (one a line), ``:::+``/``::::+``
(linked to the source before), every combination of several sources, stdin
lines when none is given, ``--colsep REGEX`` to split each into columns;
``--range A-B`` (the integers A..B) is fiberctl's own. The command is the
first word that is no option (or everything after ``--``) up to the first
``:::``. For each task, ``CMD`` runs as a fiber with the replacement strings
filled in: ``{}`` the arguments, ``{1}``..``{n}`` one of them, ``{#}`` the
sequence number (from 1), ``{%}`` the job slot (1..N), ``{.}`` without the
extension, ``{/}`` the base name, ``{//}`` the directory, ``{/.}`` the base
name without extension (also ``{1.}``...); a command with none gets the
arguments appended. A command of several words runs without a shell (exec:
each word as given, no quoting needed); a command given as ONE word holding
a space or shell character is a shell line, run as parallel runs it
(``$PARALLEL_SHELL``, ``$SHELL`` or /bin/sh, ``-c``, each replacement
shell-quoted). ``--call MODULE:FUNC`` calls the function in the grant's warm
interpreter instead, with the command's words (replaced) as string arguments,
default the arguments; its JSON result is the task's output line; it is
imported as ``fiberctl call`` imports (the working directory and
``$PYTHONPATH`` first). ``--dry-run`` prints each task's command (as the
joblog's Command column) and runs nothing. An option GNU parallel has and
this map has not exits 2 with one line naming it.

A task that misses ``cold`` or ``capacity`` (or, in a Slurm job or with
``--wait``, finds no fiberd listening yet) is tried again for up to ``--wait
S`` seconds (300 by default), the map saying once on stderr what it waits for;
``--no-wait``: a few tries over about a second and a half, as before.

As GNU parallel: up to ``-j`` tasks at once (default: this machine's usable
CPUs), each in this directory with stdin from /dev/null; each task's stdout
and stderr are printed whole when it ends (``-k``: in the order of the
arguments; with ``--tag``, each line prefixed by the arguments and a TAB);
``--joblog`` writes
parallel's TAB-separated log (Seq, Host, Starttime, JobRuntime, Send,
Receive, Exitval, Signal, Command; Starttime is when the task's own fiber started,
JobRuntime its own run time, as parallel's: not when its batch was sent. Command is
the argv as a shell would take it, or
``MODULE:FUNC["arg", ...]``; a task stopped at ``--timeout`` has Exitval -1
and its signal); ``--results DIR`` keeps ``DIR/1/<arg>/stdout``,
``stderr`` and ``seq``; ``--retries K`` runs a failing task up to K times
(the log and output show the last try); ``--halt`` takes ``never``,
``now|soon,fail|success|done=X`` or ``=Y%`` (now: stop the running fibers);
the exit status is the number of failed tasks, 101 for more than 100 (with
``--halt ...,fail=1``, the failing task's status; with ``fail=Y%``, the
percentage of tasks that failed). ``--resume`` skips the tasks (by sequence
number) the joblog already has a row for, ``--resume-failed`` those it logs as
succeeded; both append to it. A progress bar goes to stderr when stderr is a
terminal, or with ``--bar``; ``--eta`` and ``--progress`` draw parallel's
lines instead (time left, average). A task that fiberd ended (its
deadline, ...) or whose exec failed gets fiberctl run's one line after its
stderr (``--quiet``: not). ``--json`` ends stdout with one JSON
summary line. fiberd refusing the work itself (a final miss such as
unknown_grant, a refusal, fiberd unreachable) stops the map with fiberctl's
exit codes (77, 1, 69; a refusal was 65 before issue 15), as no task could
run; the ``fiberctl map:`` line on stderr tells a refusal from one failed task.

Tasks go to fiberd in windowed batch clones (``TaskRunner.run_many`` with a
window, protocol v5): one worker thread (one per 32 slots) sends up
to 64 tasks in one request and fiberd keeps ``-j`` of them running, starting
the next as one ends, with no round trip between them (each task still its
own fiber, record and exit; Ctrl-C, or fiberd refusing the work, cancels the
tasks not started). Two cases keep the older way, where the ``-j`` slots
are shared out to one worker thread per CPU, each starting its share as one
batch and the next once all of them have ended (a slow task holds its
worker's other slots): ``--halt`` (no task may start before the map has seen
how the one before ended), a command with ``{%}`` (only the client can
number a slot).

``--nodes all`` (in a Slurm job of several nodes): the arguments are read
here and written, with the map's options, to a spool directory
(``.fibermap-*`` in the working directory, which every node must see, as for
``--joblog`` and ``--results``; private to the map's user and opened by
identity, never trusted by name: client/mapspool.py; removed when the map ends or
gets SIGTERM alone; a job ended under the map kills the batch script's
processes and leaves it, named after the job). A spool another user replaced
makes each share refuse it with one line and the map exit 255.
One ``srun --overlap --ntasks-per-node=1`` step starts one share per node,
each running tasks with ``-j`` slots through its own node's fiberd, found as
fiberctl finds it. ``--split dynamic`` (the default) hands tasks out as nodes
have room: each slot of each share takes the next task no share has taken (a
``claim-<seq>`` file made with O_EXCL in the spool), so a node whose tasks are
slow is helped by the others; ``--split rr``: round robin by sequence number
(``{#}`` modulo the node count, no coordination). Both are carried by Slurm
and the shared directory alone: no listener on the network, no new
credential. A share that ends without its summary (its node lost, its srun
task killed) is reported in one line, and (dynamic) the tasks it took and did
not finish, with any no share took, run again on this node; its finished
tasks count. Task output passes through srun (each node's in order; two
nodes' lines may interleave); the joblog (Host: the node's name) is merged in
the order tasks ended and the exit status is counted over all tasks. A share
that reaches ``--halt`` tells the others through the spool, which they check
every 0.1 s (``now``: they stop their running fibers; a ``Y%`` counts the
share's own tasks). No progress line is drawn; ``-k`` is refused. With
``--split rr``, a share that ends without its summary makes the map exit 255.
``--via relay``: no share and no spool; this
map hands every task out itself, to each node's fiberd through a relay srun
runs on that node (client/mapnodes.py, slurm_fiber/client/nodes/). Outside a Slurm job, or
in a job of one node, ``--nodes all`` says so in one line and runs every
task here.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence

from slurm_fiber.client.discovery import discover_socket
from slurm_fiber.client.fiberctl import (
    EXIT_FINAL_MISS,
    EXIT_REFUSED,
    EXIT_RETRYABLE_MISS,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    SOCKET_HELP,
    Exit,
    command_path,
    end_line,
    fail,
    grant_fields,
    help_formatter,
)
from slurm_fiber.client.mapinput import (
    Args,
    combine,
    command_words,
    lazily,
    read_lines,
    shell_line,
    shown,
    split_sources,
)
from slurm_fiber.client.mapspool import Spool
from slurm_fiber.client.tasks import DEFAULT_WAIT, MAX_BATCH, Outcome, Task, TaskRunner, in_job
from slurm_fiber.protocol.framing import json_dumps

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from typing import IO, NoReturn

HALT = re.compile(r"(now|soon),(fail|success|done)=(\d+)(%?)")
JOBLOG_HEADER = "Seq\tHost\tStarttime\tJobRuntime\tSend\tReceive\tExitval\tSignal\tCommand\n"
MAX_FAILED_STATUS = 101
WINDOW_SLOTS = 32  # -j slots one windowed worker keeps (its batches hold up to MAX_BATCH)


class Halt:
    """``--halt``: stop ``now`` (stopping running fibers) or ``soon`` (let them finish)
    once ``count`` tasks (or ``percent`` of all) have ended as ``why``. Compared by value.
    (A plain class, not a dataclass: the map's start leaves dataclasses out.)"""


    def __init__(self, now: bool, why: str, count: int, percent: bool) -> None:
        self.now = now
        self.why = why  # fail, success, done
        self.count = count
        self.percent = percent

    def __eq__(self, other: object) -> bool:
        if type(other) is not Halt:
            return NotImplemented
        return ((self.now, self.why, self.count, self.percent)
                == (other.now, other.why, other.count, other.percent))

    def __repr__(self) -> str:
        return (f"Halt(now={self.now!r}, why={self.why!r}, count={self.count!r}, "
                f"percent={self.percent!r})")

    @classmethod
    def parse(cls, text: str) -> Halt | None:
        """None for ``never``/``0``; raises ValueError on anything not documented."""
        legacy = {"0": "never", "1": "soon,fail=1", "2": "now,fail=1",
                  "-1": "soon,success=1", "-2": "now,success=1"}
        text = legacy.get(text, text)
        if text == "never":
            return None
        m = HALT.fullmatch(text)
        if m is None:
            raise ValueError(f"--halt {text!r} is not never or now|soon,fail|success|done=X[%]")
        return cls(m[1] == "now", m[2], int(m[3]), bool(m[4]))

    def reached(self, failed: int, succeeded: int, total: int | None) -> bool:
        seen = {"fail": failed, "success": succeeded, "done": failed + succeeded}[self.why]
        if self.percent:
            return total is not None and total > 0 and seen * 100 >= self.count * total
        return seen >= self.count


def arguments(opts: argparse.Namespace) -> tuple[Iterator[Args], int | None]:
    """Every task's arguments in order, and how many (None: stdin read as it comes, from a
    terminal): --range, else the input sources (-a, :::, ::::, ...; mapinput.py), else
    stdin lines. Raises Exit(2) for a file that cannot be read."""
    if opts.range is not None:
        low, high = opts.range
        step = 1 if high >= low else -1
        return ((str(i),) for i in range(low, high + step, step)), abs(high - low) + 1
    sources: list[tuple[bool, list[str]]] = []
    try:
        for path in opts.arg_file or []:
            sources.append((False, read_lines(path)))
        for sep, words in opts.sources:
            linked = sep.endswith("+")
            if sep.startswith("::::"):
                for n, path in enumerate(words):
                    sources.append((linked and n == 0, read_lines(path)))
            else:
                sources.append((linked, list(words)))
    except OSError as err:
        raise fail(EXIT_USAGE, f"fiberctl map: cannot read {err.filename}: "
                   f"{err.strerror or err}") from None
    if not sources:
        if sys.stdin.isatty() and opts.colsep is None:
            return lazily(iter(sys.stdin)), None
        sources.append((False, read_lines("-")))
    try:
        tasks = combine(sources, opts.colsep)
    except re.error as err:
        raise fail(EXIT_USAGE, f"fiberctl map: --colsep {opts.colsep!r}: {err}") from None
    return iter(tasks), len(tasks)


def resumed(opts: argparse.Namespace) -> set[int]:
    """(``--resume``, ``--resume-failed``) the sequence numbers the joblog says need not
    run again: every one logged, or those logged as succeeded (Exitval and Signal 0)."""
    if not (opts.resume or opts.resume_failed):
        return set()
    done: set[int] = set()
    try:
        with open(opts.joblog) as log:
            for line in log:
                cols = line.rstrip("\n").split("\t")
                if len(cols) < 9 or not cols[0].isdigit():
                    continue
                if opts.resume or (cols[6] == "0" and cols[7] == "0"):
                    done.add(int(cols[0]))
    except FileNotFoundError:
        pass
    except OSError as err:
        raise fail(EXIT_USAGE, f"fiberctl map: cannot read the joblog {opts.joblog}: "
                   f"{err.strerror or err}") from None
    return done


def parse_range(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(-?\d+)-(-?\d+)", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not A-B (two integers)")
    return int(m[1]), int(m[2])


def parse_seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text)
    if m is None or float(m[1]) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive duration (e.g. 30, 2m)")
    return float(m[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m[2]]


def results_dir(root: str, args: Args) -> str:
    """GNU parallel's ``--results`` place for a task's arguments: ``root/1/<a>/2/<b>...``,
    a ``/`` in an argument written as ``\\_`` (as parallel does), an empty one as
    ``\\0``... each kept to one path component."""
    parts = [root]
    for n, arg in enumerate(args, start=1):
        name = arg.replace("\\", "\\\\").replace("/", "\\_") or "\\0"
        if name in (".", ".."):
            name = "\\" + name
        parts += [str(n), name[:255]]
    return os.path.join(*parts)


class Map:
    """One ``fiberctl map`` run: workers, output, joblog, halt, summary (see module doc)."""

    def __init__(self, opts: argparse.Namespace, runner: TaskRunner,
                 args: Iterator[tuple[int, Args]], total: int | None,
                 share: NodeShare | None = None, order: Sequence[int] | None = None) -> None:
        self.opts = opts
        self.runner = runner
        self.args = args  # (sequence number, argument)
        self.total = total
        self.share = share
        self.host = share.node if share is not None else ":"
        self.cwd = os.getcwd()  # each exec task's, as it was when the map began
        self.path = command_path()  # a --call's import path, as fiberctl call's
        self.halt: Halt | None = opts.halt
        self.lock = threading.Lock()
        self.stopping = False
        self.halted: Outcome | None = None
        self.halted_at: float | None = None
        self.abort: tuple[int, str] | None = None
        self.failed = self.succeeded = 0
        self.started = time.monotonic()
        self.joblog: IO[str] | None = None
        self.progress = share is None and (opts.progress is not None or sys.stderr.isatty())
        self.line = shell_line(opts.cmd) and opts.call is None  # the command is a shell line
        self.kept: dict[int, tuple[bytes, bytes]] = {}  # -k: output held until its turn
        self.order = iter(order) if order is not None else None  # -k: the seqs, in order
        self.turn: int | None = next(self.order, None) if self.order is not None else None
        self.ended = threading.Event()

    # ------------------------------------------------------------ running

    def run(self) -> int:
        """Run every task; the exit status (see the module doc)."""
        if self.share is not None:
            self.joblog = self.share.joblog_file()
        elif self.opts.joblog:
            resuming = (self.opts.resume or self.opts.resume_failed) and \
                os.path.exists(self.opts.joblog) and os.path.getsize(self.opts.joblog) > 0
            self.joblog = open(self.opts.joblog, "a" if resuming else "w")  # noqa: SIM115
            if not resuming:
                self.joblog.write(JOBLOG_HEADER)
            self.joblog.flush()
        workers = self.workers()
        if self.share is not None:  # ends once ``ended`` is set
            threading.Thread(target=self.watch_halt, daemon=True).start()
        try:
            for w in workers:
                w.start()
            for w in workers:
                while w.is_alive():
                    w.join(0.2)
        except KeyboardInterrupt:
            with self.lock:
                self.stopping = True
            self.runner.stop_all()
            for w in workers:
                w.join()
            raise
        finally:
            self.ended.set()
            self.flush_kept()
            if self.joblog is not None:
                self.joblog.close()
            self.runner.close()
            if self.progress:
                sys.stderr.write("\n")
        return self.exit_status()

    def workers(self) -> list[threading.Thread]:
        """The worker threads (not started) that keep the ``-j`` slots (the module doc)."""
        dynamic = self.share is not None and self.opts.split == "dynamic"
        windowed = self.halt is None and not any("{%}" in word for word in self.opts.cmd) \
            and not dynamic  # a dynamic share takes a task only when a slot is free
        shares = (window_slots(self.opts.jobs) if windowed
                  else worker_slots(self.opts.jobs,
                                    self.opts.jobs if dynamic else len(os.sched_getaffinity(0))))
        return [threading.Thread(target=self.worker, args=(*share, windowed), daemon=True)
                for share in shares]

    def watch_halt(self) -> None:
        """(A node's share) every 0.1 s until this share's tasks are done: once another
        node's share has halted, start no more tasks, and with ``now`` stop the running
        ones."""
        assert self.share is not None
        while not self.ended.wait(0.1):
            flag = self.share.halted()
            if flag is None:
                continue
            now = flag == "now"
            with self.lock:
                self.stopping = True
            if now:
                self.runner.stop_all()
            return

    def next_arg(self) -> tuple[int, Args] | None:
        with self.lock:
            if self.stopping:
                return None
            try:
                return next(self.args)
            except StopIteration:
                return None

    def worker(self, first_slot: int, slots: int, windowed: bool) -> None:
        """Keep ``slots`` job slots (numbered from ``first_slot``): take the arguments
        (and the tries still owed) of one batch, finish each task as its fiber ends; the
        next batch once all have ended. ``windowed``: batches of MAX_BATCH, ``slots`` of
        them running at once (fiberd starts the next as one ends); else of ``slots``."""
        owed: list[tuple[int, Args, list[str], int]] = []  # seq, args, words, try number
        size = MAX_BATCH if windowed else slots
        while True:
            batch, owed = owed, []
            while len(batch) < size and (item := self.next_arg()) is not None:
                seq, arg = item
                slot = first_slot + len(batch)
                batch.append((seq, arg, command_words(self.opts.cmd, arg, seq, slot,
                                                      self.opts.call is not None), 1))
            if not batch:
                return
            self.run_batch(batch, owed, slots if windowed else None)

    def run_batch(self, batch: list[tuple[int, Args, list[str], int]],
                  owed: list[tuple[int, Args, list[str], int]], window: int | None) -> None:
        """Run ``batch`` (seq, arg, words, try number), at most ``window`` at once (None:
        all), and finish each task as it ends; a failed one with tries left goes to
        ``owed``; one cancelled before it started (a halt) is dropped."""
        pipes = [(os.memfd_create("fiber-stdout"), os.memfd_create("fiber-stderr"))
                 for _ in batch]

        def done(i: int, outcome: Outcome) -> None:
            if outcome.cancelled:
                return
            seq, arg, words, attempt = batch[i]
            stdout, stderr = self.output(outcome, *pipes[i])
            if not (outcome.ok or self.abort_for(outcome) or attempt >= self.opts.retries):
                with self.lock:
                    if not self.stopping:
                        owed.append((seq, arg, words, attempt + 1))
                        return
            self.finish(seq, arg, words, outcome, stdout, stderr)

        try:
            self.runner.run_many([self.task(words, *pipe) for (_, _, words, _), pipe
                                  in zip(batch, pipes, strict=True)], done, window=window)
        finally:
            for out, err in pipes:
                os.close(out)
                os.close(err)

    def task(self, words: list[str], out: int, err: int) -> Task:
        """One try's task: the fiber's stdout and stderr go to anonymous memory files
        (memfd), read back once it has ended."""
        stdio = {"stdout": out, "stderr": err}
        if self.opts.call is not None:
            return Task(call={"target": self.opts.call, "args": words, "path": self.path},
                        stdio=stdio, timeout=self.opts.timeout)
        return Task(exec={"argv": words, "cwd": self.cwd}, stdio=stdio,
                    timeout=self.opts.timeout)

    def output(self, outcome: Outcome, out: int, err: int) -> tuple[bytes, bytes]:
        """A finished try's stdout and stderr, with fiberctl run's line on why it ended."""
        stdout, stderr = _read_all(out), _read_all(err)
        end = outcome.exit or {}
        line = None if self.opts.quiet else end_line(end)
        if line is not None:  # why fiberd ended it, or why its exec failed
            stderr += f"{line}\n".encode()
        if self.opts.call is not None and outcome.exit is not None:
            error = end.get("error")
            if isinstance(error, dict):
                stderr += f"{error.get('type')}: {error.get('message')}\n".encode()
            elif not outcome.timed_out:
                stdout += (json_dumps(end.get("result")) + "\n").encode()
        return stdout, stderr

    def abort_for(self, outcome: Outcome) -> bool:
        """A failure of fiberd itself (not of the task) stops the whole map."""
        if outcome.failure is None and outcome.miss is None:
            return False  # (a retryable miss comes back only once its retries are spent)
        if outcome.failure is not None:
            code = EXIT_REFUSED if outcome.refused else EXIT_UNREACHABLE
            line = f"fiberctl map: {outcome.failure}"
        else:
            assert outcome.miss is not None
            code = EXIT_RETRYABLE_MISS if outcome.miss.retryable else EXIT_FINAL_MISS
            line = f"{outcome.miss.code}: {outcome.miss.reason}"
        with self.lock:
            if self.abort is None:
                self.abort = (code, line)
            self.stopping = True
        self.runner.cancel_pending()
        return True

    # ------------------------------------------------------------ reporting

    def finish(self, seq: int, arg: Args, words: list[str], outcome: Outcome,
               stdout: bytes, stderr: bytes) -> None:
        ok = outcome.ok
        stop_now = False
        with self.lock:
            if outcome.exit is None:
                return  # never ran: the abort line says why
            if ok:
                self.succeeded += 1
            else:
                self.failed += 1
            if self.halt is not None and self.halted is None and \
                    self.halt.reached(self.failed, self.succeeded, self.total):
                self.halted, self.stopping = outcome, True
                self.halted_at = time.time()
                stop_now = self.halt.now
                if self.share is not None:  # tell the other nodes' shares
                    self.share.tell_halt(self.halt.now)
            self.emit(seq, arg, words, outcome, stdout, stderr)
        if stop_now:
            self.runner.stop_all()

    def emit(self, seq: int, arg: Args, words: list[str], outcome: Outcome,
             stdout: bytes, stderr: bytes) -> None:
        """Print one finished task's output (with -k: once every one before it has been
        printed or will never be), log it, keep its results (lock held)."""
        shown_out, shown_err = stdout, stderr  # --tag marks what is printed, as parallel's
        if self.opts.tag:  # (the joblog's Receive and --results keep the task's own)
            shown_out, shown_err = _tag(stdout, arg), _tag(stderr, arg)
        if self.progress:
            sys.stderr.write("\r\033[K")
        if self.order is None:
            self.write(shown_out, shown_err)
        else:
            self.kept[seq] = (shown_out, shown_err)
            while self.turn is not None and self.turn in self.kept:
                self.write(*self.kept.pop(self.turn))
                self.turn = next(self.order, None)
        end = outcome.exit or {}
        signum = end.get("signal") if isinstance(end.get("signal"), int) else 0
        exitval = -1 if outcome.timed_out or outcome.exit is None else (
            end.get("exit_code") if isinstance(end.get("exit_code"), int) else -1)
        if self.opts.call is not None and exitval == 0 and not outcome.ok:
            exitval = 1
        if self.joblog is not None:
            command = shown(words, self.opts.call, self.line)
            row = (f"{seq}\t{self.host}\t{outcome.started:.3f}\t{outcome.runtime:10.3f}\t0\t"
                   f"{len(stdout)}\t{exitval}\t{signum}\t{command}\n")
            # a node's share: one JSON string per row, as a command may span lines
            self.joblog.write(row if self.share is None else json_dumps(row) + "\n")
            self.joblog.flush()
        if self.opts.results is not None:
            place = results_dir(self.opts.results, arg)
            os.makedirs(place, exist_ok=True)
            for name, data in (("seq", f"{seq}\n".encode()), ("stdout", stdout),
                               ("stderr", stderr)):
                with open(os.path.join(place, name), "wb") as f:
                    f.write(data)
        if self.progress:
            self.draw_progress()

    @staticmethod
    def write(stdout: bytes, stderr: bytes) -> None:
        sys.stdout.flush()
        if stdout:  # (an empty one would still cost a write)
            sys.stdout.buffer.write(stdout)
            sys.stdout.flush()
        if stderr:
            sys.stderr.buffer.write(stderr)
            sys.stderr.flush()

    def flush_kept(self) -> None:
        """(-k, at the end) the output still held, in order (its turn never came: a task
        before it did not run, halted or cancelled)."""
        with self.lock:
            for seq in sorted(self.kept):
                self.write(*self.kept.pop(seq))

    def draw_progress(self) -> None:
        """The progress line on stderr: --eta's, --progress's, else a bar."""
        done = self.failed + self.succeeded
        elapsed = max(1e-9, time.monotonic() - self.started)
        rate = done / elapsed
        left = self.total - done if self.total else None
        if self.opts.progress in ("eta", "progress"):
            avg = elapsed / done if done else 0.0
            pct = 100 * done // self.total if self.total else 0
            eta = f"{left * avg:.0f}s" if left is not None and done else "?"
            line = (f"ETA: {eta} Left: {left if left is not None else '?'} AVG: {avg:.2f}s"
                    if self.opts.progress == "eta" else
                    f"local:{left if left is not None else '?'}/{done}/{pct}%/{avg:.1f}s")
            sys.stderr.write(f"\r{line}")
            sys.stderr.flush()
            return
        if self.total:
            width = 30
            filled = width * done // self.total
            bar = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}"
        else:
            bar = f"{done} done"
        sys.stderr.write(f"\r{bar}  {self.failed} failed  {rate:.1f} tasks/s")
        sys.stderr.flush()

    def exit_status(self) -> int:
        if self.abort is not None:
            print(self.abort[1], file=sys.stderr)
            return self.abort[0]
        return final_status(self.halt, self.halted is not None, self.halted_status(),
                            self.failed, self.succeeded)

    def halted_status(self) -> int | None:
        """The halting task's shell status (1 when it has none), None if none halted."""
        if self.halted is None:
            return None
        return self.halted.status if self.halted.status is not None else 1

    def summary(self, status: int) -> dict[str, object]:
        wall = time.monotonic() - self.started
        done = self.failed + self.succeeded
        return {"tasks": done, "succeeded": self.succeeded, "failed": self.failed,
                "halted": self.halted is not None, "wall_s": round(wall, 3),
                "tasks_per_s": round(done / wall, 1) if wall > 0 else None,
                "jobs": self.opts.jobs, "exit": status,
                "joblog": str(self.opts.joblog) if self.opts.joblog else None}


class NodeShare:
    """(``--nodes all``) this node's share of a map: the tasks whose sequence number is
    ``index`` modulo ``count``, its joblog and summary written to ``spool`` (a private
    directory in the map's working directory, which every node sees: client/mapspool.py)."""


    def __init__(self, spool: Spool, index: int, count: int, node: str) -> None:
        self.spool, self.index, self.count, self.node = spool, index, count, node

    def __repr__(self) -> str:
        return (f"NodeShare(spool={self.spool!r}, index={self.index!r}, count={self.count!r}, "
                f"node={self.node!r})")

    @classmethod
    def here(cls, path: str, inode: str) -> NodeShare:
        """The share of the srun task this process is (SLURM_PROCID of SLURM_NTASKS), in
        the spool at ``path`` whose inode is ``inode``. Raises Exit when that spool is not
        the map's (another user replaced it)."""
        from slurm_fiber.safefs import UnsafePath

        try:
            spool = Spool.attach(path, int(inode))
        except (UnsafePath, OSError, ValueError) as err:
            raise fail(EXIT_OTHER, f"fiberctl map: this node's share runs nothing: {err}") \
                from None
        env = os.environ
        return cls(spool, int(env.get("SLURM_PROCID", "0")),
                   int(env.get("SLURM_NTASKS", "1")),
                   env.get("SLURMD_NODENAME") or os.uname().nodename)

    def options(self) -> argparse.Namespace:
        """The map's options as the user gave them (the arguments are ``arguments()``)."""
        import json  # a node's share, not every map's start

        opts = parse(json.loads(self.spool.read("argv.json")))
        opts.nodes, opts.json, opts.range, opts.arg_file = None, False, None, None
        opts.joblog = None  # this share's rows go to the spool (``joblog_file``)
        return opts

    def arguments(self) -> Iterator[tuple[int, Args]]:
        """Every task of the map: its sequence number and arguments (one JSON line each)."""
        import json  # a node's share, not every map's start

        for line in self.spool.read("args").splitlines():
            seq, args = json.loads(line)
            yield int(seq), tuple(str(a) for a in args)

    def joblog_file(self) -> IO[str]:
        """This share's joblog in the spool (one JSON string per row)."""
        return os.fdopen(self.spool.create_file(f"joblog-{self.index}"), "w")

    def mine(self, tasks: Iterator[tuple[int, Args]]) -> list[tuple[int, Args]]:
        """This share's (sequence number, arguments): round robin by sequence number."""
        return [(seq, args) for seq, args in tasks if (seq - 1) % self.count == self.index]

    def claimed(self, tasks: Iterator[tuple[int, Args]]) -> Iterator[tuple[int, Args]]:
        """(``--split dynamic``) the tasks this share takes, one at a time as it asks for
        the next: the first not taken by another node's share (a ``claim-<seq>`` file made
        with O_EXCL in the spool, naming this share)."""
        for seq, args in tasks:
            if self.spool.claim(f"claim-{seq}", str(self.index)):
                yield seq, args

    def halted(self) -> str | None:
        """"now" or "soon" once another share has halted, else None."""
        if not self.spool.exists("halt"):
            return None
        try:
            return self.spool.read("halt")
        except OSError:
            return None

    def tell_halt(self, now: bool) -> None:
        """Make the other shares halt (they poll for the flag every 0.1 s)."""
        self.spool.write("halt", "now" if now else "soon")

    def report(self, job: Map, status: int) -> None:
        """This share's counts, for the merged exit status."""
        self.spool.write(f"node-{self.index}.json", json_dumps({
            "node": self.node, "failed": job.failed, "succeeded": job.succeeded,
            "abort": job.abort[0] if job.abort is not None else None,
            "halted_at": job.halted_at, "halted_status": job.halted_status(),
            "exit": status}))


# Each node's share runs this interpreter on the same package: no PATH lookup on the node.
SHARE_MAIN = ("import sys; from slurm_fiber.client.fibermap import main; "
              "sys.exit(main(sys.argv[1:]))")
EXIT_OTHER = 255  # GNU parallel's "other error": a node's share left no summary


def job_nodes(env: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """The nodes of the Slurm job this runs in (0 outside one)."""
    if not env.get("SLURM_JOB_ID"):
        return 0
    text = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1"
    return int(text) if text.isdigit() else 1


def run_on_nodes(opts: argparse.Namespace, argv: Sequence[str],
                 tasks: Iterator[tuple[int, Args]], nodes: int) -> int:
    """``--nodes all`` in a job of ``nodes`` nodes: one srun step, one task per node, each
    running its round-robin share through its node's fiberd; then the merged joblog, exit
    status and summary. Blocks until every share has ended."""
    import json  # only here: outside a map start's import budget
    import subprocess

    from slurm_fiber.safefs import UnsafePath

    try:
        spool = Spool.create(f".fibermap-{os.environ.get('SLURM_JOB_ID')}-")
    except (UnsafePath, OSError) as err:
        print(f"fiberctl map: cannot make the spool in {os.getcwd()}: {err}", file=sys.stderr)
        return EXIT_OTHER
    # SIGTERM to the map alone (kill, timeout): srun is stopped and the spool removed
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        spool.write("args", "".join(json_dumps([seq, list(args)], compact=True) + "\n"
                                    for seq, args in tasks))
        spool.write("argv.json", json_dumps(list(argv)))
        started = time.monotonic()
        try:
            srun = subprocess.run(
                ["srun", "--overlap", f"--nodes={nodes}", f"--ntasks={nodes}",
                 "--ntasks-per-node=1", "--input=none", "--kill-on-bad-exit=0",
                 sys.executable, "-c", SHARE_MAIN, "--node-share", spool.path,
                 str(spool.inode)], check=False)
        except KeyboardInterrupt:
            print("fiberctl map: interrupted; srun stops every node's share", file=sys.stderr)
            return 130
        shares = []
        lost = []
        for i in range(nodes):
            try:
                shares.append(json.loads(spool.read(f"node-{i}.json")))
            except (OSError, ValueError):
                lost.append(i)
        if lost and not spool.intact():
            print(f"fiberctl map: the spool {spool.path} was replaced during the map (another "
                  "user can write this directory): the nodes' shares refused it; run maps "
                  "in a directory of your own", file=sys.stderr)
            return EXIT_OTHER
        if lost and opts.split != "dynamic":
            print(f"fiberctl map: the share of node task {lost[0]} ended without a summary "
                  f"(srun exit {srun.returncode}); see srun's lines above", file=sys.stderr)
            return EXIT_OTHER
        extra = nodes
        if lost:  # dynamic: what a lost node took and did not finish runs again here
            left = unfinished(spool, lost, nodes)
            print(f"fiberctl map: the share of node task{'s' if len(lost) > 1 else ''} "
                  f"{', '.join(map(str, lost))} was lost (srun exit {srun.returncode}); its "
                  f"{len(left)} unfinished task(s) run again on this node", file=sys.stderr)
            rerun = NodeShare(spool, nodes, nodes + 1, os.environ.get("SLURMD_NODENAME")
                              or os.uname().nodename)
            fields = grant_fields(opts.grant, opts.token, opts.env)
            again = Map(rerun.options(), TaskRunner(
                discover_socket(opts.socket), grant=fields.get("grant"),  # type: ignore[arg-type]
                token=fields.get("token"), env=fields.get("env"),  # type: ignore[arg-type]
                wait=opts.wait, say=_say), iter(left), len(left), rerun)
            rerun.report(again, again.run())
            shares.append(json.loads(spool.read(f"node-{nodes}.json")))
            shares += [lost_counts(spool, i) for i in lost]  # what they finished counts
            extra = nodes + 1
        wall = time.monotonic() - started
        if opts.joblog is not None:
            rows: list[str] = [json.loads(line) for i in range(extra)
                               if spool.exists(f"joblog-{i}")
                               for line in spool.read(f"joblog-{i}").splitlines()]
            rows.sort(key=lambda r: float(r.split("\t")[2]) + float(r.split("\t")[3]))
            with open(opts.joblog, "w") as log:  # in the order tasks ended
                log.write(JOBLOG_HEADER + "".join(rows))
    finally:
        spool.remove()
    failed = sum(s["failed"] for s in shares)
    succeeded = sum(s["succeeded"] for s in shares)
    aborts = [s["abort"] for s in shares if s["abort"] is not None]
    halted = sorted((s["halted_at"], s["halted_status"]) for s in shares
                    if s["halted_at"] is not None)
    status = aborts[0] if aborts else final_status(
        opts.halt, bool(halted), halted[0][1] if halted else None, failed, succeeded)
    if opts.json:
        done = failed + succeeded
        print(json_dumps({"tasks": done, "succeeded": succeeded, "failed": failed,
                          "halted": bool(halted), "wall_s": round(wall, 3),
                          "tasks_per_s": round(done / wall, 1) if wall > 0 else None,
                          "jobs": opts.jobs, "exit": status,
                          "joblog": str(opts.joblog) if opts.joblog else None,
                          "nodes": {s["node"]: s["failed"] + s["succeeded"] for s in shares}}))
    return status


def unfinished(spool: Spool, lost: list[int], nodes: int) -> list[tuple[int, Args]]:
    """(``--split dynamic``) the tasks the ``lost`` shares took and left no joblog row
    for, and those no share took: every task that did not end, in order."""
    import json

    taken = {int(name[6:]): spool.read(name) for name in spool.names()
             if name.startswith("claim-")}
    ended = {int(json.loads(line).split("\t", 1)[0]) for i in range(nodes)
             if spool.exists(f"joblog-{i}")
             for line in spool.read(f"joblog-{i}").splitlines()}
    gone = {str(i) for i in lost}
    return [(seq, args) for seq, args in NodeShare(spool, 0, 1, "").arguments()
            if seq not in ended and (taken.get(seq) in gone or seq not in taken)]


def lost_counts(spool: Spool, index: int) -> dict[str, object]:
    """A lost share's summary, from the joblog rows it wrote before it was lost."""
    import json

    failed = succeeded = 0
    if spool.exists(f"joblog-{index}"):
        for line in spool.read(f"joblog-{index}").splitlines():
            cols = json.loads(line).split("\t")
            if cols[6] == "0" and cols[7] == "0":
                succeeded += 1
            else:
                failed += 1
    return {"node": f"lost node task {index}", "failed": failed, "succeeded": succeeded,
            "abort": None, "halted_at": None, "halted_status": None}


def final_status(halt: Halt | None, halted: bool, halted_status: int | None, failed: int,
                 succeeded: int) -> int:
    """GNU parallel's exit status over all tasks (see the module doc); ``halted_status``:
    the status of the task that made the map halt."""
    if halt is not None and halted and halt.why == "fail" and halt.count == 1 \
            and not halt.percent:
        return halted_status if halted_status is not None else 1
    if halt is not None and halt.why == "success" and halted:
        return 0
    done = failed + succeeded
    if halt is not None and halt.percent and halt.why == "fail" and done:
        return min(100, round(failed * 100 / done))  # parallel: the percentage
    return min(failed, MAX_FAILED_STATUS)


def worker_slots(jobs: int, cpus: int) -> list[tuple[int, int]]:
    """The ``jobs`` slots shared out to one worker thread per CPU (at most one per slot):
    each worker's first slot number and how many it keeps."""
    workers = max(1, min(jobs, cpus))
    shares = [jobs // workers + (1 if w < jobs % workers else 0) for w in range(workers)]
    return [(1 + sum(shares[:w]), n) for w, n in enumerate(shares)]


def window_slots(jobs: int) -> list[tuple[int, int]]:
    """The ``jobs`` slots shared out to windowed workers of at most WINDOW_SLOTS each:
    each worker's first slot number and how many it keeps."""
    return [(first, min(WINDOW_SLOTS, jobs - first + 1))
            for first in range(1, jobs + 1, WINDOW_SLOTS)]


def _read_all(fd: int) -> bytes:
    """Everything written to ``fd`` (a memfd the fiber wrote through its own offset)."""
    chunks = []
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _tag(data: bytes, args: Args) -> bytes:
    if not data:
        return data
    prefix = " ".join(args).encode() + b"\t"
    lines = data.splitlines(keepends=True)
    return b"".join(prefix + line for line in lines)


def _say(line: str) -> None:
    print(f"fiberctl map: {line}", file=sys.stderr, flush=True)


class Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one line on stderr and exit 2 (never its usage block)."""

    def error(self, message: str) -> NoReturn:
        raise fail(EXIT_USAGE, f"fiberctl map: {message} (fiberctl map --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fiberctl map", description=__doc__, formatter_class=help_formatter)
    parser.add_argument("-j", "--jobs", type=int, default=len(os.sched_getaffinity(0)),
                        metavar="N", help="tasks at once (default: usable CPUs)")
    parser.add_argument("--joblog", metavar="FILE", help="GNU parallel's joblog")
    parser.add_argument("--resume", action="store_true",
                        help="skip the tasks the --joblog has a row for; append to it")
    parser.add_argument("--resume-failed", action="store_true",
                        help="skip the tasks the --joblog logs as succeeded; append to it")
    parser.add_argument("--results", metavar="DIR",
                        help="keep each task's stdout/stderr/seq under DIR/1/<arg>/")
    parser.add_argument("--retries", type=int, default=1, metavar="K",
                        help="run a failing task up to K times (default 1)")
    parser.add_argument("--halt", type=Halt.parse, default=None, metavar="WHEN,WHY",
                        help="never (default), now|soon,fail|success|done=X or =Y%%")
    parser.add_argument("--tag", action="store_true",
                        help="prefix each output line with the arguments and a TAB")
    parser.add_argument("-k", "--keep-order", action="store_true",
                        help="print each task's output in the order of its arguments")
    parser.add_argument("--timeout", type=parse_seconds, metavar="S",
                        help="stop a task's fiber after S seconds (30, 2m, 1h)")
    parser.add_argument("-a", "--arg-file", action="append", metavar="FILE",
                        help="an input source: one argument a line (repeatable: every "
                        "combination)")
    parser.add_argument("--range", type=parse_range, metavar="A-B",
                        help="the integers A..B as arguments (no other input source)")
    parser.add_argument("--colsep", metavar="REGEX",
                        help="split each input value into columns: {1} {2} ...")
    parser.add_argument("--dry-run", action="store_true",
                        help="print each task's command instead of running it")
    for flag in ("--bar", "--eta", "--progress"):
        parser.add_argument(flag, dest="progress", action="store_const", const=flag[2:],
                            help="draw a progress " + {"--bar": "bar", "--eta": "line with "
                            "the time left", "--progress": "line"}[flag] + " on stderr")
    parser.add_argument("--call", metavar="MODULE:FUNC",
                        help="call the function in the warm interpreter, not a command")
    parser.add_argument("--json", action="store_true",
                        help="end stdout with one JSON summary line")
    parser.add_argument("--nodes", choices=["all"],
                        help="all: in a multi-node Slurm job, run each node's share (round "
                        "robin) on that node's fiberd; elsewhere: says so, runs here")
    parser.add_argument("--split", choices=["dynamic", "rr"], default="dynamic",
                        help="--nodes all: dynamic (default: a node takes the next task "
                        "when it has a free slot) or rr (round robin by sequence number)")
    parser.add_argument("--via", choices=["spool", "relay"], default="spool",
                        help="--nodes all: spool (default: each node's share reads the "
                        "tasks from the shared working directory) or relay (this map runs "
                        "every task, reaching each node's fiberd through an srun step: no "
                        "shared directory needed but for --results and --joblog)")
    parser.add_argument("-S", "--socket", metavar="PATH", help=SOCKET_HELP)
    parser.add_argument("--wait", type=parse_seconds, default=None, metavar="S",
                        help=f"wait through retryable misses (cold, capacity; in a job, a "
                        f"fiberd not listening yet) up to S seconds per task (default "
                        f"{DEFAULT_WAIT:g}), saying once on stderr what for")
    parser.add_argument("--no-wait", action="store_true",
                        help="retry a retryable miss a few times only, then stop the map")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="do not say why a fiber ended (statuses are the same)")
    parser.add_argument("-g", "--grant", help="admitted grant UID (default: the only one)")
    parser.add_argument("-t", "--token", metavar="FILE",
                        help="file holding a grant token (JWS)")
    parser.add_argument("-e", "--env", action="append", default=[], metavar="KEY=VALUE",
                        help="added to each fiber's env (repeatable)")
    return parser


def split_options(parser: argparse.ArgumentParser, words: list[str]
                  ) -> tuple[list[str], list[str]]:
    """``words`` (no ``--``) as parallel reads them: the options, then the command from
    the first word that is not one. An option this parser does not know exits 2 naming
    it (GNU parallel has many this map does not: never a silent no-op)."""
    actions = parser._option_string_actions
    at = 0
    while at < len(words) and words[at].startswith("-") and words[at] != "-":
        word = words[at]
        name = word.split("=", 1)[0] if word.startswith("--") else word[:2]
        action = actions.get(name)
        if action is None:
            raise fail(EXIT_USAGE, f"fiberctl map: {name} is not supported (a GNU parallel "
                       "option fiberctl map does not have; fiberctl map --help)")
        attached = "=" in word if word.startswith("--") else len(word) > 2
        at += 2 if action.nargs != 0 and not attached else 1
    return words[:at], words[at:]


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` after ``map``, as parallel's: options, the command (after ``--``, or from
    the first word that is no option), then the input sources (``:::`` ...)."""
    head, sources = split_sources(argv)
    parser = build_parser()
    if "--" in head:
        cut = head.index("--")
        words, cmd = head[:cut], head[cut + 1:]
        split_options(parser, words)  # names an option parallel has and this map has not
    else:
        words, cmd = split_options(parser, head)
    opts = parser.parse_args(words)
    opts.cmd, opts.sources = cmd, sources
    opts.wait_given = opts.wait is not None
    if opts.wait is None:
        opts.wait = DEFAULT_WAIT
    if opts.jobs < 1 or opts.retries < 0:
        raise fail(EXIT_USAGE, "fiberctl map: -j must be at least 1, --retries at least 0")
    if opts.retries == 0:
        opts.retries = 1
    if opts.call is None and not cmd:
        raise fail(EXIT_USAGE, "fiberctl map: give the command: fiberctl map [OPTIONS] CMD "
                   "{} ::: ARGS, or -- CMD {} (or --call MODULE:FUNC)")
    if opts.call is not None and not re.fullmatch(r"[\w.]+:[\w.]+", opts.call):
        raise fail(EXIT_USAGE, "fiberctl map: --call wants MODULE:FUNC")
    if opts.range is not None and (opts.arg_file or sources):
        raise fail(EXIT_USAGE, "fiberctl map: --range is the only input source when given")
    if (opts.resume or opts.resume_failed) and not opts.joblog:
        raise fail(EXIT_USAGE, "fiberctl map: --resume and --resume-failed read the --joblog "
                   "FILE: give it")
    if opts.via == "relay" and opts.nodes != "all":
        raise fail(EXIT_USAGE, "fiberctl map: --via relay takes effect with --nodes all "
                   "only: give both, or neither")
    if opts.nodes == "all" and opts.keep_order:
        raise fail(EXIT_USAGE, "fiberctl map: -k is not supported with --nodes all (each "
                   "node prints as its tasks end)")
    return opts


def dry_run(opts: argparse.Namespace, tasks: Iterator[tuple[int, Args]]) -> int:
    """Print each task's command (as the joblog's Command column), run nothing."""
    line = shell_line(opts.cmd) and opts.call is None
    for seq, args in tasks:
        words = command_words(opts.cmd, args, seq, 1, opts.call is not None)
        print(shown(words, opts.call, line))
    return 0


def main(argv: Sequence[str]) -> int:
    """Run ``fiberctl map``; its exit status (see the module doc)."""
    try:
        # --node-share SPOOL: run_on_nodes started this as one node's share (not for users)
        share = NodeShare.here(argv[1], argv[2]) if argv[:1] == ["--node-share"] else None
        opts = share.options() if share is not None else parse(argv)
        fields = grant_fields(opts.grant, opts.token, opts.env)
        if share is None:
            inputs, total = arguments(opts)
            skip = resumed(opts)
    except Exit as done:
        return done.code
    if share is None:
        tasks: Iterator[tuple[int, Args]] = enumerate(inputs, start=1)
        if skip:
            listed = [(seq, args) for seq, args in tasks if seq not in skip]
            tasks, total = iter(listed), len(listed)
        if opts.dry_run:
            return dry_run(opts, tasks)
    if opts.nodes == "all" and opts.via == "relay":  # (client/mapnodes.py)
        from slurm_fiber.client.mapnodes import run_across_nodes

        across = run_across_nodes(opts, fields, tasks, total, _say)
        if across is not None:
            return across
    elif opts.nodes == "all":
        nodes = job_nodes()
        if nodes > 1:
            return run_on_nodes(opts, argv, tasks, nodes)
        print("fiberctl map: --nodes all: not in a Slurm job of several nodes; "
              "running every task on this node", file=sys.stderr)
    runner = TaskRunner(discover_socket(opts.socket), grant=fields.get("grant"),  # type: ignore[arg-type]
                        token=fields.get("token"), env=fields.get("env"),  # type: ignore[arg-type]
                        wait=None if opts.no_wait else opts.wait,
                        wait_listening=in_job() or opts.wait_given, say=_say)
    if share is not None:  # its status goes in its summary; srun's own exit stays quiet
        every = list(share.arguments())
        if opts.split == "dynamic":
            job = Map(opts, runner, share.claimed(iter(every)), len(every), share)
        else:
            mine = share.mine(iter(every))
            job = Map(opts, runner, iter(mine), len(mine), share)
        share.report(job, job.run())
        return 0
    order = None
    if opts.keep_order:
        listed = list(tasks)
        tasks, order = iter(listed), [seq for seq, _ in listed]
    job = Map(opts, runner, tasks, total, order=order)
    try:
        status = job.run()
    except KeyboardInterrupt:
        print("fiberctl map: interrupted; running fibers were stopped", file=sys.stderr)
        return 130
    if opts.json:
        print(json_dumps(job.summary(status)))
    return status
