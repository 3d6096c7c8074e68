"""The audit log: one JSON line per decision, durable before the decision is answered.

``AuditLog.write(event, **fields)`` appends one record and returns its
sequence number once the line is in the file: the whole line goes out in one
``write`` on an O_APPEND descriptor, so records never interleave. A write
that fails or comes up short (a full disk) is cut back off (``ftruncate`` to
the size before) and raises ``AuditWriteFailed``: the file holds only whole
lines, and the next record after space returns starts on its own line.

The log is opened with O_NOFOLLOW | O_NONBLOCK and checked on the open fd:
a regular file with one link, owned by fiberd's uid, writable by nobody
else; anything else (a planted symlink, hard link, FIFO, another user's
file) raises ``AuditUnsafe`` and is left untouched. Each record carries ``seq`` (grows by one per
record and continues across restarts), ``time`` (Unix seconds), ``event`` and
the home's scope claims, then the caller's fields (DESIGN §4: uid, jti, fiber,
code, reason, epoch, caller_uid/caller_pid, leeway, health_age ...).

A crash can leave at most the last line torn. Opening the log repairs that:
the torn tail (bytes after the last newline) is cut off and an
``audit_repaired`` record notes how many bytes went, so a half line is never
followed by a new record. Durability follows ``fsync``: ``always`` (fsync
each record), ``interval`` (fsync when ``interval`` seconds have passed since
the last one; a power loss may drop that much, a process crash nothing) or
``never`` (the kernel decides). Under ``always``, a record that answers nobody's
decision (an observation such as a fiber's exit) may be written with
``durable=False``: it is in the file at once, as every record, and made durable
by the next fsync, that of the next decision or the caller's ``sync()``
(fiberd's runtime calls it within ``EXIT_SYNC_DELAY``), so a power loss can
drop only such records of that last moment, never a decision. Thread-safe.

Each record also carries ``prev``: the first 16 hex digits of the SHA-256 of the line
before it (of the file's last line when a restart continues the log; ``""`` for the
first line of a file). ``check_chain`` reads a log back and names the first place where
a line was edited, removed, inserted or cut, where the sequence jumps, and whether the
log ends with fiberd's stop. What it proves depends on who could write the file: a log
fiberd's own user can write (a Slurm job's) can be rewritten whole by that user, chain
and all; the chain then only shows tampering by something that did not recompute it,
and accidents (docs/design.md, threat model, rule 12).
"""

from __future__ import annotations

import enum
import errno
import hashlib
import json
import os
import stat
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slurm_fiber.core.clock import Clock, SystemClock
from slurm_fiber.core.trust.grant import ScopeClaim
from slurm_fiber.safefs import UnsafePath, open_dir, open_file

RESERVED = frozenset({"seq", "time", "event", "scope", "prev"})
PREV_HEX = 16  # hex digits of the previous line's SHA-256 each record carries
_TAIL_CHUNK = 64 * 1024


class FsyncPolicy(enum.StrEnum):
    ALWAYS = "always"
    INTERVAL = "interval"
    NEVER = "never"


class AuditEvent(enum.StrEnum):
    """Every event fiberd audits: the decisions DESIGN §4 names, then fiberd's own
    (``write`` accepts any name; use these)."""

    ADMIT = "admit"
    REFUSE = "refuse"
    LIFT = "lift"
    REMOVE = "remove"
    EXPIRE = "expire"
    CLONE = "clone"
    MISS = "miss"
    RELEASE = "release"
    EPOCH_BUMP = "epoch_bump"
    SCOPE_LOSS = "scope_loss"
    AUDIT_REPAIRED = "audit_repaired"
    # the core's templates and fibers
    ENFORCEMENT = "enforcement"
    WARM_FAILED = "warm_failed"
    TEMPLATE_LOST = "template_lost"
    CLONE_FAILED = "clone_failed"
    FIBER_EXIT = "fiber_exit"
    # task windows (core/runtime/task_window.py)
    WINDOW_OPEN = "window_open"
    WINDOW_CLOSE = "window_close"
    FIBER_START = "fiber_start"
    # the daemon around it
    START = "start"
    STOP = "stop"
    PROBLEM = "problem"
    API_REFUSE = "api_refuse"


class AuditUnsafe(OSError):
    """The audit log path is not a file fiberd may write (one line naming it and why)."""

    def __str__(self) -> str:
        return self.strerror or str(self.args[0])


class AuditWriteFailed(OSError):
    """A record could not be written (nothing of it is left in the file); retry later."""

    def __str__(self) -> str:
        return self.strerror or str(self.args[0])


