"""The readiness file: a small JSON document replaced atomically on every publish.

A reader never sees a partial document: the new content is written to a
hidden temporary file in the same directory, flushed to disk, and renamed
over the old one. The document is ``{"ready": bool, "warm": [uids], "time":
unix seconds}``.
"""

from __future__ import annotations

import contextlib
import json
import os


def ready_document(warm: list[str], time: float) -> dict[str, object]:
    """The readiness file's content for the grants in ``warm`` (ready when any is warm)."""
    return {"ready": bool(warm), "warm": sorted(warm), "time": time}


def write_atomically(path: str, content: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``content`` so readers see the old or the new file, never a mix.

    Blocks on disk I/O (write, fsync, rename). Raises OSError when the
    directory is missing or unwritable; the old file is then left as it was
    and no temporary file is left behind.
    """
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(content)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_ready_file(path: str, warm: list[str], time: float) -> None:
    """Publish readiness to ``path`` atomically; blocks on disk I/O, raises OSError."""
    document = json.dumps(ready_document(warm, time), sort_keys=True) + "\n"
    write_atomically(path, document.encode())


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
