"""Claiming the socket path safely: one live fiberd per path, nothing else clobbered.

``claim_socket`` takes an exclusive ``flock`` on ``<path>.lock`` (held for
the server's life), then looks at ``path``: a live socket (someone answers a
connect) is refused, a stale socket is removed, anything that is not a
socket (file, directory, symlink) is refused and left alone. The new socket
is bound under a temporary name, given its mode, and renamed into place
before it listens, so it is never reachable with wider permissions or
half-made. ``release`` removes the socket only while it is still the one we
made. ``peer_groups`` reads a connected peer's supplementary groups
(SO_PEERGROUPS), which ``allowed_gids`` admits as well as its primary group.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

MAX_SUN_PATH = 107  # sockaddr_un.sun_path, minus the NUL
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux 4.13+
_MAX_GROUPS_BUF = 1024  # CPython's getsockopt limit: up to 256 groups


def peer_groups(sock: socket.socket) -> frozenset[int]:
    """The supplementary groups the connected peer had at ``connect``; empty when the
    kernel cannot say (too many groups for the buffer, or an old kernel)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _MAX_GROUPS_BUF)
    except OSError:
        return frozenset()
    return frozenset(struct.unpack(f"={len(raw) // 4}I", raw[:len(raw) // 4 * 4]))


class SocketPathError(Exception):
    """The path cannot be served: in use by a live fiberd, not a socket, or unusable."""


@dataclass
class ClaimedSocket:
    """A bound, listening socket at ``path`` and the lock that makes it ours."""

    path: Path
    sock: socket.socket
    lock_fd: int
    ino: int

    def release(self) -> None:
        """Close the socket, unlink it if it is still ours, drop the lock. Idempotent."""
        self.sock.close()
        if self.lock_fd < 0:
            return
        with contextlib.suppress(OSError):
            if os.lstat(self.path).st_ino == self.ino:
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.unlink(_lock_path(self.path))
        os.close(self.lock_fd)
        self.lock_fd = -1


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _take_lock(path: Path) -> int:
    """An fd holding an exclusive flock on the path's lock file (a file still linked there)."""
    lock = _lock_path(path)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SocketPathError(f"{path} is in use by another fiberd (lock held)") from None
        try:
            if os.fstat(fd).st_ino == os.lstat(lock).st_ino:
                return fd  # the lock file was not unlinked by a departing owner meanwhile
        except FileNotFoundError:
            pass
        os.close(fd)


def _clear_stale(path: Path) -> None:
    """Remove a stale socket at ``path``; refuse a live one or a non-socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketPathError(f"{path} exists and is not a socket; not touching it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError as e:
        if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise SocketPathError(f"{path}: cannot tell whether it is live ({e})") from e
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    finally:
        probe.close()
    raise SocketPathError(f"{path} is a live socket of another server; refusing to replace it")


def claim_socket(
    path: str | os.PathLike[str], mode: int = 0o600, backlog: int = 128
) -> ClaimedSocket:
    """Bind and listen on ``path`` with ``mode``; raises SocketPathError when it must not.

    Called once at server start; blocks for at most a one-second probe of an
    existing socket. The parent directory must exist.
    """
    path = Path(path)
    if len(os.fsencode(path)) > MAX_SUN_PATH:
        raise SocketPathError(f"{path} is longer than a Unix socket path may be")
    if not path.parent.is_dir():
        raise SocketPathError(f"{path.parent} is not a directory")
    lock_fd = _take_lock(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _clear_stale(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        sock.bind(str(tmp))
        os.chmod(tmp, mode)
        os.rename(tmp, path)
        sock.listen(backlog)
        sock.setblocking(False)
        return ClaimedSocket(path=path, sock=sock, lock_fd=lock_fd, ino=os.lstat(path).st_ino)
    except BaseException as e:
        sock.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        os.close(lock_fd)
        if isinstance(e, OSError):
            raise SocketPathError(f"{path}: {e.strerror or e}") from e
        raise
