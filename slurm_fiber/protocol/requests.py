"""One request type per socket op, the same on both ends.

A client builds one and sends ``to_json(id)``; the server's ``validate.parse_request``
builds the same type from a received frame, checked once, and its op table answers
it by its type. Each type names its op (``OP``) and the protocol version that added
it (``SINCE``); ``version()`` is the version an instance needs (a field of a later
version raises it), so a client never declares more than its request uses and an
older fiberd still takes what it understands.

Plain classes with slots and nothing imported: the client loads this module for
every ``fiberctl run`` (the client package's import budget, slurm_fiber/client).
"""

from __future__ import annotations

from slurm_fiber.protocol.limits import (
    BATCH_SINCE,
    EARLY_SINCE,
    PAGED_SINCE,
    PICKLED_SINCE,
    WINDOW_SINCE,
)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (the client's budget)
if TYPE_CHECKING:
    from collections.abc import Mapping


class _Value:
    """Slots as fields: equality and ``repr`` by them."""

    __slots__: tuple[str, ...] = ()

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self).__name__, *map(repr, self._values())))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{type(self).__name__}({fields})"


class Peer(_Value):
    """Who is on the other end of a connection, from SO_PEERCRED at accept time."""

    __slots__ = ("gid", "pid", "uid")

    def __init__(self, pid: int, uid: int, gid: int) -> None:
        self.pid, self.uid, self.gid = pid, uid, gid

    def to_json(self) -> dict[str, int]:
        return {"pid": self.pid, "uid": self.uid, "gid": self.gid}


class CallTarget(_Value):
    """Call mode: run ``module:function(*args, **kwargs)`` in the warm interpreter.

    A pickled call (protocol v2) sets ``pickled``: base64 text that only the fiber
    decodes (fiberd passes it on unread). With ``target`` it holds the pickle of
    ``(args, kwargs)``; with ``target`` None, of ``(function, args, kwargs)``. The
    fiber's result (or exception) then comes back pickled too. ``path``: the caller's
    import path, put first on the fiber's ``sys.path`` (the entries that are safe
    there) before it resolves or unpickles anything.
    """

    __slots__ = ("args", "kwargs", "path", "pickled", "target")

    def __init__(self, target: str | None, args: tuple[object, ...] = (),
                 kwargs: Mapping[str, object] | None = None, pickled: str | None = None,
                 path: tuple[str, ...] = ()) -> None:
        self.target = target
        self.args = tuple(args)
        self.kwargs: Mapping[str, object] = {} if kwargs is None else kwargs
        self.pickled = pickled
        self.path = tuple(path)

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {}
        if self.target is not None:
            out["target"] = self.target
        if self.pickled is not None:
            out["pickled"] = self.pickled
        else:
            out["args"] = list(self.args)
            out["kwargs"] = dict(self.kwargs)
        if self.path:
            out["path"] = list(self.path)
        return out


class ExecTarget(_Value):
    """Exec mode: exec ``argv`` (argv[0] looked up on PATH), in ``cwd`` when given."""

    __slots__ = ("argv", "cwd")

    def __init__(self, argv: tuple[str, ...], cwd: str | None = None) -> None:
        self.argv = tuple(argv)
        self.cwd = cwd

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"argv": list(self.argv)}
        if self.cwd is not None:
            out["cwd"] = self.cwd
        return out


class Request(_Value):
    """What every request type shares: its op's name and version, and its frame body."""

    __slots__ = ()
    OP = ""
    SINCE = 1

    def version(self) -> int:
        """The protocol version this request needs (its ``"v"``)."""
        return self.SINCE

    def fields(self) -> dict[str, object]:
        """The op's own fields, as JSON."""
        return {}

    def to_json(self, rid: int | str | None = None) -> dict[str, object]:
        """The frame body: ``op``, ``id`` when given, ``v`` when over 1, the fields."""
        out: dict[str, object] = {"op": self.OP}
        if rid is not None:
            out["id"] = rid
        version = self.version()
        if version > 1:
            out["v"] = version
        out.update(self.fields())
        return out


class Clone(Request):
    """``clone``: start a fiber. Exactly one of ``call`` and ``exec``; at most one of
    ``grant`` and ``token`` (neither: the home's own grant). ``stdio`` names the passed
    descriptors, in order; ``env`` never names a device visibility variable."""

    __slots__ = ("call", "early", "env", "exec", "grant", "hangup", "stdio", "token", "wait")
    OP = "clone"

    def __init__(self, call: CallTarget | None = None, exec: ExecTarget | None = None,
                 grant: str | None = None, token: str | None = None,
                 env: Mapping[str, str] | None = None, stdio: tuple[str, ...] = (),
                 wait: bool = False, hangup: bool = True, early: bool = False) -> None:
        self.call, self.exec, self.grant, self.token = call, exec, grant, token
        self.env: Mapping[str, str] = {} if env is None else env
        self.stdio = tuple(stdio)
        self.wait, self.hangup, self.early = wait, hangup, early

    def version(self) -> int:
        if self.early:
            return EARLY_SINCE
        return PICKLED_SINCE if self.call is not None and self.call.pickled is not None else 1

    def target_fields(self) -> dict[str, object]:
        """``call`` or ``exec``, as JSON."""
        if self.call is not None:
            return {"call": self.call.to_json()}
        return {"exec": self.exec.to_json()} if self.exec is not None else {}

    def fields(self) -> dict[str, object]:
        out = self.target_fields()
        if self.grant is not None:
            out["grant"] = self.grant
        if self.token is not None:
            out["token"] = self.token
        if self.env:
            out["env"] = dict(self.env)
        if self.stdio:
            out["stdio"] = list(self.stdio)
        out["wait"] = self.wait
        if not self.hangup:
            out["hangup"] = False
        if self.early:
            out["early"] = True
        return out


