"""Validation of a received request: from a decoded frame body to its typed request.

``parse_request`` is a pure function of the decoded body and the number of
descriptors that came with it: it returns a ``Parsed`` (the echoed id and the
op's request, a type of ``requests``) or raises ``ApiError``, a code from
``ErrorCode`` and a one-line reason (and, for bad_request, the field). Unknown
fields are refused, so a typo never silently changes what a request means; a
field of a later version than the request declares (``"v"``) is refused, and a
version fiberd does not speak is ``unsupported_version``. ``TABLE`` holds every
op: its request and reply types, its fields, the version that added it, and
whether it takes descriptors or streams events. The server's side (who answers
each op) is core/api/ops.py; the wire format is docs/socket-protocol.md.
"""

from __future__ import annotations

import enum
import re
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from slurm_fiber.errors import CodedError
from slurm_fiber.protocol import limits
from slurm_fiber.protocol import requests as rq
from slurm_fiber.protocol.limits import (
    EARLY_SINCE,
    MAX_ARG_LEN,
    MAX_ARGV,
    MAX_BATCH,
    MAX_BATCH_FDS,
    MAX_CALL_PATH,
    MAX_CALL_PATH_TEXT,
    MAX_ENV,
    MAX_ENV_VALUE,
    MAX_FDS,
    MAX_GRACE,
    MAX_ID_LEN,
    MAX_PAGE,
    MAX_PATH,
    MAX_PICKLED,
    MAX_TOKEN,
    PAGED_SINCE,
    PICKLED_SINCE,
    STDIO_NAMES,
    VERSIONS,
    WINDOW_SINCE,
)
from slurm_fiber.protocol.names import GPU_VISIBILITY_VARS, valid_uid
from slurm_fiber.protocol.replies import (
    BatchStarted,
    Cancelled,
    Delivered,
    Document,
    Fiber,
    FiberList,
    GrantList,
    Metrics,
    Ready,
    Reply,
)
from slurm_fiber.protocol.requests import (
    BatchItem,
    CallTarget,
    Clone,
    CloneBatch,
    ExecTarget,
    Request,
)

CURSOR_PATTERN = re.compile(r"\d{1,20}")
PICKLED_PATTERN = re.compile(r"[A-Za-z0-9+/]*={0,2}")
TARGET_PATTERN = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
ENV_NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")
FIBER_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
KWARG_PATTERN = re.compile(r"[A-Za-z_]\w{0,127}")
DEVICE_ENV = frozenset(GPU_VISIBILITY_VARS)  # set by the grant's devices, never by a request


class ErrorCode(enum.StrEnum):
    """Why a request got no answer. Misses (core/misses.py) are not errors."""

    BAD_FRAME = limits.BAD_FRAME  # body is not UTF-8 JSON
    FRAME_TOO_LARGE = limits.FRAME_TOO_LARGE  # length header over the cap (connection closed)
    BAD_REQUEST = limits.BAD_REQUEST  # missing/unknown field, wrong type, out of range
    UNKNOWN_OP = limits.UNKNOWN_OP
    UNSUPPORTED_VERSION = limits.UNSUPPORTED_VERSION
    BAD_FDS = limits.BAD_FDS  # descriptors where none belong, or not matching "stdio"
    FORBIDDEN = limits.FORBIDDEN  # peer uid/gid not allowed (connection closed)
    BUSY = limits.BUSY  # too many connections, or a request during a stream
    TIMEOUT = limits.TIMEOUT  # idle or slow client (connection closed)
    NOT_FOUND = limits.NOT_FOUND  # no such fiber
    CLOSED = limits.CLOSED  # fiberd is shutting down
    INTERNAL = limits.INTERNAL  # the runtime failed on this request; the server carries on


class ApiError(CodedError):
    """A refusal: code, one-line reason and, for bad_request, the offending field."""

    code: ErrorCode

    def __init__(self, code: ErrorCode, reason: str, field: str | None = None) -> None:
        super().__init__(code, reason)
        self.field = field

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"code": self.code.value, "reason": self.reason}
        if self.field is not None:
            out["field"] = self.field
        return out


@dataclass(frozen=True)
class Parsed:
    """A validated request: the id to echo and the op's typed request."""

    id: int | str | None
    request: Request


