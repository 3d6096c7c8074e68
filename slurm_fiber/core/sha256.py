"""SHA-256 for fiberd without ``hashlib``'s OpenSSL binding.

fiberd hashes a grant UID into its cgroup name and each grant file's content
(to tell an unchanged file). ``hashlib`` would load ``_hashlib``, whose
OpenSSL set-up costs a job's fiberd about 0.6 MB (measured: 0.70 MB for
hashlib against 0.12 MB for the interpreter's own SHA-256 module). This uses
the interpreter's own implementation (``_sha256`` in 3.11, ``_sha2`` from
3.12) and ``hashlib`` only where neither is built. Same digests; pure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_new: Callable[[bytes], Any]
try:
    from _sha256 import sha256 as _new  # type: ignore[import-not-found,no-redef]
except ImportError:  # pragma: no cover - 3.12 and later
    try:
        from _sha2 import sha256 as _new  # type: ignore[import-not-found,no-redef]
    except ImportError:
        from hashlib import sha256 as _new


def digest(data: bytes) -> bytes:
    """The 32-byte SHA-256 digest of ``data``."""
    return bytes(_new(data).digest())


def hexdigest(data: bytes) -> str:
    """The SHA-256 digest of ``data`` as 64 lowercase hex digits."""
    return str(_new(data).hexdigest())


def hasher() -> Any:
    """A SHA-256 object to ``update`` piece by piece (``hexdigest`` at the end)."""
    return _new(b"")
