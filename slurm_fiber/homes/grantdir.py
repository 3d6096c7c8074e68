"""grantdir: grants delivered to every file-fed home from a polled directory.

A ``GrantDir`` polls a directory for ``*.jwt`` files (polling is the contract). A new
file, or one whose content changed (compared by content hash), delivers GRANT_ADDED
with its raw token and its origin (``GrantOrigin``: the file's path and owner); a UID
no longer held by any file delivers GRANT_REMOVED. The grantdir never reads a token's
claims: which UID a file holds is what the core verified its token to name, handed
back through the origin's ``held``. Until then (and for a token that fails
verification) the file holds nothing new: a forged file naming another grant never
keeps that grant held.

- Bounded work: ``scan`` works in slices of ``SLICE`` names and yields to the loop
  between slices; a file whose stat signature is that of its last reading is not read
  again (remembered only once its mtime is ``RACY_NS`` old, never for a followed link).
- Hostile input never crashes it: junk, partial, unreadable, oversized (over 64 KiB)
  files, symlinks, subdirectories and strangers' files are reported once each, until
  they change, and skipped. A file that turns bad keeps holding the UID of its last
  good token; deleting the file withdraws the grant. Names starting with "." are never
  read (write ``.name.tmp`` and rename). A directory writable by group or others, owned
  by someone other than the expected owner or root, or below one another user could
  change, is refused.
- A missing or unreadable directory is an outage, not a refusal: reported once, the
  home's ``SourceHealth`` (when given) is marked down, so Clones miss with the
  retryable ``source_stale``, and it is polled until it appears.
- ``follow_symlinks`` follows links that resolve inside the directory.
  ``secret_volume`` reads a Kubernetes Secret volume as the kubelet lays it out
  (``..data`` swapped atomically): a link is followed only into the ``..data`` named
  now, a link the swap left dangling keeps its last UID unreported, so one rotation
  yields exactly one GRANT_ADDED and no spurious GRANT_REMOVED; the volume's mode 1777
  directory is accepted only on a read-only mount.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hashlib
import os
import stat
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from slurm_fiber.core.book.health import SourceHealth
from slurm_fiber.core.clock import Clock
from slurm_fiber.core.seam import GrantEvent, GrantOrigin
from slurm_fiber.errors import CodedError
from slurm_fiber.homes.problem import Problem, ProblemSink, log_problem
from slurm_fiber.safefs import UnsafePath, open_dir, read_upto

MAX_TOKEN_BYTES = 64 * 1024
GRANT_SUFFIX = ".jwt"
_DIR_SUBJECT = "."  # the subject of problems with the directory itself
DATA_LINK = "..data"  # the kubelet's symlink to a Secret volume's current payload
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
MISSING = "grantdir_missing"  # the code of a directory that is not there (or cannot be stat'ed)
SLICE = 16  # names read per step of a scan; the event loop runs other work between steps
# A file modified less than this before it was read is read again next poll: a rewrite
# within one tick of the file system's clock would keep its mtime ("racy git").
RACY_NS = 2_000_000_000


class GrantDirRefused(CodedError):
    """The grantdir cannot be trusted or read: ``code`` to key on, ``reason`` for people."""


@dataclass(frozen=True)
class _Held:
    """A file's last reading delivered: its content hash and the UID its last verified
    token named (None until one was verified)."""

    digest: bytes
    uid: str | None


@dataclass(frozen=True)
class _Token:
    """A readable file's content and its owner, as read."""

    data: bytes
    owner: int


@dataclass(frozen=True)
class _Bad:
    """A file skipped this poll; ``version`` tells a changed bad file from the same one."""

    code: str
    reason: str
    version: object


class _Gone(Exception):
    """The file vanished between listing and reading."""


class _InFlux:
    """A Secret volume's link to a key the current ``..data`` lacks: mid-swap, not a problem."""


_IN_FLUX = _InFlux()


class _Same:
    """A file whose stat signature is the one remembered from its last reading: unchanged."""


_SAME = _Same()
_Reading = _Token | _Bad | _InFlux | _Same


_B64URL = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def jws_shaped(data: bytes) -> bool:
    """Whether ``data`` has a compact JWS's shape (three base64url parts, the payload
    and header non-empty, surrounding whitespace ignored); nothing in it is decoded."""
    parts = data.strip().split(b".")
    return (len(parts) == 3 and bool(parts[0]) and bool(parts[1])
            and all(set(part) <= _B64URL for part in parts))


