"""sd_notify by hand: one datagram to systemd's notify socket, no dependency.

``NOTIFY_SOCKET`` names either a filesystem path ("/run/systemd/notify") or
an abstract-namespace socket ("@name", sent as a leading NUL byte). Sending
never blocks: a receiver whose queue is full is an error, not a wait. Other
address families systemd knows (``vsock:``) are refused with a reason.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

NOTIFY_ENV = "NOTIFY_SOCKET"


class NotifyError(Exception):
    """The notify socket is unusable or the datagram was not sent; ``str()`` says why."""


def notify_address(value: str) -> str:
    """The AF_UNIX address ``NOTIFY_SOCKET`` names; raises NotifyError when it names none."""
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    raise NotifyError(
        f"{NOTIFY_ENV}={value!r} is neither an absolute path nor an @abstract socket name"
    )


def notify_socket_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The ``NOTIFY_SOCKET`` of ``environ`` (default: this process's), None when unset or empty."""
    return (os.environ if environ is None else environ).get(NOTIFY_ENV) or None


def sd_notify(message: str, notify_socket: str) -> None:
    """Send ``message`` ("READY=1\\nSTATUS=...") as one datagram to ``notify_socket``.

    Does not block. Raises NotifyError when the address is bad, nobody
    listens there, or the datagram cannot be queued.
    """
    address = notify_address(notify_socket)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.setblocking(False)
        try:
            sock.sendto(message.encode(), address)
        except OSError as err:
            raise NotifyError(
                f"cannot notify {notify_socket}: {err.strerror or type(err).__name__}"
            ) from None
