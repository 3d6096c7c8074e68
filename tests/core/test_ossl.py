"""core/ossl.py verifies through the libcrypto Python's OpenSSL modules use, without ``ssl``."""

from __future__ import annotations

import json
import subprocess
import sys

from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

# Verify a good and a bad signature in a fresh interpreter, then load ssl and hashlib's
# binding: which modules and libcrypto files the process held before and after.
PROBE = """\
import json, sys
from slurm_fiber.core.ossl import PublicKey
def libcryptos():
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "/libcrypto.so" in line})
raw, signature, message = (bytes.fromhex(word) for word in sys.argv[1:])
key = PublicKey.ed25519(raw)
seen = {"good": key.verify(message, signature), "bad": key.verify(message + b"!", signature),
        "imported": sorted({"ssl", "_ssl", "hashlib", "_hashlib"} & set(sys.modules)),
        "before": libcryptos()}
import hashlib, ssl
seen["after"] = libcryptos()
seen["still_good"] = key.verify(message, signature)
print(json.dumps(seen))
"""


def test_verifies_without_ssl_through_the_libcrypto_ssl_then_uses() -> None:
    private = ed25519.Ed25519PrivateKey.generate()
    raw = private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    message = b"header.payload"
    out = subprocess.run([sys.executable, "-c", PROBE, raw.hex(), private.sign(message).hex(),
                          message.hex()], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert (seen["good"], seen["bad"], seen["still_good"]) == (True, False, True)
    assert seen["imported"] == []
    assert len(seen["before"]) == 1 and seen["after"] == seen["before"]
