"""A helper process that fsyncs fiberd's audit log, so a Clone's record is made durable off
the event loop, and Clones that wait at once share one fsync.

Under ``audit_fsync = always`` each Clone's record is fsynced before the Clone is
answered. A small helper process (``python -I -S``, stdlib only) holds the log's
descriptor and fsyncs it on request: one byte asks, one byte answers (0: done, else
the errno); fiberd awaits the answer while its loop goes on.

- ``synced()`` returns once an fsync that began after the call has ended, so every
  record written before the call is durable; callers that come while one fsync is
  under way share the next (group commit); a failed fsync raises OSError in each.
- A helper that cannot be started or dies is not replaced: from then on ``synced()``
  fsyncs on the loop (said once in the log). The helper ends when fiberd closes it or
  dies (its request pipe reads end of file).
- Used from one event loop; a caller waits at most ``FSYNC_WITHIN`` seconds for its
  fsync, and ``close()`` blocks at most ``CLOSE_WITHIN`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import subprocess

log = logging.getLogger(__name__)

CLOSE_WITHIN = 2.0  # seconds ``close`` waits for the helper to exit before killing it
FSYNC_WITHIN = 30.0  # seconds a caller waits for its fsync (a stalled disk or helper)
_PROGRAM = """\
import os, sys
fd = int(sys.argv[1])
while os.read(0, 1):
    try:
        os.fsync(fd)
        answer = 0
    except OSError as e:
        answer = e.errno % 256 or 5
    os.write(1, bytes([answer]))
"""


class AuditSyncer:
    """The fsync helper of one audit log descriptor (see the module doc)."""

    def __init__(self, fd: int, python: str) -> None:
        """Start the helper for ``fd`` with the interpreter ``python``; blocks for its
        spawn. A helper that cannot start leaves fsyncs on the loop (logged)."""
        self.fd = fd
        self._proc: subprocess.Popen[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop reading its answers
        self._under_way: asyncio.Future[None] | None = None  # the fsync asked for
        self._next: asyncio.Future[None] | None = None  # the one after, for later callers
        try:
            self._proc = subprocess.Popen(
                [python, "-I", "-S", "-c", _PROGRAM, str(fd)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, pass_fds=(fd,), close_fds=True)
        except OSError as err:
            log.warning("audit fsyncs stay on the event loop: no helper (%s)", err)

    async def synced(self, within: float = FSYNC_WITHIN) -> None:
        """Return once every record written before this call is durable. Raises OSError
        when the fsync fails, or (ETIMEDOUT) has not ended ``within`` seconds (it stays
        under way; later callers wait for the one after it)."""
        if self._proc is None:
            os.fsync(self.fd)
            return
        loop = asyncio.get_running_loop()
        if self._loop is None:
            assert self._proc.stdout is not None
            os.set_blocking(self._proc.stdout.fileno(), False)
            loop.add_reader(self._proc.stdout.fileno(), self._answered)
            self._loop = loop
        if self._under_way is None:
            self._under_way = waiting = loop.create_future()
            self._ask()
        else:  # that fsync may have begun before this caller's record: wait for the next
            if self._next is None:
                self._next = loop.create_future()
            waiting = self._next
        try:
            await asyncio.wait_for(asyncio.shield(waiting), within)
        except TimeoutError:
            raise OSError(errno.ETIMEDOUT, f"the audit fsync did not end within "
                          f"{within:g} s") from None

    def close(self) -> None:
        """Stop the helper (blocks at most ``CLOSE_WITHIN`` s); later ``synced()`` calls
        fsync on the loop. Callers still waiting get OSError (EPIPE)."""
        self._give_up(OSError(errno.EPIPE, "the audit fsync helper was closed"))

    def _ask(self) -> None:
        """Ask the helper for the fsync ``_under_way`` waits for (a helper that is gone
        leaves it to an fsync made here)."""
        assert self._proc is not None and self._proc.stdin is not None
        try:
            os.write(self._proc.stdin.fileno(), b"s")
        except OSError as err:
            self._give_up(None, f"the helper is gone ({err})")

    def _answered(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        try:
            answers = os.read(self._proc.stdout.fileno(), 64)
        except BlockingIOError:
            return
        except OSError as err:
            answers = b""
            why = f"its answers cannot be read ({err})"
        else:
            why = "it exited"
        if not answers:
            self._give_up(None, why)
            return
        for answer in answers:
            done, self._under_way = self._under_way, None
            if done is not None and not done.done():
                if answer:
                    done.set_exception(OSError(answer, os.strerror(answer)))
                else:
                    done.set_result(None)
            if self._next is not None:
                self._under_way, self._next = self._next, None
                self._ask()

    def _give_up(self, error: OSError | None, why: str = "") -> None:
        """Stop using the helper: its waiting callers get ``error``, or (None) an fsync
        made here."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if why:
            log.warning("audit fsyncs are back on the event loop: the helper failed: %s", why)
        if self._loop is not None and proc.stdout is not None:
            self._loop.remove_reader(proc.stdout.fileno())
        for waiting in (self._under_way, self._next):
            if waiting is not None and not waiting.done():
                if error is None:
                    _settle(waiting, self.fd)
                else:
                    waiting.set_exception(error)
        self._under_way = self._next = None
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        try:
            proc.wait(CLOSE_WITHIN)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _settle(waiting: asyncio.Future[None], fd: int) -> None:
    """Resolve ``waiting`` with an fsync of ``fd`` made here, or its OSError."""
    try:
        os.fsync(fd)
    except OSError as err:
        waiting.set_exception(err)
    else:
        waiting.set_result(None)