# --- field readers ----------------------------------------------------------------------


class _Fields:
    """Reads an op's fields from the request object, refusing what does not fit."""

    def __init__(self, body: Mapping[str, Any], allowed: frozenset[str]) -> None:
        unknown = sorted(set(body) - allowed - {"op", "id", "v"})
        if unknown:
            raise ApiError(ErrorCode.BAD_REQUEST, f"unknown field {unknown[0]!r}", unknown[0])
        self.body = body

    def get(self, name: str, kind: type | tuple[type, ...], what: str,
            required: bool = False) -> Any:
        if name not in self.body:
            if required:
                raise ApiError(ErrorCode.BAD_REQUEST, f"missing field {name!r} ({what})", name)
            return None
        value = self.body[name]
        if isinstance(value, bool) and bool not in _as_tuple(kind):
            value = None  # JSON true/false is not a number here
        if not isinstance(value, kind):
            raise ApiError(ErrorCode.BAD_REQUEST, f"field {name!r} must be {what}", name)
        return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _text(value: str, name: str, limit: int) -> str:
    if len(value) > limit:
        raise ApiError(ErrorCode.BAD_REQUEST, f"field {name!r} is over {limit} characters", name)
    if "\0" in value:
        raise ApiError(ErrorCode.BAD_REQUEST, f"field {name!r} contains a NUL character", name)
    return value


def _fiber_id(f: _Fields) -> str:
    value: str = f.get("fiber", str, "a fiber id string", required=True)
    if not FIBER_ID_PATTERN.fullmatch(value):
        raise ApiError(ErrorCode.BAD_REQUEST, "field 'fiber' is not a valid fiber id", "fiber")
    return value


def parse_signal(value: object) -> int:
    """A signal number from an int or a name ("INT", "SIGINT"). Raises ApiError."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value in {int(s) for s in signal.Signals}:
            return value
    elif isinstance(value, str):
        name = value.upper() if value.upper().startswith("SIG") else "SIG" + value.upper()
        if name in signal.Signals.__members__:
            return int(signal.Signals[name])
    raise ApiError(ErrorCode.BAD_REQUEST, f"{value!r} is not a signal", "signal")


def _env(raw: Mapping[str, Any]) -> dict[str, str]:
    if len(raw) > MAX_ENV:
        raise ApiError(ErrorCode.BAD_REQUEST, f"'env' has over {MAX_ENV} entries", "env")
    out: dict[str, str] = {}
    for key, value in raw.items():
        if not ENV_NAME_PATTERN.fullmatch(key):
            raise ApiError(ErrorCode.BAD_REQUEST, f"env name {key[:40]!r} is not valid", "env")
        if key in DEVICE_ENV:
            raise ApiError(ErrorCode.BAD_REQUEST,
                           f"env {key} is set by the grant's devices, not by a request", "env")
        if not isinstance(value, str):
            raise ApiError(ErrorCode.BAD_REQUEST, f"env {key} must be a string", "env")
        out[key] = _text(value, "env", MAX_ENV_VALUE)
    return out


def _call(raw: Mapping[str, Any], version: int) -> CallTarget:
    f = _Fields(raw, frozenset({"target", "args", "kwargs", "pickled", "path"}))
    path = _call_path(f)
    pickled = f.get("pickled", str, "base64 text")
    if pickled is not None:
        return _pickled_call(f, pickled, version, path)
    target = f.get("target", str, "'module:function'", required=True)
    if len(target) > 512 or not TARGET_PATTERN.fullmatch(target):
        raise ApiError(ErrorCode.BAD_REQUEST, "call.target must be 'module:function'", "call")
    args = f.get("args", list, "a JSON array") or []
    kwargs = f.get("kwargs", dict, "a JSON object") or {}
    bad = next((k for k in kwargs if not KWARG_PATTERN.fullmatch(k)), None)
    if bad is not None:
        raise ApiError(ErrorCode.BAD_REQUEST, f"call.kwargs name {bad[:40]!r} is invalid", "call")
    return CallTarget(target=target, args=tuple(args), kwargs=kwargs, path=path)


def _call_path(f: _Fields) -> tuple[str, ...]:
    """``call.path``: the caller's import path (absolute directories), put first on the
    fiber's ``sys.path`` where safe (template_main); at most MAX_CALL_PATH entries of
    MAX_CALL_PATH_TEXT characters in all."""
    entries = f.get("path", list, "a JSON array of absolute paths") or []
    if len(entries) > MAX_CALL_PATH or not all(
            isinstance(e, str) and e.startswith("/") and "\0" not in e for e in entries):
        raise ApiError(ErrorCode.BAD_REQUEST, f"call.path must be at most {MAX_CALL_PATH} "
                       "absolute paths", "call")
    if sum(len(e) for e in entries) > MAX_CALL_PATH_TEXT:
        raise ApiError(ErrorCode.BAD_REQUEST,
                       f"call.path is over {MAX_CALL_PATH_TEXT} characters", "call")
    return tuple(entries)


def _pickled_call(f: _Fields, pickled: str, version: int,
                  path: tuple[str, ...] = ()) -> CallTarget:
    """A v2 pickled call: fiberd checks only the text's shape; the fiber alone unpickles it."""
    if version < PICKLED_SINCE:
        raise ApiError(ErrorCode.BAD_REQUEST,
                       f"call.pickled needs \"v\": {PICKLED_SINCE} in the request", "call")
    if "args" in f.body or "kwargs" in f.body:
        raise ApiError(ErrorCode.BAD_REQUEST,
                       "a pickled call carries its arguments inside call.pickled", "call")
    if not pickled or len(pickled) > MAX_PICKLED or not PICKLED_PATTERN.fullmatch(pickled):
        raise ApiError(ErrorCode.BAD_REQUEST,
                       f"call.pickled must be 1..{MAX_PICKLED} characters of base64", "call")
    target = f.get("target", str, "'module:function'")
    if target is not None and (len(target) > 512 or not TARGET_PATTERN.fullmatch(target)):
        raise ApiError(ErrorCode.BAD_REQUEST, "call.target must be 'module:function'", "call")
    return CallTarget(target=target, pickled=pickled, path=path)


