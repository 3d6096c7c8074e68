"""Raw-socket helpers for tests that speak the protocol wrongly on purpose."""

from __future__ import annotations

import json
import socket
import struct
from pathlib import Path


def read_replies(sock: socket.socket) -> list[dict]:
    """Every reply frame until the server closes or goes quiet for 2 s."""
    sock.settimeout(2.0)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    replies = []
    while len(data) >= 4:
        (n,) = struct.unpack(">I", data[:4])
        replies.append(json.loads(data[4:4 + n]))
        data = data[4 + n:]
    return replies


def raw_exchange(path: Path, payload: bytes) -> list[dict]:
    """Send raw bytes on a new connection, half-close, and collect the replies."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(path))
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        return read_replies(sock)
