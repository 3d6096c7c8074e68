"""``slurm-fiber audit``: fiberd's audit log, read by people (or passed through as JSON).

The log is the one ``core.audit.AuditLog`` writes: one JSON object per
line with ``seq``, ``time``, ``event`` and the decision's fields. This
command prints one aligned line per record (time, seq, event, uid, fiber,
code, then the other fields as ``key=value``, reason last), or with
``--json`` the records' own lines unchanged. Control characters in values
(a newline or an escape sequence inside a claim) are printed escaped
(``\\n``, ``\\u001b``) in the text view; the JSON view is escaped already
(fiberd writes ASCII-only JSON and a line with a raw control character is
not a record). ``--since SEQ`` keeps records
after that sequence number; ``--event NAME`` (repeatable) keeps those
events. ``--follow`` keeps reading what is appended, like ``tail -f``: a
last line still being written is waited for, never half-read; a log that is
truncated or replaced is read again from its start (said once on stderr).
A line that is not a record (junk, or a torn last line at the end of a
non-followed read) is reported once on stderr with its line number and
skipped; it never stops the reading.

Exit codes: 0 read (also after Ctrl-C ends ``--follow``, or when the reader
of the output goes away, as with ``| head``); 1 the log cannot be read (one
line says why); 2 usage error.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import typer

from slurm_fiber.defaults import AUDIT_NAME, STATE_DIR

FOLLOW_POLL = 0.2
MAX_REPORTED = 20
CHUNK = 1 << 16
COLUMNS = (("time", 24), ("seq", 7), ("event", 14), ("uid", 16), ("fiber", 12), ("code", 14))
LEADING = {name for name, _ in COLUMNS} | {"reason", "scope"}

HELP = (
    "Read fiberd's audit log: one aligned line per decision.\n\n"
    'The log is --path FILE, else STATE_DIR/audit.jsonl for --state-dir (defaults: '
    '$FIBERD_AUDIT_PATH, then $FIBERD_STATE_DIR/audit.jsonl, then '
    '/var/lib/slurm-fiber/audit.jsonl). Columns: time (UTC), seq, event, uid, fiber, code, '
    'then the other fields as key=value and the reason last.\n\n'
    '  slurm-fiber audit --path /tmp/slurm-fiber-quickstart-x/audit.jsonl\n'
    '  slurm-fiber audit --follow --event miss --event refuse\n'
    '  slurm-fiber audit --json --since 1200 | jq .\n\n'
    'Junk or torn lines are reported once on stderr and skipped. Exit codes: 0 read (also '
    'when Ctrl-C ends --follow); 1 the log cannot be read; 2 usage error.'
)


@dataclass
class Selection:
    """Which records to show: after ``since`` (a seq), of ``events`` (empty: all)."""

    since: int | None = None
    events: frozenset[str] = frozenset()

    def __call__(self, record: dict[str, object]) -> bool:
        seq = record["seq"]
        if self.since is not None and isinstance(seq, int) and seq <= self.since:
            return False
        return not self.events or record["event"] in self.events


@dataclass
class Problems:
    """Bad lines, each reported once on stderr (the first MAX_REPORTED, then a count)."""

    path: Path
    count: int = 0
    say: Callable[[str], None] = field(default=lambda line: typer.echo(line, err=True))

    def bad(self, lineno: int, why: str) -> None:
        self.count += 1
        if self.count <= MAX_REPORTED:
            self.say(f"audit: {self.path}:{lineno}: {why}; skipped")
        elif self.count == MAX_REPORTED + 1:
            self.say(f"audit: {self.path}: more bad lines; not reported one by one")


def parse_record(line: bytes) -> dict[str, object] | str:
    """The record on ``line`` (no newline), or why it is not one."""
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return "not a JSON record"
    if not isinstance(record, dict):
        return "not a JSON object"
    seq, event = record.get("seq"), record.get("event")
    if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(event, str):
        return "a JSON object without an integer seq and a string event"
    return record


# Characters that could move the cursor, end a line or drive the terminal: C0, DEL, C1,
# and the Unicode line and paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape(text: str) -> str:
    """``text`` with every control character written as its JSON escape (``\\n``,
    ``\\u001b``): a value from a claim can never start a line of its own or drive the
    terminal."""
    return _CONTROL.sub(lambda m: json.dumps(m.group())[1:-1], text)


def _text(value: object) -> str:
    return escape(value) if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def format_time(value: object) -> str:
    """A record's Unix time as ``YYYY-MM-DDTHH:MM:SS.mmmZ``; shown as it is if not a number."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            stamp = datetime.fromtimestamp(value, UTC)
        except (OverflowError, OSError, ValueError):
            return _text(value)
        return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"
    return _text(value)


def header() -> str:
    return " ".join(f"{name.upper():<{width}}" for name, width in COLUMNS) + " DETAILS"


def format_record(record: dict[str, object]) -> str:
    """One aligned line: the columns, the other fields as key=value, the reason last."""
    cells = [format_time(record.get("time"))]
    cells += ["-" if record.get(name) is None else _text(record[name])
              for name, _ in COLUMNS[1:]]
    line = " ".join(f"{cell:<{width}}" for cell, (_, width) in zip(cells, COLUMNS, strict=True))
    rest = [f"{escape(k)}={_text(v)}" for k, v in record.items() if k not in LEADING]
    reason = record.get("reason")
    if reason is not None:  # quoted as JSON, which escapes control characters itself
        rest.append(f"reason={json.dumps(reason if isinstance(reason, str) else _text(reason))}")
    return f"{line} {' '.join(rest)}".rstrip()


