"""The relay's wire: one JSON array a line, ``[channel, kind, body]``, on srun's stdio.

A relay (nodes/relay.py) and the link that started it (nodes/link.py) exchange lines
``[channel, kind, body]\\n``: ``channel`` a positive integer naming one connection to
the relay node's fiberd, ``kind`` one of KINDS, ``body`` a JSON object. Compact JSON
holds no raw newline, so a line is a message whole, and srun (which may hold a task's
output until a newline, as its ``--unbuffered`` says) passes each as soon as it ends.

- link to relay: ``open`` (``server_uids``: the uids fiberd may run as, or null),
  ``frame`` (a socket-protocol request, as fiberd's framing carries it; descriptors
  cannot cross nodes: a clone's ``stdio`` names what the relay makes on its node),
  ``close``;
- relay to link: ``opened``, ``refused`` (``errno``, ``reason``, ``untrusted``),
  ``frame`` (fiberd's reply or event, as it sent it), ``output`` (``req``: the clone
  request's number on the channel, from 1; ``key``: the batch item's key, null for a
  clone; then ``name`` and ``data`` (base64) for bytes the fiber wrote, or ``done``
  once that item's output is whole or it never ran), ``closed`` (``reason``).

A line longer than MAX_LINE is a broken stream: the reader stops.
"""

from __future__ import annotations

from slurm_fiber.protocol.framing import json_dumps, json_loads

KINDS = frozenset({"open", "frame", "close", "opened", "refused", "output", "closed"})
MAX_LINE = 32 << 20  # a 16 MiB reply, escaped, and room
CHUNK = 1 << 20  # bytes of a fiber's output in one ``output`` line


class WireError(Exception):
    """A line that is not ``[channel, kind, body]``: the stream cannot be trusted on."""


def encode(channel: int, kind: str, body: dict[str, object]) -> bytes:
    """One line of the wire."""
    return (json_dumps([channel, kind, body], compact=True) + "\n").encode()


def decode(line: bytes) -> tuple[int, str, dict[str, object]]:
    """``(channel, kind, body)`` of one line. Raises WireError."""
    try:
        value = json_loads(line.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise WireError(f"not a line of the relay's wire: {err}") from None
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], int)
            and value[1] in KINDS and isinstance(value[2], dict)):
        raise WireError(f"not [channel, kind, body]: {line[:80]!r}")
    return value[0], value[1], value[2]


def clone_items(body: dict[str, object]) -> list[tuple[str | None, list[str]]] | None:
    """A request's items that pass descriptors, ``(key, stdio names)`` in the order the
    descriptors go (a clone's one item has key None); None for a request that is no
    clone or clone_batch."""
    op = body.get("op")
    if op == "clone":
        return [(None, _names(body.get("stdio")))]
    if op == "clone_batch":
        items = body.get("items")
        return [(str(item.get("key")), _names(item.get("stdio")))
                for item in (items if isinstance(items, list) else [])
                if isinstance(item, dict)]
    return None


def _names(value: object) -> list[str]:
    return [str(n) for n in value] if isinstance(value, list) else []