def _stat_version(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns)


_Signature = tuple[int, int, int, int, int, int]


def _signature(st: os.stat_result) -> _Signature:
    """What must stay the same for a file not to be read again: a rename, write, chmod or
    chown changes at least one of these (a write changes mtime and ctime)."""
    return (st.st_ino, st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _inside(root: str, path: str) -> bool:
    """Whether ``path`` lies strictly below ``root`` (both absolute, resolved)."""
    return path != root and os.path.commonpath([root, path]) == root


def _mounted_read_only(path: str) -> bool:
    """Whether the filesystem holding ``path`` is mounted read-only (False when unknown)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


class GrantDir:
    """One polled grant directory. Not thread-safe; poll it from one task.

    ``owner`` is the uid expected to own the directory and its files
    (default: this process's effective uid; root is always accepted).
    ``on_problem`` receives each skipped file or directory problem once
    until it changes; it must not raise. ``secret_volume`` reads a
    Kubernetes Secret volume (see the module text; it implies following
    symlinks, only into ``..data``). ``health`` is marked down while the
    directory is missing, unreadable or refused, and up once a poll lists it;
    construction already checks the directory once (one stat), so a fiberd
    whose grantdir is missing reads stale before its socket answers anyone.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        clock: Clock,
        interval: float = 1.0,
        *,
        on_problem: ProblemSink = log_problem,
        follow_symlinks: bool = False,
        secret_volume: bool = False,
        owner: int | None = None,
        health: SourceHealth | None = None,
    ) -> None:
        if interval <= 0:
            raise ValueError("grantdir interval must be a positive number of seconds")
        self.path = os.fspath(path)
        self.clock = clock
        self.interval = interval
        self.follow_symlinks = follow_symlinks or secret_volume
        self.secret_volume = secret_volume
        self.owner = os.geteuid() if owner is None else owner
        self._on_problem = on_problem
        self._health = health
        self._files: dict[str, _Held] = {}
        self._released: set[str] = set()  # UIDs a verified rewrite stopped holding
        self._announced: set[str] = set()  # ... and already removed during this scan
        self._known: dict[str, _Signature] = {}  # name -> signature of its last settled reading
        self._reports = 0  # problems reported so far (scan yields to the loop after each)
        self._reported: dict[str, tuple[str, object]] = {}
        if health is not None:
            try:
                self.check()
            except GrantDirRefused as err:  # reported (or raised) by check_at_start, later
                health.mark_down(self.path, err.reason)

    def check(self) -> None:
        """Raise GrantDirRefused unless the directory exists and only its owner can write it.

        A Secret volume may be writable by anyone when it is mounted read-only.
        """
        try:
            st = os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError) as err:
            raise GrantDirRefused(MISSING, f"grantdir {self.path}: {err.strerror}") from None
        except OSError:
            pass  # e.g. not readable: the listing says so, as for any directory
        if not stat.S_ISDIR(st.st_mode):
            raise GrantDirRefused("grantdir_not_dir", f"grantdir {self.path} is not a directory")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (
            self.secret_volume and _mounted_read_only(self.path)
        ):
            raise GrantDirRefused(
                "grantdir_writable",
                f"grantdir {self.path} is writable by group or others "
                f"(mode {stat.S_IMODE(st.st_mode):04o}); run: chmod go-w {self.path}",
            )
        if st.st_uid not in (self.owner, 0):
            raise GrantDirRefused(
                "grantdir_owner",
                f"grantdir {self.path} is owned by uid {st.st_uid}, not {self.owner} or root; "
                f"run: chown {self.owner} {self.path}",
            )
        if not self.secret_volume:  # a kubelet's volume: its mount is checked above
            self._check_path()

    def _check_path(self) -> None:
        """Refuse a directory whose path another user could change: every component from
        "/" (a symlink included) must be the owner's or root's and writable by nobody
        else (a root-owned sticky dir such as /tmp may be an ancestor; safefs.open_dir).
        Otherwise that user could swap the directory between two polls."""
        try:
            os.close(open_dir(os.path.abspath(self.path), trusted_owners=(self.owner,)))
        except UnsafePath as err:
            raise GrantDirRefused("grantdir_path",
                                  f"grantdir {self.path}: {err}; use a directory whose "
                                  f"every parent only uid {self.owner} or root can change"
                                  ) from None
        except (FileNotFoundError, NotADirectoryError) as err:
            raise GrantDirRefused(MISSING, f"grantdir {self.path}: {err.strerror}") from None
        except OSError:
            pass  # e.g. not readable: the listing says so, as for any directory

    def check_at_start(self) -> None:
        """The check before delivery starts: raise GrantDirRefused for a directory that
        exists and is refused (marking the health down); a missing one is reported, the
        health marked down, and delivery waits for it (polling). Never blocks long."""
        try:
            self.check()
        except GrantDirRefused as err:
            self._down(err.code, err.reason)
            if err.code != MISSING:
                raise

    def deliveries(self) -> AsyncIterator[GrantEvent]:
        """A file-fed home's whole ``grants()``: the directory checked now, then ``events``.

        Raises GrantDirRefused at once for a directory that exists and is
        refused; a missing one is waited for, the health stale meanwhile.
        """
        self.check_at_start()
        return self.events()

    def uids(self) -> set[str]:
        """The UIDs the files hold: what their last verified tokens named."""
        return {held.uid for held in self._files.values() if held.uid is not None}

    def _held(self, name: str, digest: bytes, uid: str) -> None:
        """The core verified the token of ``name`` read as ``digest`` to name ``uid``: the
        file holds ``uid`` now. A UID the file held before and no file holds any more is
        removed at the next scan. A later rewrite of the file makes this a no-op."""
        held = self._files.get(name)
        if held is None or held.digest != digest or held.uid == uid:
            return
        before = self.uids()
        self._files[name] = _Held(digest, uid)
        self._released |= before - self.uids()

    def poll(self) -> list[GrantEvent]:
        """Look at the directory once and return what changed since the last poll.

        Blocks on file I/O (small reads; unchanged files are not read again).
        Never raises: a directory that fails ``check`` or cannot be listed is
        reported, and the poll delivers nothing and forgets nothing.
        """
        return [step for step in self._steps() if step is not None]

    def poll_each(self) -> Iterator[GrantEvent]:
        """``poll`` one event at a time, as ``events`` delivers them: a consumer that hands a
        GRANT_ADDED's verified UID back (``GrantOrigin.held``) before asking for the next
        event gets the removals that follow from it, each UID's in its turn."""
        for step in self._steps():
            if step is not None:
                yield step
                yield from self.released()

    async def scan(self) -> list[GrantEvent]:
        """``poll`` for the event loop: the same result, worked in slices of ``SLICE``
        names with the loop free to run other work between two slices, and after
        each reported problem (fiberd audits each one, an fsync).

        So a directory of thousands of files never holds the loop longer than
        one slice of reads (unchanged files cost one lstat each) plus one
        report. It yields with ``asyncio.sleep(0)``, never on a clock, so an
        injected clock's ``settle`` runs a small scan to its end. Cancelled
        while yielding, it leaves the files read so far taken and the rest for
        the next scan. Never raises but cancellation.
        """
        added: list[GrantEvent] = []
        for step in self._steps():
            if step is None:
                await asyncio.sleep(0)
            else:
                added.append(step)
        return added

    def _steps(self) -> Iterator[GrantEvent | None]:
        """One look at the directory, as steps: each event it delivers (removals last),
        and None where the loop may run other work (between slices, after a report)."""
        listing = self._listing()
        if isinstance(listing, GrantDirRefused):
            self._down(listing.code, listing.reason)
            return
        self._reported.pop(_DIR_SUBJECT, None)
        if self._health is not None:
            self._health.mark_up(self.path)
        before = self.uids()
        self._announced.clear()
        present: set[str] = set()
        for start in range(0, len(listing), SLICE):
            if start:
                yield None
            for reading in self._readings(listing[start:start + SLICE]):
                event, reported = self._apply(reading, present)
                if event is not None:
                    yield event
                if reported:
                    yield None
        yield from self._forget_absent(before, present)

    async def events(self) -> AsyncIterator[GrantEvent]:
        """Deliver events forever: a scan at once, then one every ``interval`` of the clock.

        Raises GrantDirRefused before the first scan when the directory is
        refused (``check_at_start``); a missing directory is waited for, and
        later failures are reported and skipped. Ends only when cancelled.
        """
        self.check_at_start()
        while True:
            # The steps are taken as delivered, so each removal (a rewrite's, once its new
            # token is verified; the vanished files', last) is judged on what the files
            # hold after everything before it was delivered.
            for step in self._steps():
                if step is None:
                    await asyncio.sleep(0)
                    continue
                yield step
                for removed in self.released():
                    yield removed
            await self.clock.sleep(self.interval)

    def _listing(self) -> list[str] | GrantDirRefused:
        """The grant file names, sorted, or why the directory cannot deliver. Blocks
        (stat and list); reports nothing."""
        try:
            self.check()
            return sorted(n for n in os.listdir(self.path) if self._is_grant_name(n))
        except GrantDirRefused as err:
            return err
        except OSError as err:
            return GrantDirRefused("grantdir_unreadable",
                                   f"grantdir {self.path} cannot be listed: {err.strerror}")

    def _readings(self, names: list[str]) -> list[tuple[str, _Reading, _Signature | None]]:
        """Read each of ``names`` (those still there). Blocks on file I/O; changes nothing."""
        out: list[tuple[str, _Reading, _Signature | None]] = []
        for name in names:
            try:
                out.append((name, *self._read(name)))
            except _Gone:
                continue
        return out

    def _apply(self, reading: tuple[str, _Reading, _Signature | None],
               present: set[str]) -> tuple[GrantEvent | None, bool]:
        """Take or report one reading, remembering its settled signature; the GRANT_ADDED
        it delivers, and whether a problem was reported. Adds its name to ``present``."""
        name, content, signature = reading
        present.add(name)
        if isinstance(content, _Same | _InFlux):
            return None, False
        reports = self._reports
        event = None
        if isinstance(content, _Bad):
            self._report(name, content)
        else:
            event = self._take(name, content)
        if signature is None:
            self._known.pop(name, None)
        else:
            self._known[name] = signature
        return event, self._reports > reports

    def _forget_absent(self, before: set[str], present: set[str]) -> list[GrantEvent]:
        """Forget the files no longer there; a GRANT_REMOVED for each UID no file holds."""
        for name in set(self._files) - present:
            del self._files[name]
        for name in set(self._known) - present:
            del self._known[name]
        for name in set(self._reported) - present - {_DIR_SUBJECT}:
            del self._reported[name]
        gone = ((before - self._announced) | self._released) - self.uids()
        self._released.clear()
        self._announced.clear()
        return [GrantEvent.removed(uid) for uid in sorted(gone)]

    def released(self) -> list[GrantEvent]:
        """A GRANT_REMOVED for each UID a file stopped holding when its rewritten token was
        verified to name another (``GrantOrigin.held``), once. ``events`` and ``poll_each``
        deliver them right after the GRANT_ADDED that released them."""
        gone = sorted(self._released - self.uids())
        self._released.clear()
        self._announced.update(gone)
        return [GrantEvent.removed(uid) for uid in gone]

    @staticmethod
    def _is_grant_name(name: str) -> bool:
        return name.endswith(GRANT_SUFFIX) and not name.startswith(".")

    def _take(self, name: str, content: _Token) -> GrantEvent | None:
        """Record a readable file's content; the GRANT_ADDED it delivers, if new. The file
        keeps holding its last verified UID until the core verifies the new token."""
        digest = hashlib.sha256(content.data).digest()
        held = self._files.get(name)
        if held is not None and held.digest == digest:
            self._reported.pop(name, None)
            return None
        if not jws_shaped(content.data):
            self._report(name, _Bad("junk", "is not a JWT (three base64url parts)", digest))
            return None
        self._files[name] = _Held(digest, held.uid if held is not None else None)
        self._reported.pop(name, None)
        origin = GrantOrigin(os.path.join(self.path, name), content.owner,
                             held=functools.partial(self._held, name, digest))
        return GrantEvent.added(content.data, origin)

    def _down(self, code: str, reason: str) -> None:
        """The directory cannot deliver: report it (once until it changes), mark health down."""
        self._report(_DIR_SUBJECT, _Bad(code, reason, reason))
        if self._health is not None:
            self._health.mark_down(self.path, reason)

    def _report(self, subject: str, bad: _Bad) -> None:
        key = (bad.code, bad.version)
        if self._reported.get(subject) == key:
            return
        self._reported[subject] = key
        self._reports += 1
        where = self.path if subject == _DIR_SUBJECT else os.path.join(self.path, subject)
        self._on_problem(Problem(bad.code, where, bad.reason))

    def _read(self, name: str) -> tuple[_Reading, _Signature | None]:
        """One grant file's content, or why it was skipped, or _SAME when its stat signature
        is the one remembered; with the signature to remember (None: read it again next
        time: a followed link, or a file modified too recently to trust its timestamps).
        Raises _Gone if it vanished."""
        full = os.path.join(self.path, name)
        read_at = time.time_ns()  # compared with the file system's own timestamps
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            raise _Gone from None
        except OSError as err:
            return _Bad("unreadable", err.strerror or "cannot stat", err.errno), None
        if stat.S_ISLNK(st.st_mode) and self.follow_symlinks:
            return self._read_link(full), None  # the link stays, its target may change
        signature = _signature(st)
        if self._known.get(name) == signature:
            return _SAME, signature
        settled = signature if st.st_mtime_ns < read_at - RACY_NS else None
        if not stat.S_ISLNK(st.st_mode):
            return self._read_file(full, st), settled
        reason = "is a symlink; grant files are regular files (follow_symlinks reads a Secret)"
        return _Bad("symlink", reason, _stat_version(st)), settled

    def _read_link(self, full: str) -> _Token | _Bad | _InFlux:
        """Follow a link that stays inside the directory (or ``..data``); one retry across a swap.

        A link to nothing is "dangling", or in a Secret volume in flux; a link
        that resolves outside is "symlink_escapes".
        """
        outcome: _Bad | _InFlux = _IN_FLUX
        for _ in range(2):
            root = self._link_root()
            if root is None:
                return _Bad("symlink_escapes", f"{DATA_LINK} points outside the grantdir", None)
            target = os.path.realpath(full)
            if not _inside(root, target):
                where = f"the volume's {DATA_LINK}" if self.secret_volume else "the grantdir"
                outcome = _Bad("symlink_escapes", f"points outside {where}, to {target}", target)
                continue  # a swap between resolving the root and the link: look again
            try:
                return self._read_file(target, os.lstat(target))
            except (_Gone, FileNotFoundError):
                dangling = _Bad("dangling", "is a symlink to nothing", target)
                outcome = _IN_FLUX if self.secret_volume else dangling
                continue
            except OSError as err:
                return _Bad("unreadable", f"cannot be followed: {err.strerror}", err.errno)
        if not os.path.lexists(full):
            raise _Gone
        return outcome

    def _link_root(self) -> str | None:
        """Where followed links must resolve: the directory, or the Secret's current ``..data``.

        None when ``..data`` itself resolves outside the directory.
        """
        root = os.path.realpath(self.path)
        if not self.secret_volume:
            return root
        data = os.path.realpath(os.path.join(root, DATA_LINK))
        return data if _inside(root, data) else None

    def _read_file(self, path: str, st: os.stat_result) -> _Token | _Bad:
        if stat.S_ISDIR(st.st_mode):
            return _Bad("not_a_file", "is a directory, not a token file", _stat_version(st))
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            raise _Gone from None
        except OSError as err:
            if err.errno == errno.ELOOP:
                return _Bad("symlink", "became a symlink while being read", _stat_version(st))
            return _Bad("unreadable", f"cannot be opened: {err.strerror}", _stat_version(st))
        try:
            return self._read_open(fd)
        except OSError as err:
            return _Bad("unreadable", f"cannot be read: {err.strerror}", _stat_version(st))
        finally:
            os.close(fd)

    def _read_open(self, fd: int) -> _Token | _Bad:
        st = os.fstat(fd)
        version = _stat_version(st)
        if not stat.S_ISREG(st.st_mode):
            return _Bad("not_a_file", "is not a regular file", version)
        if st.st_uid not in (self.owner, 0):
            owner = f"is owned by uid {st.st_uid}, not {self.owner} or root"
            return _Bad("stranger", owner, version)
        data = read_upto(fd, MAX_TOKEN_BYTES)
        if len(data) > MAX_TOKEN_BYTES:
            return _Bad("oversized", f"is over {MAX_TOKEN_BYTES} bytes, larger than any token",
                        version)
        return _Token(data, st.st_uid)
