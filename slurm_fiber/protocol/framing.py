"""Frames on the fiberd socket: a 4-byte big-endian length, then that many bytes of JSON.

This module is sans-I/O: ``encode_frame`` turns a message into bytes and
``FrameDecoder`` turns received bytes (and the file descriptors that arrived
with them) back into frames. File descriptors passed with SCM_RIGHTS belong
to the frame whose first byte they arrived with, which is how a sender
attaches them (one ``sendmsg`` per frame). A decoder never holds more than
one frame's worth of bytes beyond the cap, so a hostile peer cannot make the
server buffer without bound; a length over the cap is a fatal framing error
(the stream cannot be resynchronised), a body that is not a JSON object is a
recoverable one (the next frame still parses).

``json_dumps`` and ``json_loads`` are ``json.dumps`` and ``json.loads``, exactly,
without importing ``json`` for what a client usually sends and receives (the
``json`` package imports ``re`` and ``enum``, outside the client's import budget,
slurm_fiber/client/__init__.py). They call the
C accelerator ``json`` itself calls (``_json``), set as ``json``'s defaults, and
hand anything else (every error, NaN and Infinity, whitespace around a value, an
interpreter without ``_json``) to ``json``, so every value, string and exception
is ``json``'s own.
"""

from __future__ import annotations

import os
import struct
from types import SimpleNamespace

from slurm_fiber.errors import CodedError
from slurm_fiber.protocol.limits import DEFAULT_MAX_FRAME

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (fiberctl imports this)
if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

HEADER = struct.Struct(">I")
MAX_DEPTH = 64  # nesting levels of arrays and objects in a frame body
_TOO_DEEP = f"frame body nests arrays/objects deeper than {MAX_DEPTH} levels"
_STRING = rb'"[^"\\]*(?:\\.[^"\\]*)*"'  # a JSON string, escapes and all (a regex)
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_BRACKET_WEIGHT = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")


class _Unusual(Exception):
    """Something the C codec met that ``json`` handles in Python: ``json`` does it."""


def _unusual(_value: object) -> object:
    raise _Unusual


try:
    from _json import encode_basestring, encode_basestring_ascii, make_encoder, make_scanner

    # json.JSONDecoder()'s settings, json.loads's own, but NaN and Infinity left to json
    _scan: make_scanner | None = make_scanner(SimpleNamespace(  # type: ignore[arg-type]
        strict=True, object_hook=None, object_pairs_hook=None, parse_float=float,
        parse_int=int, parse_constant=_unusual))
except Exception:  # no accelerator, or one that wants other settings: json, always
    _scan = None


def json_loads(text: str) -> object:
    """``json.loads(text)``: the value, or the exception json raises."""
    if _scan is not None:
        try:
            value, end = _scan(text, 0)
        except RecursionError:  # json's scanner is this one: it would only fail again
            raise
        except Exception:  # not JSON, or not plain JSON: json says what
            pass
        else:
            if end == len(text):  # one value, nothing around it
                return value
    import json

    return json.loads(text)


def json_dumps(value: object, compact: bool = False) -> str:
    """``json.dumps(value)``, or with ``compact`` ``json.dumps(value, separators=(",", ":"),
    ensure_ascii=False)`` (a frame body's form): the text, or the exception json raises."""
    if _scan is not None:
        try:  # json.dumps's own encoder: json.JSONEncoder.iterencode's, check_circular on
            encode = make_encoder({}, _unusual, encode_basestring if compact
                                  else encode_basestring_ascii, None, ":" if compact else ": ",
                                  "," if compact else ", ", False, False, True)
            return "".join(encode(value, 0))
        except Exception:  # not JSON-able as it is: json says what
            pass
    import json

    if compact:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return json.dumps(value)


def close_all(fds: Iterable[int]) -> None:
    """Close each descriptor, ignoring ones already closed."""
    for fd in fds:
        try:  # noqa: SIM105 - contextlib.suppress: an import a fiberctl started per task spares
            os.close(fd)
        except OSError:
            pass


class FramingError(CodedError):
    """The byte stream is unusable from here on (oversize or zero length); close it."""


class Frame:
    """One received frame: its parsed JSON body, or why it did not parse, and its fds.

    ``fds`` are open descriptors now owned by whoever holds the frame; they
    must be closed (``close_fds``) or handed on. ``fds_truncated`` says the
    kernel dropped descriptors because more arrived than fit. (A plain class,
    not a dataclass: a client started per task does not pay for importing
    dataclasses and inspect.)
    """

    __slots__ = ("body", "error", "fds", "fds_truncated")

    def __init__(self, body: object = None, error: str | None = None) -> None:
        self.body = body
        self.error = error
        self.fds: list[int] = []
        self.fds_truncated = False

    def close_fds(self) -> None:
        """Close every descriptor this frame carries (idempotent)."""
        close_all(self.fds)
        self.fds.clear()


