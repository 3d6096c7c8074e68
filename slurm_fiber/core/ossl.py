"""Token signature checks through the libcrypto Python's own OpenSSL modules are linked with.

fiberd verifies every grant token's signature (Ed25519 or ECDSA P-256 with
SHA-256) and nothing else of cryptography. The ``cryptography`` package costs
a job's fiberd 7.6 MB of its memory (6.9 MB of it the pages of its compiled
binding, which nothing else in a Slurm job shares), more than all of
fiberd's own code; ``ssl`` (which asyncio imports when it can) costs about
1 MB more for libssl and its module, which a fiberd whose home speaks no TLS
does without (cli/notls.py). This module calls the system's ``libcrypto``
through its EVP interface directly (``EVP_DigestVerify``, as ``cryptography``
itself does underneath), imports neither ``ssl`` nor ``hashlib``, and binds to
the very copy of libcrypto that ``_hashlib`` and ``_ssl`` use, never another
one: it loads ``_hashlib``'s extension file with ``dlopen`` (the module is not
imported: nothing of it runs, ``sys.modules`` does not change), which maps the
libcrypto that file was linked with, or finds it already mapped when ``ssl``
or ``hashlib`` came first, and looks each function up through that handle, so
the dynamic linker resolves it in exactly that libcrypto (an interpreter with
``_hashlib`` built in: in the libcrypto the interpreter itself links).
Importing this module raises OSError when there is no such libcrypto.

``PublicKey.ed25519(raw)`` and ``PublicKey.p256(x, y)`` make keys (ValueError
for key material OpenSSL refuses, such as a point not on the curve);
``PublicKey.verify(message, signature)`` says whether a JWS signature
(Ed25519's 64 bytes, or ES256's raw 32-byte r and s) is valid. OpenSSL's
error queue is emptied after every failure, so ``ssl`` and ``hashlib`` never
see our errors. Thread-safe as OpenSSL is; nothing blocks.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import sys
from typing import Any

# NID_ED25519; the DER SubjectPublicKeyInfo head of an uncompressed P-256 point (RFC 5480).
_ED25519 = 1087
_P256_SPKI = bytes.fromhex("3059301306072a8648ce3d020106082a8648ce3d030107034200")


def _openssl_module_file() -> str | None:
    """The file of ``_hashlib``, Python's own binding of libcrypto; None when it is built
    into the interpreter. Raises OSError when this Python has no ``_hashlib``."""
    if "_hashlib" in sys.builtin_module_names:
        return None
    spec = importlib.machinery.PathFinder.find_spec("_hashlib")
    if spec is None or spec.origin is None:
        raise OSError("this Python has no _hashlib (no OpenSSL to verify with)")
    return spec.origin


def _bind() -> ctypes.CDLL:
    """libcrypto's functions, looked up through ``_hashlib``'s handle (module doc)."""
    path = _openssl_module_file()
    lib = ctypes.CDLL(path)  # dlopen only: _hashlib is not imported
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    signatures: dict[str, tuple[object, list[object]]] = {
        "EVP_PKEY_new_raw_public_key": (vp, [ctypes.c_int, vp, ctypes.c_char_p, sz]),
        "d2i_PUBKEY": (vp, [vp, ctypes.POINTER(ctypes.c_char_p), ctypes.c_long]),
        "EVP_PKEY_free": (None, [vp]),
        "EVP_MD_CTX_new": (vp, []),
        "EVP_MD_CTX_free": (None, [vp]),
        "EVP_sha256": (vp, []),
        "EVP_DigestVerifyInit": (ctypes.c_int, [vp, vp, vp, vp, vp]),
        "EVP_DigestVerify": (ctypes.c_int, [vp, ctypes.c_char_p, sz, ctypes.c_char_p, sz]),
        "ERR_clear_error": (None, []),
    }
    for name, (restype, argtypes) in signatures.items():
        try:
            function = getattr(lib, name)
        except AttributeError:
            raise OSError(f"no libcrypto with {name} under {path or 'the interpreter'}") from None
        function.restype = restype
        function.argtypes = argtypes
    return lib


_LIB = _bind()


class PublicKey:
    """An Ed25519 or P-256 public key held by OpenSSL (freed with this object)."""

    def __init__(self, pkey: int, alg: str) -> None:
        self._pkey = pkey
        self.alg = alg  # "EdDSA" or "ES256"

    @classmethod
    def ed25519(cls, raw: bytes) -> PublicKey:
        """A key from its 32 raw bytes. ValueError when OpenSSL refuses them."""
        if len(raw) != 32:
            raise ValueError("an Ed25519 key is not 32 bytes")
        return cls(_made(_LIB.EVP_PKEY_new_raw_public_key(_ED25519, None, raw, 32)), "EdDSA")

    @classmethod
    def p256(cls, x: bytes, y: bytes) -> PublicKey:
        """A key from its 32-byte coordinates. ValueError for a point not on the curve."""
        if len(x) != 32 or len(y) != 32:
            raise ValueError("a P-256 coordinate is not 32 bytes")
        der = _P256_SPKI + b"\x04" + x + y
        cursor = ctypes.c_char_p(der)
        return cls(_made(_LIB.d2i_PUBKEY(None, ctypes.byref(cursor), len(der))), "ES256")

    def verify(self, message: bytes, signature: bytes) -> bool:
        """Whether ``signature`` (as a JWS carries it for this key's algorithm) signs
        ``message``."""
        if self.alg == "ES256":
            if len(signature) != 64:
                return False
            signature, md = _dss_der(signature[:32], signature[32:]), _LIB.EVP_sha256()
        else:
            md = None
        ctx = _LIB.EVP_MD_CTX_new()
        if not ctx:
            raise MemoryError("OpenSSL could not allocate a digest context")
        try:
            ok = bool(_LIB.EVP_DigestVerifyInit(ctx, None, md, None, self._pkey) == 1
                      and _LIB.EVP_DigestVerify(ctx, signature, len(signature), message,
                                                len(message)) == 1)
        finally:
            _LIB.EVP_MD_CTX_free(ctx)
        if not ok:
            _LIB.ERR_clear_error()
        return ok

    def __del__(self, _free: Any = _LIB.EVP_PKEY_free) -> None:  # bound now: at exit the
        _free(self._pkey)  # module's globals may be gone before the last key


def _made(pkey: int | None) -> int:
    """``pkey``, or ValueError (OpenSSL's error queue emptied) when OpenSSL made none."""
    if not pkey:
        _LIB.ERR_clear_error()
        raise ValueError("OpenSSL refused the key material")
    return pkey


def _dss_der(r: bytes, s: bytes) -> bytes:
    """The DER ECDSA-Sig-Value (RFC 3279) of big-endian ``r`` and ``s``."""
    body = _der_int(r) + _der_int(s)
    return b"\x30" + bytes([len(body)]) + body  # at most 70 bytes: short length form


def _der_int(value: bytes) -> bytes:
    """A non-negative DER INTEGER of big-endian ``value``, minimally encoded."""
    value = value.lstrip(b"\x00") or b"\x00"
    if value[0] & 0x80:
        value = b"\x00" + value
    return b"\x02" + bytes([len(value)]) + value
