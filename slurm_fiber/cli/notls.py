"""asyncio without ``ssl`` for a fiberd whose home never speaks TLS (fiberd's memory).

``import_asyncio_without_tls()`` imports asyncio with ``ssl`` hidden during
that one import. asyncio then has no TLS (a connection or server with ``ssl``
raises RuntimeError: no ssl module) and ``ssl`` stays unloaded; it is not
blocked: whatever imports it afterwards (the metrics' prometheus_client does)
gets it as always. Only this process is affected: a grant's template is a fresh
interpreter. ``asyncio_for_home(home)`` is the decision the daemon commands make
once their configuration names the home and before anything imports asyncio:
TLS-free exactly when the home's entry says it never speaks TLS
(``HomeEntry.tls``; an installed home, or a name no home has, keeps it).
fiberd's own socket is a Unix socket and its signature checks need no ``ssl``.
"""

from __future__ import annotations

import sys

from slurm_fiber.homes.select import UnknownHome, lookup


def import_asyncio_without_tls() -> bool:
    """Import asyncio with ``ssl`` hidden from it, unless asyncio or ``ssl`` is imported
    already (then nothing changes). Returns whether asyncio is without TLS. ``import ssl``
    works as before once this returns."""
    if "asyncio" not in sys.modules and "ssl" not in sys.modules:
        sys.modules["ssl"] = None  # type: ignore[assignment]  # `import ssl` raises ImportError
        try:
            import asyncio
        finally:
            del sys.modules["ssl"]
    import asyncio.sslproto

    return asyncio.sslproto.ssl is None  # type: ignore[attr-defined]  # its try of ssl


def asyncio_for_home(home: str) -> bool:
    """Import asyncio without TLS when the home called ``home`` never speaks it (else leave
    asyncio to be imported as usual). Returns whether asyncio is without TLS. Call it
    before anything imports asyncio; an installed home's entry is loaded to ask it."""
    try:
        tls = lookup(home).tls
    except UnknownHome:  # building it refuses, with the line that says why
        tls = True
    return not tls and import_asyncio_without_tls()
