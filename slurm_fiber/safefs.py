"""Safe file operations for code that acts on names another user may control.

Root (the prolog, the epilog, the lease supervision) and fiberd open, read
and write files in directories a job user can write. The rule kept here: a
name is never followed and never trusted. Directories are walked from "/"
one component at a time with O_NOFOLLOW (``open_dir``), refusing any
component another user could replace; files are opened relative to a
trusted directory fd with O_NOFOLLOW|O_NONBLOCK (a FIFO never blocks, a
symlink is refused), then checked on the descriptor (a regular file, one
link, the expected owner, a bounded size) and acted on through it, never
through the name again. Writes are atomic (a temporary file in the same
directory, fsync of the file, rename, fsync of the directory).

Every refusal is ``UnsafePath``, an OSError whose ``str()`` is one line
naming the path and what is wrong. Standard library only (``fiberctl map``
imports it: tests/cli/test_fibermap.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Iterable

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
MAX_LINKS = 40  # symlinks resolved in one open_dir walk, as the kernel's MAXSYMLINKS


class UnsafePath(OSError):
    """A path that cannot be trusted: a link, a FIFO, a foreign owner, too large.

    ``str()`` is one line naming the path and what is wrong.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(" ".join(reason.split()))


def fd_path(dir_fd: int, name: str = "") -> str:
    """A display path for ``name`` in ``dir_fd`` (from /proc/self/fd; messages only)."""
    try:
        base = os.readlink(f"/proc/self/fd/{dir_fd}")
    except OSError:
        base = f"<dir fd {dir_fd}>"
    return os.path.join(base, name) if name else base


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _check_dir(st: os.stat_result, where: str, trusted: tuple[int, ...],
               allow_group_write: bool, last: bool) -> None:
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in trusted:
        raise UnsafePath(f"{where} is owned by uid {st.st_uid}, not by a trusted owner "
                         f"(uid {', '.join(map(str, trusted))}); it could be replaced")
    if mode & stat.S_ISVTX and not last:
        return  # sticky (/tmp): only the next entry's owner can replace it, checked next
    if mode & stat.S_IWOTH:
        raise UnsafePath(f"{where} is writable by every user (mode {mode:04o}); chmod o-w it")
    if mode & stat.S_IWGRP and not allow_group_write:
        raise UnsafePath(f"{where} is writable by its group (mode {mode:04o}); "
                         "chmod g-w it")