def _exec(raw: Mapping[str, Any]) -> ExecTarget:
    f = _Fields(raw, frozenset({"argv", "cwd"}))
    argv = f.get("argv", list, "a non-empty array of strings", required=True)
    if not argv or len(argv) > MAX_ARGV or not all(isinstance(a, str) for a in argv):
        raise ApiError(ErrorCode.BAD_REQUEST,
                       f"exec.argv must be 1..{MAX_ARGV} strings", "exec")
    for a in argv:
        _text(a, "exec", MAX_ARG_LEN)
    if not argv[0]:
        raise ApiError(ErrorCode.BAD_REQUEST, "exec.argv[0] is empty", "exec")
    cwd = f.get("cwd", str, "an absolute path")
    if cwd is not None and not _text(cwd, "exec", MAX_PATH).startswith("/"):
        raise ApiError(ErrorCode.BAD_REQUEST, "exec.cwd must be an absolute path", "exec")
    return ExecTarget(argv=tuple(argv), cwd=cwd)


def _stdio(names: list[Any] | None, nfds: int) -> tuple[str, ...]:
    names = names or []
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names) \
            or not set(names) <= set(STDIO_NAMES):
        raise ApiError(ErrorCode.BAD_REQUEST,
                       "'stdio' must list distinct names of stdin, stdout, stderr", "stdio")
    if nfds != len(names):
        raise ApiError(ErrorCode.BAD_FDS,
                       f"{nfds} descriptors passed but 'stdio' names {len(names)}")
    return tuple(names)


_CLONE_FIELDS = frozenset({"call", "exec", "grant", "token", "env", "stdio", "wait", "hangup",
                           "early"})


def _early(f: _Fields) -> bool:
    """The ``early`` flag (v4): with ``wait``, each call fiber's ``result`` event as soon as
    the fiber has written its result, before its ``exit`` event."""
    early = f.get("early", bool, "true or false") is True
    if early and f.body.get("v", 1) < EARLY_SINCE:
        raise ApiError(ErrorCode.BAD_REQUEST,
                       f"'early' needs \"v\": {EARLY_SINCE} in the request", "v")
    return early