def open_log(path: Path) -> int:
    """Open (create 0600) the audit log at ``path`` for appending, through
    ``slurm_fiber.safefs``: its directory walked from "/" and trusted (owned by root or
    fiberd's uid, writable by nobody else), the log itself fiberd's own regular file of
    one link that nobody else may write (a planted symlink, FIFO, hard link or another
    user's file is refused, never followed). Raises AuditUnsafe (one line) or OSError."""
    euid = os.geteuid()
    where = Path(os.path.abspath(path))
    try:
        dir_fd = open_dir(where.parent, trusted_owners=(euid,))
        try:
            fd = open_file(dir_fd, where.name, os.O_RDWR | os.O_APPEND | os.O_CREAT,
                           mode=0o600, owners=(euid,))
        finally:
            os.close(dir_fd)
    except UnsafePath as err:
        raise AuditUnsafe(f"audit log {path}: {err}; not writing to it") from None
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if mode & 0o022:
        os.close(fd)
        raise AuditUnsafe(f"audit log {path} is writable by others (mode {mode:04o}); "
                          "not writing to it")
    os.set_blocking(fd, True)
    return fd


def _jsonable(value: object) -> object:
    to_json = getattr(value, "to_json", None)
    if callable(to_json):
        return to_json()
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    return str(value)


class AuditLog:
    """An append-only JSON-lines file. Opening repairs a torn tail; ``write`` blocks until written.

    Raises OSError when the file cannot be opened or written (the caller must
    then not give the decision: an unaudited decision is not made).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        fsync: FsyncPolicy | str = FsyncPolicy.ALWAYS,
        *,
        interval: float = 1.0,
        clock: Clock | None = None,
        scope: Sequence[ScopeClaim] = (),
    ) -> None:
        self.path = Path(path)
        self.fsync = FsyncPolicy(fsync)
        self.interval = interval
        self._clock = clock or SystemClock()
        self._scope = {c.key: c.value for c in scope}
        self._lock = threading.Lock()
        self._fd = open_log(self.path)
        self._last_fsync = self._clock.mono()
        self._unsynced = False
        self._appended = 0  # appends made: an fsync begun after the n-th covers it
        dropped = self._repair_tail()
        self._prev = ""  # the chain link the next record carries (module doc)
        self._seq = self._last_seq()
        if dropped:
            self.write(AuditEvent.AUDIT_REPAIRED, bytes_dropped=dropped,
                       reason="torn last line from a crash was cut off")

    @property
    def seq(self) -> int:
        """The sequence number of the last record written (0 for an empty log)."""
        return self._seq

    @property
    def unsynced(self) -> bool:
        """Whether records written with ``durable=False`` still wait for their fsync."""
        return self._unsynced

    @property
    def appended(self) -> int:
        """How many appends were made (each ``write_many`` that wrote is one)."""
        return self._appended

    def fileno(self) -> int:
        """The log's descriptor, for an fsync made elsewhere (core/audit_syncer.py)."""
        return self._fd

    def synced_through(self, appended: int) -> None:
        """An fsync made elsewhere, begun after the ``appended``-th append, has ended: the
        records ``durable=False`` left waiting are durable unless more were appended."""
        with self._lock:
            if self._appended == appended:
                self._unsynced = False
                self._last_fsync = self._clock.mono()

    def set_scope(self, scope: Sequence[ScopeClaim]) -> None:
        """Replace the scope claims stamped on every following record."""
        with self._lock:
            self._scope = {c.key: c.value for c in scope}

    def write(self, event: str, **fields: Any) -> int:
        """Append one record and return its seq once written (and fsynced per the policy).

        ``fields`` must not use the reserved names seq, time, event, scope
        (ValueError). Values that are not JSON are written via ``to_json()`` or ``str``.
        """
        return self.write_many([(event, fields)])

    def write_many(self, records: Sequence[tuple[str, Mapping[str, Any]]], *,
                   durable: bool = True) -> int:
        """Append several records (event, fields) as ``write`` does each, in one write and
        one fsync: each whole and on its own line, with consecutive seqs; all or none
        (AuditWriteFailed, and the seq is not advanced). Returns the last seq.

        ``durable=False`` (observations only, never a decision): under ``always``, the
        fsync is left to the next durable record or ``sync()``."""
        for _, fields in records:
            clash = RESERVED.intersection(fields)
            if clash:
                raise ValueError(f"audit field name {sorted(clash)[0]!r} is reserved")
        with self._lock:
            lines: list[bytes] = []
            for n, (event, fields) in enumerate(records, self._seq + 1):
                record: dict[str, Any] = {
                    "seq": n, "time": round(self._clock.wall(), 6), "event": str(event),
                }
                if self._scope:
                    record["scope"] = self._scope
                record["prev"] = self._prev if not lines else link(lines[-1])
                record.update(fields)
                lines.append(json.dumps(record, default=_jsonable, separators=(",", ":"))
                             .encode())
            if lines:
                self._append(b"\n".join(lines) + b"\n", durable)
                self._seq += len(lines)
                self._prev = link(lines[-1])
            return self._seq

    def sync(self) -> None:
        """Fsync now if records written with ``durable=False`` wait for it (else nothing).

        Blocks for one fsync; raises OSError when it fails (the records stay in the file,
        their durability unknown).
        """
        with self._lock:
            if self._unsynced and self._fd >= 0:
                self._unsynced = False
                os.fsync(self._fd)
                self._last_fsync = self._clock.mono()

    def close(self) -> None:
        """Flush to disk and close. Further writes raise OSError."""
        with self._lock:
            if self._fd >= 0:
                fd, self._fd = self._fd, -1
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def _append(self, data: bytes, durable: bool) -> None:
        """One whole line, or nothing (cut back to the size before) and AuditWriteFailed."""
        if self._fd < 0:
            raise AuditWriteFailed(errno.EBADF, f"audit log {self.path} is closed")
        before = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"short write ({written} of {len(data)} bytes)")
            self._appended += 1
            now = self._clock.mono()
            due = self.fsync is FsyncPolicy.INTERVAL and now - self._last_fsync >= self.interval
            if self.fsync is FsyncPolicy.ALWAYS and not durable:
                self._unsynced = True
            elif self.fsync is FsyncPolicy.ALWAYS or due:
                os.fsync(self._fd)
                self._unsynced = False
                self._last_fsync = now
        except OSError as err:
            cut = ""
            try:
                os.ftruncate(self._fd, before)
            except OSError as again:
                cut = f"; and cutting it back failed: {again.strerror or again}"
            raise AuditWriteFailed(err.errno, f"audit log {self.path}: record not written "
                                   f"({err.strerror or err}){cut}") from None

    def _repair_tail(self) -> int:
        size = os.fstat(self._fd).st_size
        if size == 0 or os.pread(self._fd, 1, size - 1) == b"\n":
            return 0
        end = size
        while end > 0:
            start = max(0, end - _TAIL_CHUNK)
            newline = os.pread(self._fd, end - start, start).rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            end = start
        else:
            keep = 0
        os.ftruncate(self._fd, keep)
        os.fsync(self._fd)
        return size - keep

    def _last_seq(self) -> int:
        size = os.fstat(self._fd).st_size
        want = _TAIL_CHUNK
        while True:
            start = max(0, size - want)
            lines = os.pread(self._fd, size - start, start).split(b"\n")
            complete = lines if start == 0 else lines[1:]  # the first may be cut by the window
            for line in reversed(complete):
                seq = _seq_of(line)
                if seq is not None:
                    self._prev = link(line)
                    return seq
            if start == 0:
                return 0
            want *= 4


