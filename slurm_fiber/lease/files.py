"""File edges shared by lease records, the state document, its lock and the audit log.

Every file is reached through a descriptor of its directory (``open_area``)
and opened by name relative to it with slurm_fiber.safefs: never following
a link, never blocking on a FIFO, refusing a file with more than one link,
an untrusted owner or an oversize body. An area is either *cooperative*
(``owners`` None: the generic ``slurm-fiber lease`` commands on a directory
whose mode the site chose; its path is opened as the caller named it, and
entries may belong to anyone) or *owned* (``owners`` a tuple of uids, like
a Slurm node's root-only lease dir: every directory on the path and every
file read must belong to those owners). ``write_atomic`` writes a whole
file or nothing; ``read_json`` reads one bounded JSON document and turns
every way it can be wrong (missing aside, too large, a link, a FIFO,
truncated, not UTF-8) into a one-line LeaseError.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from slurm_fiber import safefs
from slurm_fiber.lease.errors import LeaseError, io_failure

Owners = tuple[int, ...] | None
AREA_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def open_area(path: Path, owners: Owners, *, create: bool = False,
              what: str = "the lease dir (--dir, SLURM_FIBER_LEASE_DIR)") -> int:
    """An fd of directory ``path`` (the caller closes it).

    Cooperative (``owners`` None): opened as named, created with its parents
    when ``create``. Owned: walked with safefs.open_dir, every component
    belonging to root or ``owners`` and writable by no one else; never
    created here (the owner prepares it). Raises FileNotFoundError when it
    is missing, LeaseError for anything else: a file in the way says which
    path is not a directory, naming ``what`` (the option that gave ``path``).
    """
    try:
        if owners is not None:
            return safefs.open_dir(path, trusted_owners=owners)
        if create:
            path.mkdir(parents=True, exist_ok=True)
        return os.open(path, AREA_FLAGS)
    except FileNotFoundError:
        raise
    except safefs.UnsafePath as err:
        raise LeaseError(f"{err}; the lease area is not trusted") from None
    except (NotADirectoryError, FileExistsError):
        raise not_a_directory(path, what) from None
    except OSError as err:
        raise io_failure(f"open {path}", err) from None


def not_a_directory(path: Path, what: str) -> LeaseError:
    """The error for ``path`` (given as ``what``) that is, or lies under, something other
    than a directory: names that thing and what must be a directory."""
    culprit = path
    for part in reversed((path, *path.parents)):
        if part.exists() and not part.is_dir():
            culprit = part
            break
    under = "" if culprit == path else f" ({path} lies under it)"
    return LeaseError(f"{culprit} is not a directory{under}: {what} must be one")


def write_atomic(dir_fd: int, name: str, data: bytes, where: Path, mode: int = 0o644) -> None:
    """Replace ``name`` in ``dir_fd`` (shown as ``where``) with ``data`` atomically.

    Blocks on the disk flushes. On failure (read-only filesystem, disk full)
    raises LeaseError and leaves the file as it was, with no temporary file.
    """
    try:
        safefs.write_atomic(dir_fd, name, data, mode=mode)
    except OSError as err:
        raise io_failure(f"write {where}", err) from None


def read_json(dir_fd: int, name: str, max_bytes: int, what: str, where: Path,
              owners: Owners = None) -> Any:
    """Read and decode the JSON document ``name`` in ``dir_fd`` (at most ``max_bytes``).

    ``where`` is its path for messages. Raises FileNotFoundError when it does
    not exist (callers decide what absence means) and LeaseError, naming
    ``what``, for anything unreadable or untrusted.
    """
    try:
        raw = safefs.read_file(dir_fd, name, max_bytes=max_bytes, owners=owners)
    except FileNotFoundError:
        raise
    except safefs.UnsafePath as err:
        raise LeaseError(f"{what}: {err}; it is not a record") from None
    except OSError as err:
        raise io_failure(f"read {what} {where}", err) from None
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise LeaseError(f"{what} {where} is not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise LeaseError(
            f"{what} {where} is not valid JSON (truncated or corrupt: {err.msg} at byte {err.pos})"
        ) from None
    except RecursionError:
        raise LeaseError(f"{what} {where} is nested too deeply; it is not a record") from None


def open_regular(dir_fd: int, name: str, flags: int, what: str, where: Path,
                 owners: Owners = None) -> int:
    """Open (or create, with O_CREAT, mode 0644) the regular file ``name`` in ``dir_fd``
    for a lock or an append; its fd. A link, a FIFO, a file of several links or of an
    untrusted owner is refused with a LeaseError naming ``what``."""
    try:
        return safefs.open_file(dir_fd, name, flags, mode=0o644, owners=owners)
    except safefs.UnsafePath as err:
        raise LeaseError(f"{what}: {err}; move it aside") from None
    except OSError as err:
        raise io_failure(f"open {what} {where}", err) from None