class BatchItem(_Value):
    """One item of a ``clone_batch``: the client's ``key`` for it and its clone (the
    batch's shared ``grant``, ``token`` and ``env`` merged in), or, received, the error
    that refuses this item alone (the others still run); ``stdio`` names the
    descriptors that came for it, refused or not (the server closes those)."""

    __slots__ = ("clone", "error", "key", "stdio")

    def __init__(self, key: str | None, clone: Clone | None, stdio: tuple[str, ...] = (),
                 error: Exception | None = None) -> None:
        self.key, self.clone, self.stdio, self.error = key, clone, tuple(stdio), error

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"key": self.key}
        if self.clone is not None:
            out.update(self.clone.target_fields())
            if self.clone.env:
                out["env"] = dict(self.clone.env)
        if self.stdio:
            out["stdio"] = list(self.stdio)
        return out


class CloneBatch(Request):
    """``clone_batch``: many clones of one grant in one request. ``grant``, ``token``
    and ``env`` hold for every item (an item's ``env`` adds to it); descriptors come
    item by item, each item's ``stdio`` naming its own. ``window`` (v5, with ``wait``):
    at most this many of its fibers run at once."""

    __slots__ = ("early", "env", "grant", "hangup", "items", "token", "wait", "window")
    OP = "clone_batch"
    SINCE = BATCH_SINCE

    def __init__(self, items: tuple[BatchItem, ...], grant: str | None = None,
                 token: str | None = None, env: Mapping[str, str] | None = None,
                 wait: bool = False, hangup: bool = True, early: bool = False,
                 window: int | None = None) -> None:
        self.items = tuple(items)
        self.grant, self.token = grant, token
        self.env: Mapping[str, str] = {} if env is None else env
        self.wait, self.hangup, self.early, self.window = wait, hangup, early, window

    def version(self) -> int:
        if self.window is not None:
            return WINDOW_SINCE
        return EARLY_SINCE if self.early else BATCH_SINCE

    def fields(self) -> dict[str, object]:
        out: dict[str, object] = {"items": [item.to_json() for item in self.items]}
        if self.grant is not None:
            out["grant"] = self.grant
        if self.token is not None:
            out["token"] = self.token
        if self.env:
            out["env"] = dict(self.env)
        out["wait"] = self.wait
        if not self.hangup:
            out["hangup"] = False
        if self.early:
            out["early"] = True
        if self.window is not None:
            out["window"] = self.window
        return out


class Cancel(Request):
    """``cancel`` (v5): during a windowed batch's stream, start none of its items not
    started yet."""

    __slots__ = ()
    OP = "cancel"
    SINCE = WINDOW_SINCE


class InspectFiber(Request):
    """``inspect_fiber``: one fiber by id."""

    __slots__ = ("fiber",)
    OP = "inspect_fiber"

    def __init__(self, fiber: str) -> None:
        self.fiber = fiber

    def fields(self) -> dict[str, object]:
        return {"fiber": self.fiber}


class StopFiber(Request):
    """``stop_fiber``: stop a fiber, ``grace`` seconds between SIGTERM and SIGKILL (None:
    fiberd's default)."""

    __slots__ = ("fiber", "grace")
    OP = "stop_fiber"

    def __init__(self, fiber: str, grace: float | None = None) -> None:
        self.fiber, self.grace = fiber, grace

    def fields(self) -> dict[str, object]:
        out: dict[str, object] = {"fiber": self.fiber}
        if self.grace is not None:
            out["grace"] = self.grace
        return out


class SignalFiber(Request):
    """``signal_fiber``: send a signal (a number; a client may send a name, which the
    server reads as its number) to a fiber."""

    __slots__ = ("fiber", "signal")
    OP = "signal_fiber"

    def __init__(self, fiber: str, signal: int | str) -> None:
        self.fiber, self.signal = fiber, signal

    def fields(self) -> dict[str, object]:
        return {"fiber": self.fiber, "signal": self.signal}


class ListFibers(Request):
    """``list_fibers``: one page (v3: ``after`` a cursor, ``limit`` records), or all;
    ``ended``: with the ended fibers fiberd still remembers."""

    __slots__ = ("after", "ended", "limit")
    OP = "list_fibers"

    def __init__(self, after: str | None = None, limit: int | None = None,
                 ended: bool = False) -> None:
        self.after, self.limit, self.ended = after, limit, ended

    def version(self) -> int:
        return PAGED_SINCE if self.after is not None or self.limit is not None else 1

    def fields(self) -> dict[str, object]:
        out: dict[str, object] = {}
        if self.after is not None:
            out["after"] = self.after
        if self.limit is not None:
            out["limit"] = self.limit
        if self.ended:
            out["ended"] = True
        return out


class ListGrants(Request):
    """``list_grants``: every admitted grant's record."""

    __slots__ = ()
    OP = "list_grants"


class Status(Request):
    """``status``: fiberd's status document."""

    __slots__ = ()
    OP = "status"


class Health(Request):
    """``health``: the grant source's health document."""

    __slots__ = ()
    OP = "health"


class Ready(Request):
    """``ready``: whether fiberd serves clones now."""

    __slots__ = ()
    OP = "ready"


class Metrics(Request):
    """``metrics``: fiberd's metrics, Prometheus text."""

    __slots__ = ()
    OP = "metrics"

