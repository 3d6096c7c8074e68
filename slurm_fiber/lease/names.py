"""What may name a resource and what a purpose may say.

A resource name becomes a directory name under the lease dir, so it must be
one path component that cannot escape it: letters, digits and ``._:@+-``,
starting with a letter or digit, at most 128 characters (no ``/``, no
``..``, no NUL, no hidden names). A purpose is one printable line of at most
``MAX_PURPOSE`` characters, so tables and audit lines stay one line.
"""

from __future__ import annotations

import re

from slurm_fiber.lease.errors import LeaseError

_RESOURCE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}")
MAX_PURPOSE = 1024


def check_resource(name: str) -> str:
    """Return ``name`` if it is a valid resource name; raise LeaseError saying why not."""
    if not _RESOURCE.fullmatch(name):
        shown = ascii(name) if len(name) <= 64 else ascii(name[:64]) + "..."
        raise LeaseError(
            f"resource name {shown} is not allowed: use 1-128 of letters, digits and ._:@+- "
            "starting with a letter or digit (no '/', '..', NUL)"
        )
    return name


def check_purpose(text: str) -> str:
    """Return ``text`` if it is a usable purpose; raise LeaseError saying why not."""
    if not text.strip():
        raise LeaseError("a claim needs a purpose: say what the resource is held for")
    if len(text) > MAX_PURPOSE:
        raise LeaseError(f"purpose is {len(text)} characters long; at most {MAX_PURPOSE} allowed")
    if not text.isprintable():
        raise LeaseError("purpose must be one printable line (no newlines or control characters)")
    return text