def _clone(f: _Fields, nfds: int, need_target: bool = True) -> Clone:
    version = f.body.get("v", 1)
    call_raw = f.get("call", dict, "an object {target, args, kwargs}")
    exec_raw = f.get("exec", dict, "an object {argv, cwd}")
    if need_target and (call_raw is None) == (exec_raw is None):
        raise ApiError(ErrorCode.BAD_REQUEST, "a clone needs exactly one of 'call' and 'exec'")
    grant = f.get("grant", str, "a grant UID")
    token = f.get("token", str, "a compact JWS string")
    if grant is not None and token is not None:
        raise ApiError(ErrorCode.BAD_REQUEST, "give 'grant' or 'token', not both")
    if grant is not None and not valid_uid(grant):
        raise ApiError(ErrorCode.BAD_REQUEST, "field 'grant' is not a valid grant UID", "grant")
    if token is not None:
        _text(token, "token", MAX_TOKEN)
    return Clone(
        call=_call(call_raw, version) if call_raw is not None else None,
        exec=_exec(exec_raw) if exec_raw is not None else None,
        grant=grant,
        token=token,
        env=_env(f.get("env", dict, "an object of strings") or {}),
        stdio=_stdio(f.get("stdio", list, "an array of names"), nfds),
        wait=bool(f.get("wait", bool, "true or false")),
        hangup=f.get("hangup", bool, "true or false") is not False,
        early=_early(f),
    )


_ITEM_FIELDS = frozenset({"key", "call", "exec", "env", "stdio"})
_BATCH_FIELDS = frozenset({"items", "grant", "token", "env", "wait", "hangup", "early",
                           "window"})


def _batch(f: _Fields, nfds: int) -> CloneBatch:
    """Validate a batch: what is wrong with the whole request (its shared fields, the
    descriptors) refuses it; what is wrong with one item refuses that item only."""
    raw = f.get("items", list, f"an array of 1..{MAX_BATCH} objects", required=True)
    if not 1 <= len(raw) <= MAX_BATCH:
        raise ApiError(ErrorCode.BAD_REQUEST, f"'items' must hold 1..{MAX_BATCH} items", "items")
    shared = {k: f.body[k] for k in ("grant", "token", "env", "v") if k in f.body}
    _clone(_Fields(shared, _CLONE_FIELDS), 0, need_target=False)  # refuses bad shared fields
    names = [_item_stdio(item) for item in raw]
    if nfds != sum(len(n) for n in names):
        raise ApiError(ErrorCode.BAD_FDS, f"{nfds} descriptors passed but the items' 'stdio' "
                       f"name {sum(len(n) for n in names)}")
    items: list[BatchItem] = []
    seen: set[str] = set()
    for item, stdio in zip(raw, names, strict=True):
        key = item.get("key") if isinstance(item, dict) else None
        try:
            if not isinstance(item, dict):
                raise ApiError(ErrorCode.BAD_REQUEST, "an item must be a JSON object", "items")
            if not isinstance(key, str) or not FIBER_ID_PATTERN.fullmatch(key):
                key = None
                raise ApiError(ErrorCode.BAD_REQUEST, "item 'key' must be a string of 1..128 "
                               "letters, digits and ._:- (not first)", "key")
            if key in seen:
                raise ApiError(ErrorCode.BAD_REQUEST, f"item key {key!r} is given twice", "key")
            seen.add(key)
            fields = _Fields(item, _ITEM_FIELDS)
            own_env = _env(fields.get("env", dict, "an object of strings") or {})
            body = {**shared, **{k: v for k, v in item.items() if k in ("call", "exec")},
                    "env": {**shared.get("env", {}), **own_env}}
            clone = _clone(_Fields(body, _CLONE_FIELDS), 0)
            clone.stdio = stdio
            items.append(BatchItem(key, clone, stdio))
        except ApiError as err:
            items.append(BatchItem(key, None, stdio, err))
    wait = bool(f.get("wait", bool, "true or false"))
    return CloneBatch(tuple(items), grant=f.body.get("grant"), token=f.body.get("token"),
                      env=_env(f.body.get("env") or {}), wait=wait,
                      hangup=f.get("hangup", bool, "true or false") is not False,
                      early=_early(f), window=_window(f, wait))