def encode_frame(message: object, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """Serialise ``message`` as one frame. Raises ValueError when the body exceeds the cap."""
    body = json_dumps(message, compact=True).encode()
    if len(body) > max_frame:
        raise ValueError(f"frame of {len(body)} bytes exceeds the {max_frame}-byte cap")
    return HEADER.pack(len(body)) + body


def parse_body(body: bytes) -> tuple[object, str | None]:
    """The JSON value of a frame body, or (None, a one-line reason it is not usable JSON).

    Never raises. Nesting deeper than ``MAX_DEPTH`` is refused: beyond what
    the C parser takes (it raises RecursionError) and below it, so that no
    later step (validation, encoding for a template, audit) recurses on it.
    """
    try:
        value = json_loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "frame body is not UTF-8"
    except ValueError as e:
        from json import JSONDecodeError  # json_loads has imported json to raise it

        if isinstance(e, JSONDecodeError):
            return None, f"frame body is not JSON ({e.msg} at byte {e.pos})"
        # valid JSON Python will not build, e.g. an int past 4300 digits
        return None, f"frame body is not usable JSON ({e})"
    except RecursionError:
        return None, _TOO_DEEP
    # Only a body with more brackets than MAX_DEPTH can nest that deep: skip the walk otherwise.
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and _depth(body) > MAX_DEPTH:
        return None, _TOO_DEEP
    return value, None


def _depth(body: bytes) -> int:
    """How deeply arrays and objects nest in ``body``, valid JSON (a scalar is 0).

    Works on the bytes at C speed (about one parse's cost): strings are cut
    out, then the running count of brackets is taken with accumulate.
    """
    import operator  # these three on the first deep-looking body: not in a client's start-up
    import re
    from itertools import accumulate, count

    brackets = re.sub(_STRING, b"", body).translate(None, _NOT_BRACKET)
    if not brackets:
        return 0
    # opening brackets weigh 2, closing 0: the running sum minus the count is the depth
    return int(max(map(operator.sub, accumulate(brackets.translate(_BRACKET_WEIGHT)), count(1))))


class FrameDecoder:
    """Accumulates bytes and fds from one stream and yields whole frames in order.

    Not thread-safe; one per connection. ``feed`` never raises; ``next_frame``
    returns None until a whole frame is buffered and raises FramingError on a
    header that announces zero or more than ``max_frame`` bytes.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._consumed = 0  # stream offset of self._buf[0]
        self._fds: list[tuple[int, int]] = []  # (stream offset they arrived at, fd)
        self._truncated_at: set[int] = set()

    def feed(self, data: bytes, fds: Sequence[int] = (), truncated: bool = False) -> None:
        """Append received bytes; ``fds`` arrived with the first of them."""
        offset = self._consumed + len(self._buf)
        self._fds.extend((offset, fd) for fd in fds)
        if truncated:
            self._truncated_at.add(offset)
        self._buf += data

    @property
    def mid_frame(self) -> bool:
        """Whether part of a frame is buffered (a peer that stops here is slow or truncated)."""
        return bool(self._buf)

    def next_frame(self) -> Frame | None:
        """The next whole frame, None if none is complete yet."""
        if len(self._buf) < HEADER.size:
            return None
        (length,) = HEADER.unpack_from(self._buf)
        if length == 0 or length > self.max_frame:
            raise FramingError(
                "frame_too_large" if length else "bad_frame",
                f"frame announces {length} bytes; allowed 1..{self.max_frame}",
            )
        end = HEADER.size + length
        if len(self._buf) < end:
            return None
        start = self._consumed
        body, error = parse_body(bytes(self._buf[HEADER.size:end]))
        del self._buf[:end]
        self._consumed += end
        frame = Frame(body=body, error=error)
        keep: list[tuple[int, int]] = []
        for at, fd in self._fds:
            if at < self._consumed:
                frame.fds.append(fd)
            else:
                keep.append((at, fd))
        self._fds = keep
        frame.fds_truncated = any(start <= at < self._consumed for at in self._truncated_at)
        self._truncated_at = {at for at in self._truncated_at if at >= self._consumed}
        return frame

    def close(self) -> None:
        """Close every descriptor still buffered (call when the connection ends)."""
        close_all(fd for _, fd in self._fds)
        self._fds.clear()
