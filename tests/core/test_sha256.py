"""core/sha256.py gives hashlib's SHA-256 digests without loading hashlib's OpenSSL binding."""

from __future__ import annotations

import hashlib
import subprocess
import sys

from slurm_fiber.core import sha256


def test_digests_are_hashlibs() -> None:
    for data in (b"", b"abc", b"g1", bytes(range(256)) * 300):
        assert sha256.digest(data) == hashlib.sha256(data).digest()
        assert sha256.hexdigest(data) == hashlib.sha256(data).hexdigest()


def test_fiberd_loads_no_hashlib() -> None:
    probe = ("import sys, slurm_fiber.daemon, slurm_fiber.homes.slurm.home; "
             "print(sorted({'hashlib', '_hashlib', 'cryptography'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"