def open_regular(path: Path) -> int:
    """A read fd of the regular file ``path``; a FIFO or device never blocks the reader
    (O_NONBLOCK), it is refused (OSError)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return fd


class LogReader:
    """Complete lines of a log file from where the last read stopped.

    Only whole lines are consumed: a last line without its newline stays in
    the file for the next ``read`` (``tail`` is what it holds so far). If the
    file shrinks below what was consumed, or another file takes its path,
    reading starts again from the top (``restarted`` says so).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = open_regular(path)  # OSError: the caller reports it
        self.inode = os.fstat(self.fd).st_ino
        self.consumed = 0
        self.lineno = 0
        self.tail = b""

    def close(self) -> None:
        os.close(self.fd)

    def restart_if_replaced(self) -> str | None:
        """Reopen or rewind when the log was replaced or truncated; why, or None."""
        try:
            inode = os.stat(self.path).st_ino
        except FileNotFoundError:
            return None  # gone for now: keep the old file until a new one appears
        why = None
        if inode != self.inode:
            os.close(self.fd)
            self.fd = open_regular(self.path)
            self.inode = inode
            why = "the log was replaced"
        elif os.fstat(self.fd).st_size < self.consumed:
            why = "the log was truncated"
        if why:
            self.consumed, self.lineno, self.tail = 0, 0, b""
        return why

    def read(self) -> Iterator[tuple[int, bytes]]:
        """(line number, line) for each complete line appended since the last read."""
        while True:
            data = os.pread(self.fd, CHUNK, self.consumed + len(self.tail))
            if not data:
                return
            data = self.tail + data
            *lines, self.tail = data.split(b"\n")
            for line in lines:
                self.consumed += len(line) + 1
                self.lineno += 1
                yield self.lineno, line


def audit_path(path: Path | None, state_dir: Path | None, environ: dict[str, str]) -> Path:
    """The log to read: --path, --state-dir, $FIBERD_AUDIT_PATH, $FIBERD_STATE_DIR, default."""
    if path is not None:
        return path
    if state_dir is not None:
        return state_dir / AUDIT_NAME
    if environ.get("FIBERD_AUDIT_PATH"):
        return Path(environ["FIBERD_AUDIT_PATH"])
    return Path(environ.get("FIBERD_STATE_DIR") or STATE_DIR) / AUDIT_NAME


def show(lines: Iterable[tuple[int, bytes]], select: Selection, problems: Problems,
         as_json: bool) -> None:
    """Print the selected records of ``lines``; report the bad ones."""
    for lineno, line in lines:
        if not line.strip():
            continue
        record = parse_record(line)
        if isinstance(record, str):
            problems.bad(lineno, record)
        elif select(record):
            typer.echo(line.decode() if as_json else format_record(record))


def read_log(reader: LogReader, select: Selection, problems: Problems, as_json: bool,
             follow: bool) -> None:
    """Print what the log holds; with ``follow``, keep printing what is appended (until
    interrupted). Blocks."""
    show(reader.read(), select, problems, as_json)
    while follow:
        time.sleep(FOLLOW_POLL)
        why = reader.restart_if_replaced()
        if why:
            problems.say(f"audit: {why}; reading {reader.path} from its start")
        show(reader.read(), select, problems, as_json)
    if reader.tail.strip():
        problems.bad(reader.lineno + 1, f"torn last line ({len(reader.tail)} bytes, "
                                         "no newline)")


def audit_command(
    path: Path | None = typer.Option(None, "--path", metavar="FILE",
                                     help="The audit log file.", dir_okay=False),
    state_dir: Path | None = typer.Option(None, "--state-dir", metavar="DIR",
                                          help="fiberd's state dir (reads DIR/audit.jsonl)."),
    follow: bool = typer.Option(False, "--follow", "-f",
                                help="Keep printing appended records (Ctrl-C stops)."),
    as_json: bool = typer.Option(False, "--json", help="Print the records' JSON lines as "
                                                       "they are."),
    since: int | None = typer.Option(None, "--since", metavar="SEQ", min=0,
                                     help="Only records after sequence number SEQ."),
    event: list[str] = typer.Option([], "--event", metavar="NAME",
                                    help="Only this event (repeatable: any of them)."),
) -> None:
    if path is not None and state_dir is not None:
        typer.echo("audit: give --path or --state-dir, not both", err=True)
        raise typer.Exit(2)
    log = audit_path(path, state_dir, dict(os.environ))
    try:
        reader = LogReader(log)
    except OSError as err:
        typer.echo(f"audit: cannot read {log}: {err.strerror or err}{_hint(log, err)}",
                   err=True)
        raise typer.Exit(1) from None
    if not as_json:
        typer.echo(header())
    try:
        read_log(reader, Selection(since, frozenset(event)), Problems(log), as_json, follow)
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # the reader went away (| head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    except OSError as err:
        typer.echo(f"audit: reading {log} failed: {err.strerror or err}", err=True)
        raise typer.Exit(1) from None
    finally:
        reader.close()


def _hint(log: Path, err: OSError) -> str:
    """What to do about a log that cannot be opened (after "; "), or nothing."""
    if isinstance(err, NotADirectoryError):
        return f"; {log.parent} is not fiberd's state dir (give --state-dir a directory)"
    if isinstance(err, FileNotFoundError):
        return ("; no audit log there: give --path the log or --state-dir fiberd's state dir "
                "(fiberctl status shows audit_path)")
    if isinstance(err, PermissionError):
        return "; the log is fiberd's user's (mode 0600): read it as that user or root"
    return ""