def link(line: bytes) -> str:
    """The chain link of ``line`` (without its newline): what the next record's ``prev``
    holds."""
    return hashlib.sha256(line).hexdigest()[:PREV_HEX]


@dataclass
class ChainCheck:
    """What ``check_chain`` found in a log: its lines, the first and last seq, whether it
    ends with fiberd's stop, and each problem (one line; at most ``MAX_PROBLEMS``)."""

    lines: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    stopped: bool = False
    problems: list[str] = field(default_factory=list)

    MAX_PROBLEMS = 20

    @property
    def consistent(self) -> bool:
        return not self.problems and self.stopped

    def to_json(self) -> dict[str, object]:
        return {"lines": self.lines, "first_seq": self.first_seq, "last_seq": self.last_seq,
                "ends_with_stop": self.stopped, "consistent": self.consistent,
                "problems": list(self.problems)}


def check_chain(lines: Iterable[bytes]) -> ChainCheck:
    """Check audit lines (without newlines, in file order; a torn last line included as
    read) as ``AuditLog`` writes them: JSON records, each ``seq`` one more than the last
    and each ``prev`` the link of the line before. Pure; never raises."""
    out = ChainCheck()
    before: bytes | None = None
    for number, line in enumerate(lines, 1):
        out.lines = number
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        seq = rec.get("seq") if isinstance(rec, dict) else None
        if not isinstance(rec, dict) or not isinstance(seq, int) or isinstance(seq, bool):
            _problem(out, f"line {number} is not an audit record")
            before, out.stopped = line, False
            continue
        if out.first_seq is None:
            out.first_seq = seq
            if seq != 1:
                _problem(out, f"the log begins at seq {seq}: the records before it are gone")
        elif out.last_seq is not None and seq != out.last_seq + 1:
            _problem(out, f"line {number}: seq {seq} follows {out.last_seq}")
        if before is not None and rec.get("prev") != link(before):
            _problem(out, f"line {number} does not chain to the line before it (a line "
                          "was edited, removed or inserted)")
        out.last_seq = seq
        out.stopped = rec.get("event") == AuditEvent.STOP
        before = line
    return out


def _problem(check: ChainCheck, text: str) -> None:
    if len(check.problems) < ChainCheck.MAX_PROBLEMS:
        check.problems.append(text)


def _seq_of(line: bytes) -> int | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    seq = record.get("seq") if isinstance(record, dict) else None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None
