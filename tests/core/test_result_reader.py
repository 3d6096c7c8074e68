"""The result channel's reader keeps a record the kernel reports after a reset."""

from __future__ import annotations

import socket

from slurm_fiber.core.fibers.fiber import ResultReader
from tests.core.processkit import aio


@aio
async def test_a_record_queued_behind_a_reset_is_still_read():
    ours, fibers = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    reader = ResultReader(ours)
    ours.send(b'{"t": "unread"}')  # the fiber exits without reading this datagram,
    fibers.send(b'{"ok": true, "result": 4}')  # after writing its record:
    fibers.close()  # the kernel reports ECONNRESET once, before the queued record
    assert reader.finish() == {"ok": True, "result": 4}
