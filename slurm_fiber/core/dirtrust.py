"""Trusted directories: fiberd refuses a directory anyone but its uid or root could change.

``trusted_dir(path)`` walks ``path`` from "/" one component at a time
(``O_PATH | O_DIRECTORY | O_NOFOLLOW`` relative to the previous component's
fd, so nothing is resolved twice) and checks each directory: owned by root
or an allowed owner (fiberd's euid by default), and not writable by group or
others. The one exception is an ancestor (never the directory itself) that
is root-owned and sticky, such as /tmp: others may add names there but not
replace ours. A symlink is followed only when an allowed owner owns it, and
its target is then checked from "/" like any path. Missing components are
created when ``create_mode`` is given, with exactly that mode whatever the
umask. It returns an fd of the checked directory; the caller acts relative
to it (or closes it, knowing the name can only be changed by a trusted owner).

``safe_path_entry`` is the same check for a ``sys.path`` entry (a directory
or a zip file), as the template uses it.

TODO(safefs): fold into ``slurm_fiber.safefs.open_dir`` (same walk; this
adds ``create_mode`` and the trusted-symlink rule) when safefs lands.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import stat
from collections.abc import Collection

# TODO(safefs): trusted_dir = safefs.open_dir(path, trusted_owners=(euid,)) plus creation.
MAX_SYMLINKS = 16
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeDir(OSError):
    """A directory fiberd must not use; ``str()`` is one line naming the path and why."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unsafe directory"


def _who(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _owners_text(owners: Collection[int]) -> str:
    return " or ".join(_who(u) for u in sorted(owners, reverse=True))


def check_dir_stat(st: os.stat_result, shown: str, owners: Collection[int], *,
                   final: bool) -> None:
    """Raise UnsafeDir unless ``st`` (of the directory ``shown``) is trusted as described
    in the module doc; ``final`` is False for an ancestor."""
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDir(f"{shown} is not a directory")
    if st.st_uid not in owners:
        raise UnsafeDir(f"{shown} belongs to {_who(st.st_uid)}, not to {_owners_text(owners)}")
    if st.st_mode & 0o022:
        if not final and st.st_uid == 0 and st.st_mode & stat.S_ISVTX:
            return
        who = "others" if st.st_mode & 0o002 else "its group"
        raise UnsafeDir(f"{shown} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})")


def trusted_dir(path: str | os.PathLike[str], *, owners: Collection[int] | None = None,
                create_mode: int | None = None) -> int:
    """An ``O_PATH`` fd of the directory ``path`` once every component is checked.

    ``owners`` defaults to {root, fiberd's euid}. With ``create_mode``,
    missing components are created (mode exactly ``create_mode``, owned by
    the caller); without it a missing one raises FileNotFoundError. Raises
    UnsafeDir (one line) for an untrusted component, OSError otherwise.
    Blocks only on the file system.
    """
    trusted = frozenset({0, os.geteuid()} if owners is None else {0, *owners})
    todo = os.path.abspath(os.fspath(path))
    for _ in range(MAX_SYMLINKS + 1):
        link = _walk(todo, trusted, create_mode)
        if isinstance(link, int):
            return link
        todo = link
    raise UnsafeDir(f"{path}: more than {MAX_SYMLINKS} symlinks on the way")


def _walk(path: str, owners: frozenset[int], create_mode: int | None) -> int | str:
    """One pass from "/": the fd of ``path``, or the path to walk next after a symlink."""
    parts = [p for p in path.split("/") if p and p != "."]
    fd = os.open("/", _DIR_FLAGS)
    shown = ""
    try:
        check_dir_stat(os.fstat(fd), "/", owners, final=not parts)
        for i, name in enumerate(parts):
            here = f"{shown}/{name}"
            if name == "..":
                # abspath removed every "..": only a symlink target can bring one; resolve
                # it textually against the checked path, then walk again from "/".
                return os.path.normpath(os.path.join(shown or "/", *parts[i:]))
            try:
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if create_mode is None:
                    raise
                nfd = _make(fd, name, create_mode)
            except OSError as err:
                if err.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                st = os.lstat(name, dir_fd=fd)
                if not stat.S_ISLNK(st.st_mode):
                    raise UnsafeDir(f"{here} is not a directory") from None
                if st.st_uid not in owners:
                    raise UnsafeDir(f"{here} is a symlink owned by {_who(st.st_uid)}, not "
                                    f"by {_owners_text(owners)}") from None
                target = os.readlink(name, dir_fd=fd)
                return os.path.normpath(os.path.join(shown or "/", target, *parts[i + 1:]))
            os.close(fd)
            fd = nfd
            shown = here
            check_dir_stat(os.fstat(fd), here, owners, final=i == len(parts) - 1)
        result, fd = fd, -1
        return result
    finally:
        if fd >= 0:
            os.close(fd)


def _make(parent: int, name: str, mode: int) -> int:
    """Create directory ``name`` under ``parent`` with exactly ``mode``; its O_PATH fd."""
    with contextlib.suppress(FileExistsError):  # made meanwhile by a trusted owner
        os.mkdir(name, 0o700, dir_fd=parent)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                 dir_fd=parent)
    try:
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, mode)
        return os.open(".", _DIR_FLAGS, dir_fd=fd)
    finally:
        os.close(fd)


def safe_path_entry(entry: str, owners: Collection[int] | None = None) -> str | None:
    """Why ``entry`` (a sys.path entry) must not be imported from, or None when it is safe.

    Safe: an existing directory that passes ``trusted_dir``, or a regular file
    (a zip) owned by a trusted owner, not group/other-writable, in such a
    directory. Relative entries ("" is the cwd) and missing paths are unsafe.
    """
    if not entry or not os.path.isabs(entry):
        return f"{entry or '(the current directory)'} is relative to the current directory"
    trusted = frozenset({0, os.geteuid()} if owners is None else {0, *owners})
    directory = entry
    if not os.path.isdir(entry):
        if not os.path.exists(entry):
            return f"{entry} does not exist"
        directory = os.path.dirname(entry)
    try:
        os.close(trusted_dir(directory, owners=trusted))
        if directory != entry:
            st = os.lstat(entry)
            if not stat.S_ISREG(st.st_mode) or st.st_uid not in trusted or st.st_mode & 0o022:
                return f"{entry} is not a regular file only a trusted owner may write"
    except OSError as err:
        return str(err) if isinstance(err, UnsafeDir) else f"{entry}: {err.strerror or err}"
    return None