def open_dir(path: str | os.PathLike[str], *, trusted_owners: Iterable[int] = (0,),
             allow_group_write: bool = False, create_mode: int | None = None) -> int:
    """Open directory ``path`` (absolute) safely; return its fd (the caller closes it).

    Walks from "/" with O_DIRECTORY|O_NOFOLLOW per component. Every
    directory on the way must belong to root or one of ``trusted_owners`` and be
    writable by nobody else: not by its group (unless ``allow_group_write``)
    nor by others, except a sticky directory above the last (like /tmp,
    where only an entry's owner may replace it, and that owner is checked
    next). A symlink on the way is followed only when a trusted owner made
    it in a directory already checked (/var/run -> /run); one owned by
    anyone else is refused. With ``create_mode``, missing components are made
    (by this process, so owned by it) with exactly that mode whatever the umask,
    then checked like the rest. Raises UnsafePath with one line, or
    FileNotFoundError / NotADirectoryError for a missing path.
    """
    trusted = (0, *(uid for uid in trusted_owners if uid != 0))  # root is always trusted
    text = os.fspath(path)
    if not os.path.isabs(text):
        raise UnsafePath(f"{text}: not an absolute path")
    todo = [part for part in text.split("/") if part and part != "."]
    todo.reverse()  # a stack: the next component is last
    fd = os.open("/", DIR_FLAGS)
    where = "/"
    links = 0
    try:
        _check_dir(os.fstat(fd), where, trusted, allow_group_write, last=not todo)
        while todo:
            name = todo.pop()
            try:
                nxt = os.open(name, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if create_mode is None:
                    raise FileNotFoundError(errno.ENOENT, "No such file or directory",
                                            os.path.join(where, name)) from None
                nxt = _make_dir(fd, name, create_mode)
            except OSError as err:
                if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise type(err)(err.errno, err.strerror, os.path.join(where, name)) from None
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise NotADirectoryError(errno.ENOTDIR, "Not a directory",
                                             os.path.join(where, name)) from None
                links += 1
                if st.st_uid not in trusted or links > MAX_LINKS:
                    raise UnsafePath(f"{os.path.join(where, name)} is a symbolic link owned by "
                                     f"uid {st.st_uid}; it is not followed") from None
                target = os.readlink(name, dir_fd=fd)
                todo.extend(reversed([p for p in target.split("/") if p and p != "."]))
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", DIR_FLAGS)
                    where = "/"
                continue
            os.close(fd)
            fd = nxt
            where = os.path.normpath(os.path.join(where, name))
            _check_dir(os.fstat(fd), where, trusted, allow_group_write, last=not todo)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _make_dir(parent: int, name: str, mode: int) -> int:
    """Make directory ``name`` in ``parent`` with exactly ``mode`` (when this process owns
    it: one a trusted owner made meanwhile is left as it is); its fd."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=parent)
    fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    try:
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_file(fd: int, where: str | Callable[[], str], *,
               owners: Iterable[int] | None = None,
               max_bytes: int | None = None) -> os.stat_result:
    """fstat ``fd`` and refuse it unless a regular file of one link, owned by one of
    ``owners`` (any when None), of at most ``max_bytes``; its stat. ``where`` names it in
    messages (a callable is called only on a refusal). Raises UnsafePath
    (FileNotFoundError when the file was removed since it was opened)."""
    st = os.fstat(fd)
    regular = stat.S_ISREG(st.st_mode) and st.st_nlink == 1
    if regular and (owners is None or st.st_uid in tuple(owners)) and (
            max_bytes is None or st.st_size <= max_bytes):
        return st
    if callable(where):
        where = where()
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{where} is {_kind(st.st_mode)}, not a regular file")
    if st.st_nlink == 0:
        raise FileNotFoundError(errno.ENOENT, "removed while being opened", where)
    if st.st_nlink != 1:
        raise UnsafePath(f"{where} has {st.st_nlink} hard links; a file of one link is "
                         "expected (another name may point at the same file)")
    if owners is not None and st.st_uid not in tuple(owners):
        raise UnsafePath(f"{where} is owned by uid {st.st_uid}, not by a trusted owner")
    if max_bytes is not None and st.st_size > max_bytes:
        raise UnsafePath(f"{where} is larger than {max_bytes} bytes ({st.st_size})")
    return st


def _single(name: str, dir_fd: int) -> None:
    if not name or "/" in name or name in (".", ".."):
        raise UnsafePath(f"{fd_path(dir_fd)}: {name!r} is not a single file name")


def open_file(dir_fd: int, name: str, flags: int, *, mode: int = 0o644,
              owners: Iterable[int] | None = None) -> int:
    """Open ``name`` in ``dir_fd`` with ``flags`` (plus O_NOFOLLOW|O_NONBLOCK|O_NOCTTY|
    O_CLOEXEC) and check it like ``check_file``; the fd (the caller closes it).

    For files kept open or appended to (locks, audit logs); ``mode`` applies
    when O_CREAT creates it. Never blocks on a FIFO. Raises UnsafePath, or
    FileNotFoundError when it is missing and O_CREAT is not given.
    """
    _single(name, dir_fd)
    try:
        fd = os.open(name, flags | FILE_FLAGS, mode, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafePath(f"{fd_path(dir_fd, name)} is a symbolic link; "
                             "it is not followed") from None
        if err.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO opened for writing, a dir
            raise UnsafePath(f"{fd_path(dir_fd, name)} is not a regular file "
                             f"({err.strerror})") from None
        raise type(err)(err.errno, err.strerror, fd_path(dir_fd, name)) from None
    try:
        check_file(fd, lambda: fd_path(dir_fd, name), owners=owners)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(dir_fd: int, name: str, *, max_bytes: int,
              owners: Iterable[int] | None = None) -> bytes:
    """The content of regular file ``name`` in ``dir_fd``, at most ``max_bytes``.

    Opened O_NOFOLLOW|O_NONBLOCK (a symlink is refused, a FIFO never
    blocks), then checked on the fd: regular, one link, owned by one of
    ``owners`` when given, no larger than ``max_bytes``. Raises UnsafePath,
    or FileNotFoundError when ``name`` does not exist.
    """
    fd = open_file(dir_fd, name, os.O_RDONLY, owners=owners)
    try:
        check_file(fd, lambda: fd_path(dir_fd, name), max_bytes=max_bytes)
        data = read_upto(fd, max_bytes)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise UnsafePath(f"{fd_path(dir_fd, name)} grew past {max_bytes} bytes while read")
    return data


def read_upto(fd: int, max_bytes: int) -> bytes:
    """Read ``fd`` to its end, but at most ``max_bytes + 1`` bytes: a result longer than
    ``max_bytes`` says the file is larger than allowed. Blocks only on the file system."""
    chunks: list[bytes] = []
    size = 0
    while size <= max_bytes:
        chunk = os.read(fd, max_bytes + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def write_atomic(dir_fd: int, name: str, data: bytes, *, mode: int = 0o644, uid: int = -1,
                 gid: int = -1) -> None:
    """Replace ``name`` in ``dir_fd`` with ``data``: whole or not at all.

    Writes a temporary file with a random dot-name in the same directory
    (O_EXCL|O_NOFOLLOW), sets its owner (``uid``/``gid``, -1 keeps) and
    ``mode`` on the fd, fsyncs it, renames it over ``name`` and fsyncs the
    directory. Whatever ``name`` was (a planted link, a FIFO) is replaced,
    never followed. Blocks on the disk flushes. Raises OSError, leaving
    ``name`` as it was and no temporary file behind.
    """
    _single(name, dir_fd)
    tmp = f".{name[:200]}.{os.urandom(6).hex()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     mode & 0o777, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if uid != -1 or gid != -1:
                os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        if isinstance(err, UnsafePath) or err.filename:
            raise
        raise type(err)(err.errno, err.strerror, fd_path(dir_fd, name)) from None
    os.fsync(dir_fd)


def replace_file(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644,
                 uid: int = -1, gid: int = -1) -> None:
    """``write_atomic`` by path: replace the file ``path`` names with ``data`` of exactly
    ``mode`` (whatever the umask), whole or not at all.

    The parent directory is opened as named (a link in it is followed): for
    directories only the caller, root or a trusted account can write. Below a
    directory another user controls, open it with ``open_dir`` and call
    ``write_atomic``. Blocks on the disk flushes; raises OSError, leaving the
    file as it was and no temporary file behind.
    """
    directory, name = os.path.split(os.path.abspath(path))
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        write_atomic(dir_fd, name, data, mode=mode, uid=uid, gid=gid)
    finally:
        os.close(dir_fd)
