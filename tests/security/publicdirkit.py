"""A scratch directory every job user can reach, outside pytest's own tmp tree.

pytest keeps /tmp/pytest-of-<user> at mode 0700 and puts it back at the start of every
session, so a path under ``tmp_path`` opened up for ``mallory`` can close again while a
test runs (other sessions start concurrently). ``public_dir`` makes a fresh 0755
directory directly in /tmp (sticky, world-traversable) and removes it afterwards;
use it inside a test's own fixture.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def public_dir() -> Iterator[Path]:
    """A root-owned 0755 directory in /tmp that every user can traverse."""
    path = Path(tempfile.mkdtemp(prefix="sf-hostile-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)
