"""The kubelet's AtomicWriter, step by step: how a Secret volume's files change on disk.

Part of the fake: what the kubelet would do to the grant Pod's Secret volume
when a control plane updates the Secret, for tests and grant-conform.

``atomic_write(volume, payload)`` updates ``volume`` the way the kubelet's
``pkg/volume/util/atomic_writer.go`` does for a Secret: the payload goes into
a new ``..<UTC timestamp>.<random>`` directory, a ``..data_tmp`` symlink to
it is renamed over ``..data`` (the atomic swap), per-key ``name ->
..data/name`` symlinks are created for new keys, links of keys that left the
payload are removed, and the old timestamped directory is deleted. It is a
generator that yields the name of each step just taken, so a test can look
at the directory between any two steps, where a reader may look too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

DATA = "..data"
DATA_TMP = "..data_tmp"


def atomic_write(volume: Path, payload: Mapping[str, bytes], mode: int = 0o400) -> Iterator[str]:
    """Replace the volume's payload with ``payload`` (flat keys), yielding after each step."""
    data = volume / DATA
    old = os.readlink(data) if data.is_symlink() else None
    old_keys = set(os.listdir(volume / old)) if old else set()
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime())
    new = Path(tempfile.mkdtemp(prefix=stamp, dir=volume))
    for key, content in payload.items():
        (new / key).write_bytes(content)
        (new / key).chmod(mode)
    new.chmod(0o755)
    yield "payload written"
    (volume / DATA_TMP).symlink_to(new.name)
    yield "..data_tmp linked"
    os.rename(volume / DATA_TMP, data)
    yield "..data swapped"
    for key in payload:
        if not (volume / key).is_symlink():
            (volume / key).symlink_to(f"{DATA}/{key}")
    yield "user-visible links created"
    for key in sorted(old_keys - set(payload)):
        (volume / key).unlink()
    yield "stale links removed"
    if old:
        shutil.rmtree(volume / old)
    yield "old payload removed"


def write_secret(volume: Path, payload: Mapping[str, bytes]) -> None:
    """Run every step of ``atomic_write`` at once."""
    for _ in atomic_write(volume, payload):
        pass