def _window(f: _Fields, wait: bool) -> int | None:
    """A batch's ``window`` (v5): how many of its fibers may run at once; the rest start
    in order as earlier ones end, so it streams, and needs ``wait``."""
    window: int | None = f.get("window", int, f"1..{MAX_BATCH}")
    if window is None:
        return None
    if f.body.get("v", 1) < WINDOW_SINCE:
        raise ApiError(ErrorCode.BAD_REQUEST,
                       f"'window' needs \"v\": {WINDOW_SINCE} in the request", "v")
    if not 1 <= window <= MAX_BATCH:
        raise ApiError(ErrorCode.BAD_REQUEST, f"'window' must be 1..{MAX_BATCH}", "window")
    if not wait:
        raise ApiError(ErrorCode.BAD_REQUEST, "'window' needs \"wait\": true (later items "
                       "start as earlier fibers end, on this connection)", "window")
    return window


def _item_stdio(item: object) -> tuple[str, ...]:
    """An item's descriptor names; a bad list refuses the whole batch (the descriptors
    that follow could not be told apart)."""
    names = item.get("stdio") if isinstance(item, dict) else None
    if names is not None and not isinstance(names, list):
        raise ApiError(ErrorCode.BAD_REQUEST, "an item's 'stdio' must be an array", "stdio")
    return _stdio(names, len(names or []))


def _list(f: _Fields) -> rq.ListFibers:
    after = f.get("after", str, "a cursor from a previous page's 'next'")
    limit = f.get("limit", int, f"1..{MAX_PAGE}")
    if (after is not None or limit is not None) and f.body.get("v", 1) < PAGED_SINCE:
        raise ApiError(ErrorCode.BAD_REQUEST,
                       f"paging (after, limit) needs \"v\": {PAGED_SINCE} in the request", "v")
    if after is not None and not CURSOR_PATTERN.fullmatch(after):
        raise ApiError(ErrorCode.BAD_REQUEST, "field 'after' is not a cursor this fiberd "
                       "gave ('next' of a page)", "after")
    if limit is not None and not 1 <= limit <= MAX_PAGE:
        raise ApiError(ErrorCode.BAD_REQUEST, f"'limit' must be 1..{MAX_PAGE}", "limit")
    ended = f.get("ended", bool, "true or false")
    return rq.ListFibers(after, limit, bool(ended))


def _stop(f: _Fields) -> rq.StopFiber:
    grace = f.get("grace", (int, float), "seconds")
    if grace is not None and not 0 <= grace <= MAX_GRACE:
        raise ApiError(ErrorCode.BAD_REQUEST, f"'grace' must be 0..{MAX_GRACE:g} s", "grace")
    return rq.StopFiber(_fiber_id(f), None if grace is None else float(grace))


@dataclass(frozen=True)
class OpSpec:
    """One op of the protocol: its request and reply types and how a request is read.

    ``fields`` are the request fields it takes, ``parse`` builds its request from
    them (and the number of descriptors that came); ``since`` is the protocol
    version that added it (a request for it must say ``"v"`` at least that);
    ``descriptors``: it may carry descriptors; ``streams``: it is answered with
    events on its connection (docs/socket-protocol.md, "The conversation").
    """

    request: type[Request]
    reply: type[Reply]
    fields: frozenset[str]
    parse: Callable[[_Fields, int], Request]
    descriptors: bool = False
    streams: bool = False

    @property
    def name(self) -> str:
        return self.request.OP

    @property
    def since(self) -> int:
        return self.request.SINCE


def _plain(request: type[Request], reply: type[Reply]) -> OpSpec:
    """An op without fields."""
    return OpSpec(request, reply, frozenset(), lambda _f, _n: request())


def _signal(f: _Fields) -> rq.SignalFiber:
    return rq.SignalFiber(_fiber_id(f), parse_signal(
        f.get("signal", (int, str), "a signal number or name", required=True)))


