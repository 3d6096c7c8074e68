"""The spool of ``fiberctl map --nodes all``: one private directory every node of the job reads.

The map's options, its arguments, each node's joblog and summary and the halt flag
pass through one directory in the working directory (which every node sees, as
``--joblog`` does). Another user who can write the working directory can rename that
name away and put a directory of their own in its place, so the name is trusted for
nothing:

- the map makes the directory (mode 0700, its own, checked empty) and opens it once;
  every read, write and removal afterwards goes through that descriptor;
- each node's share is given the path and the directory's inode number; it opens the
  path once (O_NOFOLLOW) and refuses it unless it is that directory (same inode), owned
  by the share's own uid and closed to every other uid (no group or other bits); it then
  works through its descriptor, and opens files in it with O_NOFOLLOW, one link, owned
  by its uid (``slurm_fiber.safefs``);
- removal: the files by name through the descriptor, then the directory's name only
  while it still names the same directory.

So a swapped spool makes the shares refuse (one line each) and the map fail (255):
nothing of another user's is read, no command of theirs runs as the map's user. Not
prevented: a user who can write the working directory can still rename the spool
away, which fails the map; run maps in a directory of your own to rule that out.
"""

from __future__ import annotations

import contextlib
import os
import stat

from slurm_fiber.safefs import DIR_FLAGS, UnsafePath, open_file, write_atomic


class Spool:
    """One open spool directory (see the module doc): ``fd``, its ``path`` and inode."""

    def __init__(self, fd: int, path: str, inode: int,
                 parent: tuple[int, str] | None = None) -> None:
        self.fd, self.path, self.inode = fd, path, inode
        self.parent = parent  # (working directory's fd, the name): the map's own, to remove

    @classmethod
    def create(cls, prefix: str) -> Spool:
        """A new spool in the working directory (the map's side). Raises OSError (UnsafePath
        when what the name opened is not the directory just made)."""
        parent = os.open(".", DIR_FLAGS)
        try:
            while True:
                name = f"{prefix}{os.urandom(6).hex()}"
                try:
                    os.mkdir(name, 0o700, dir_fd=parent)
                    break
                except FileExistsError:
                    continue
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        except BaseException:
            os.close(parent)
            raise
        path = os.path.join(os.getcwd(), name)
        try:
            st = os.fstat(fd)
            _check(st, path)
            if os.listdir(fd):
                raise UnsafePath(f"{path}: the spool just made is not empty: swapped")
        except BaseException:
            os.close(fd)
            os.close(parent)
            raise
        return cls(fd, path, st.st_ino, (parent, name))

    @classmethod
    def attach(cls, path: str, inode: int) -> Spool:
        """The spool the map made, as a node's share opens it. Raises UnsafePath when
        ``path`` is not that directory (another user swapped it), OSError."""
        fd = os.open(path, DIR_FLAGS)
        try:
            st = os.fstat(fd)
            _check(st, path)
            if st.st_ino != inode:
                raise UnsafePath(f"{path} is not the directory the map made (inode "
                                 f"{st.st_ino}, not {inode}): replaced")
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path, inode)

    def read(self, name: str) -> str:
        """The text of file ``name`` (the spool's user's, one link, no link followed)."""
        fd = open_file(self.fd, name, os.O_RDONLY, owners=(os.geteuid(),))
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(fd)
        return b"".join(chunks).decode()

    def exists(self, name: str) -> bool:
        with contextlib.suppress(FileNotFoundError):
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            return True
        return False

    def write(self, name: str, text: str) -> None:
        """Replace file ``name`` with ``text``, whole (safefs.write_atomic, mode 0600)."""
        write_atomic(self.fd, name, text.encode(), mode=0o600)

    def claim(self, name: str, text: str) -> bool:
        """Take ``name`` for this process: create it (O_EXCL) holding ``text``; False when
        another process took it first (every node's share sees the same directory)."""
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        except FileExistsError:
            return False
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        return True

    def intact(self) -> bool:
        """(The map's side) whether the spool's name still names this directory (another
        user who can write the working directory may have swapped it)."""
        if self.parent is None:
            return True
        parent, name = self.parent
        try:
            return os.stat(name, dir_fd=parent, follow_symlinks=False).st_ino == self.inode
        except OSError:
            return False

    def names(self) -> list[str]:
        """The names in the spool."""
        return os.listdir(self.fd)

    def create_file(self, name: str) -> int:
        """A new file ``name`` for writing (it must not exist); its fd."""
        return open_file(self.fd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode=0o600)

    def remove(self) -> None:
        """(The map's side) remove every file in it, then the directory while its name
        still names it; close it. Never raises for what is already gone."""
        with contextlib.suppress(OSError):
            for name in os.listdir(self.fd):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.fd)
        if self.parent is not None:
            parent, name = self.parent
            with contextlib.suppress(OSError):
                if os.stat(name, dir_fd=parent, follow_symlinks=False).st_ino == self.inode:
                    os.rmdir(name, dir_fd=parent)
        self.close()

    def close(self) -> None:
        for fd in (self.fd, *(self.parent[:1] if self.parent else ())):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fd, self.parent = -1, None


def _check(st: os.stat_result, path: str) -> None:
    """Refuse anything but a directory of this uid that no other uid may enter."""
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafePath(f"{path} is owned by uid {st.st_uid}, not by {os.geteuid()}: "
                         "replaced by another user")
    if st.st_mode & 0o077:
        raise UnsafePath(f"{path} is open to other users (mode {st.st_mode & 0o777:o})")
