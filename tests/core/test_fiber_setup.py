"""A spare's order channel (core/fiber_setup.py ``await_order``), run in this process.

The channel ends closed when ``await_order`` returns, whether the order ran,
was refused or the spare was dismissed, and never through the socket's
finalizer (no ResourceWarning, whose formatting a fiber would pay for).
"""

from __future__ import annotations

import errno
import gc
import os
import socket
import warnings

import pytest

from slurm_fiber.core import template_wire as wire
from slurm_fiber.core.fiber_setup import EXIT_SETUP, ResultChannel, await_order


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError as e:
        return e.errno == errno.EBADF
    return False


@pytest.mark.parametrize(("sent", "code"), [
    (wire.encode({"t": "run", "id": "f1"}), 5),  # run: the runner's code
    (wire.encode({"t": "nope"}), EXIT_SETUP),  # refused, with an error record
    (b"", 0),  # dismissed (end of file)
])
def test_the_channel_is_closed_on_return_without_a_resource_warning(sent: bytes, code: int):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd = theirs.detach()
    ran: list[str] = []

    def run(order: wire.Message, stdio: list[int], result: ResultChannel) -> int:
        ran.append(str(order.get("id")))
        result.write('{"ok": true}')
        return 5

    with ours:
        if sent:
            ours.send(sent)
        else:
            ours.shutdown(socket.SHUT_WR)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert await_order(fd, {}, None, run) == code
            gc.collect()
        assert _closed(fd)
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
        assert ran == (["f1"] if code == 5 else [])
        replies = []
        while data := ours.recv(wire.MAX_MESSAGE):
            replies.append(data)
    assert bool(replies) == (sent != b"")  # a record for a run or a refusal, none when dismissed