TABLE: dict[str, OpSpec] = {spec.name: spec for spec in (
    OpSpec(Clone, Fiber, _CLONE_FIELDS, _clone, descriptors=True, streams=True),
    OpSpec(CloneBatch, BatchStarted, _BATCH_FIELDS, _batch, descriptors=True, streams=True),
    OpSpec(rq.Cancel, Cancelled, frozenset(), lambda _f, _n: rq.Cancel(), streams=True),
    OpSpec(rq.InspectFiber, Fiber, frozenset({"fiber"}),
           lambda f, _n: rq.InspectFiber(_fiber_id(f))),
    OpSpec(rq.StopFiber, Fiber, frozenset({"fiber", "grace"}), lambda f, _n: _stop(f)),
    OpSpec(rq.SignalFiber, Delivered, frozenset({"fiber", "signal"}), lambda f, _n: _signal(f)),
    OpSpec(rq.ListFibers, FiberList, frozenset({"after", "limit", "ended"}),
           lambda f, _n: _list(f)),
    _plain(rq.ListGrants, GrantList),
    _plain(rq.Status, Document),
    _plain(rq.Health, Document),
    _plain(rq.Ready, Ready),
    _plain(rq.Metrics, Metrics),
)}
OPS: tuple[str, ...] = tuple(TABLE)


def max_fds(op: object) -> int:
    """How many descriptors a request for ``op`` may carry."""
    return MAX_BATCH_FDS if op == "clone_batch" else MAX_FDS


def request_id(body: object) -> int | str | None:
    """The id to echo in a reply: the request's id when it is a valid one, else None."""
    if not isinstance(body, dict):
        return None
    rid = body.get("id")
    if isinstance(rid, int) and not isinstance(rid, bool) and abs(rid) < 2**53:
        return rid
    if isinstance(rid, str) and len(rid) <= MAX_ID_LEN:
        return rid
    return None


def parse_request(body: object, nfds: int) -> Parsed:
    """Validate one decoded frame body that came with ``nfds`` descriptors.

    Pure; raises ApiError (bad_request, unknown_op, unsupported_version,
    bad_fds) for anything that does not fit. Descriptors are only accepted
    on ``clone`` (at most MAX_FDS, matching its ``stdio`` list) and
    ``clone_batch`` (at most MAX_BATCH_FDS, matching its items' lists).
    """
    if not isinstance(body, dict):
        raise ApiError(ErrorCode.BAD_REQUEST, "a request must be a JSON object")
    if "id" in body and request_id(body) is None:
        raise ApiError(ErrorCode.BAD_REQUEST,
                       f"'id' must be an integer or a string of at most {MAX_ID_LEN}", "id")
    if body.get("v", 1) not in VERSIONS or isinstance(body.get("v"), bool):
        raise ApiError(ErrorCode.UNSUPPORTED_VERSION, "this fiberd speaks protocol "
                       + ", ".join(f"v{v}" for v in VERSIONS))
    op = body.get("op")
    if not isinstance(op, str):
        raise ApiError(ErrorCode.BAD_REQUEST, "field 'op' (a string) is required", "op")
    spec = TABLE.get(op)
    if spec is None:
        raise ApiError(ErrorCode.UNKNOWN_OP, f"unknown op {op[:40]!r}; known: {', '.join(OPS)}")
    if nfds and not spec.descriptors:
        raise ApiError(ErrorCode.BAD_FDS,
                       f"descriptors are only accepted on clone and clone_batch, not {op!r}")
    most = max_fds(op)
    if nfds > most:
        raise ApiError(ErrorCode.BAD_FDS, f"{nfds} descriptors passed; at most {most}")
    if body.get("v", 1) < spec.since:
        raise ApiError(ErrorCode.BAD_REQUEST, f"op {op!r} needs \"v\": {spec.since} in the request",
                       "v")
    return Parsed(request_id(body), spec.parse(_Fields(body, spec.fields), nfds))


# --- replies ------------------------------------------------------------------------------


def ok_reply(rid: int | str | None, result: Mapping[str, object], event: str | None = None,
             final: bool = True) -> dict[str, object]:
    """A success reply; ``event`` names a clone stream event (started, exit)."""
    out: dict[str, object] = {"id": rid, "ok": True, "final": final}
    if event is not None:
        out["event"] = event
    out["result"] = dict(result)
    return out


def error_reply(rid: int | str | None, error: ApiError) -> dict[str, object]:
    """A refusal reply (always final)."""
    return {"id": rid, "ok": False, "final": True, "error": error.to_json()}
