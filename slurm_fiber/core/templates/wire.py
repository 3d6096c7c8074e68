"""The message format between fiberd, a template and its spares: one JSON object per datagram.

Each channel is a ``SOCK_SEQPACKET`` socketpair, so every message arrives
whole or not at all and file descriptors ride along with SCM_RIGHTS.
Messages are dicts with a ``t`` (type):

parent → template: ``warm`` (first, once: preload, warm, cgroup), ``spare``
(fork one spare; its order channel rides along), ``spawn`` (start one exec
fiber's program in its leaf, core/exec_spawn.py: the fields of ``spare`` and
its ``run`` ``order``; its stdio rides along; reaped as a spare is),
``reap`` (a ``pid`` whose pidfd showed its exit before its ``exit`` came:
reap and report it now if it is the template's exited child;
core/child_exits.py), ``stop``.
template → parent: ``ready``, ``warm_failed`` (error class, one line),
``spared`` / ``fork_failed`` (answer to ``spare``, by ``id``), ``spawned``
(its pid; the program's pidfd rides along) / ``spawn_failed`` (answer to
``spawn``), ``exit``
(a reaped spare or fiber, by spare ``id``: wait status and rusage).
parent → spare, on its order channel: ``run`` (once: the fiber's id, mode,
target and arguments or argv, env, cwd; its stdio rides along), or end of
file (dismissed). The fiber then sends its result record (call mode, or an
error before user code) back on the same channel, in datagrams, until it
exits.

Both ends import this module; it holds no state and never blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slurm_fiber.protocol.framing import json_dumps, json_loads

if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

MAX_MESSAGE = 128 * 1024
MAX_FDS = 3  # a spare's order channel; a fiber's stdin, stdout, stderr


# A decoded message: JSON from the peer, its fields unchecked (each reader converts what it
# takes, as template_main does with str(), list() and dict()).
Message = dict[str, "Any"]


class WireError(ValueError):
    """A message that cannot be sent or was not understood (one-line reason)."""


def encode(msg: Mapping[str, object]) -> bytes:
    """The datagram for ``msg`` (``json.dumps``'s text, through json's C encoder:
    ``framing.json_dumps``); raises WireError when it exceeds MAX_MESSAGE."""
    data = json_dumps(msg).encode()
    if len(data) > MAX_MESSAGE:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE}-byte limit")
    return data


def decode(data: bytes) -> Message:
    """The message in ``data`` (UTF-8); raises WireError on anything but a JSON object with
    ``t``. Parsed by json's C scanner without ``json.loads``'s Python layers
    (``framing.json_loads``): a spare decodes its order right after its fork, where each
    page that code touches is a copy-on-write fault (about 60 fewer per exec fiber)."""
    try:
        msg = json_loads(data.decode())
    except ValueError as e:
        raise WireError(f"undecodable message: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise WireError("message is not an object with a type")
    return msg


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line, at most 300 characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]
