"""File edges shared by lease records and the state document.

``write_atomic`` writes a whole file or nothing: the bytes go to a temporary
file in the same directory, are flushed to disk, and are renamed over the
target, so a reader sees the old content or the new, never half.
``read_json`` reads one bounded JSON document and turns every way it can be
wrong (missing, too large, truncated, not UTF-8) into a one-line LeaseError.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from slurm_fiber.lease.errors import LeaseError, io_failure


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically.

    Blocks on the disk flush. On failure (read-only filesystem, disk full)
    raises LeaseError, removes its temporary file and leaves ``path`` as it was.
    """
    tmp = path.parent / f".{path.name}.tmp.{os.getpid()}.{os.urandom(4).hex()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise io_failure(f"write {path}", err) from None


def read_json(path: Path, max_bytes: int, what: str) -> Any:
    """Read and decode the JSON document at ``path`` (at most ``max_bytes``).

    Raises FileNotFoundError when it does not exist (callers decide what
    absence means) and LeaseError, naming ``what``, for anything unreadable.
    """
    try:
        with open(path, "rb") as fh:
            raw = fh.read(max_bytes + 1)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise io_failure(f"read {what} {path}", err) from None
    if len(raw) > max_bytes:
        raise LeaseError(f"{what} {path} is larger than {max_bytes} bytes; it is not a record")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise LeaseError(f"{what} {path} is not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise LeaseError(
            f"{what} {path} is not valid JSON (truncated or corrupt: {err.msg} at byte {err.pos})"
        ) from None
