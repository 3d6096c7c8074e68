"""The reply types of fiberd's socket ops, as the protocol's op table names them.

Each op in ``validate.TABLE`` names one of these as its reply type: the
server builds it from what the Service returned (``of``) and sends its
``to_json()`` as the reply's ``result``; the client's typed method rebuilds
it from that ``result`` (``from_json``). ``from_json`` is lenient (a field
missing from an older fiberd's reply gets its default), so a newer client
reads an older fiberd. Records (fibers, grants) stay JSON objects: their
fields are documented in docs/socket-protocol.md and grow additively.

Plain classes with slots and nothing imported: the client loads this module for
every ``fiberctl run`` (the client package's import budget, slurm_fiber/client).
A ``result`` is decoded JSON, so its objects are checked as ``dict``.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

Json = dict[str, object]


def _dict(value: object) -> Json:
    return dict(value) if isinstance(value, dict) else {}


class _Reply:
    """What every reply type shares: its fields are its slots, shown by ``repr``."""

    __slots__: tuple[str, ...] = ()

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{type(self).__name__}({fields})"


def _records(value: object) -> list[Json]:
    return [dict(r) for r in value if isinstance(r, dict)] if isinstance(value, list) else []


class Fiber(dict[str, object]):
    """One fiber's record (``clone``'s ``started`` event, ``inspect_fiber``, ``stop_fiber``).

    The record itself (a dict, so its documented fields grow freely), with typed
    access to the fields every record has. On the wire: ``{"fiber": record}``.
    """

    @property
    def id(self) -> str:
        return str(self.get("id"))

    @property
    def pid(self) -> int | None:
        pid = self.get("pid")
        return pid if isinstance(pid, int) else None

    @property
    def grant(self) -> str | None:
        grant = self.get("grant")
        return grant if isinstance(grant, str) else None

    @property
    def state(self) -> str | None:
        state = self.get("state")
        return state if isinstance(state, str) else None

    @classmethod
    def of(cls, record: Mapping[str, object]) -> Fiber:
        return cls(record)

    @classmethod
    def from_json(cls, result: Mapping[str, object]) -> Fiber:
        return cls(_dict(result.get("fiber")))

    def to_json(self) -> Json:
        return {"fiber": dict(self)}


class FiberList(_Reply):
    """``list_fibers``: one page of fiber records and the cursor of the next (None: last)."""

    __slots__ = ("fibers", "next")

    def __init__(self, fibers: list[Json], next: str | None = None) -> None:
        self.fibers = fibers
        self.next = next

    @classmethod
    def of(cls, page: tuple[Iterable[Mapping[str, object]], str | None]) -> FiberList:
        records, cursor = page
        return cls([dict(r) for r in records], cursor)

    @classmethod
    def from_json(cls, result: Mapping[str, object]) -> FiberList:
        cursor = result.get("next")
        return cls(_records(result.get("fibers")), cursor if isinstance(cursor, str) else None)

    def to_json(self) -> Json:
        out: Json = {"fibers": self.fibers}
        if self.next is not None:
            out["next"] = self.next
        return out


class Delivered(_Reply):
    """``signal_fiber``: whether the signal was sent (False: the fiber had exited)."""

    __slots__ = ("delivered",)

    def __init__(self, delivered: bool) -> None:
        self.delivered = delivered

    @classmethod
    def of(cls, delivered: object) -> Delivered:
        return cls(bool(delivered))

    @classmethod
    def from_json(cls, result: Mapping[str, object]) -> Delivered:
        return cls(result.get("delivered") is True)

    def to_json(self) -> Json:
        return {"delivered": self.delivered}


class GrantList(_Reply):
    """``list_grants``: every admitted grant's record."""

    __slots__ = ("grants",)

    def __init__(self, grants: list[Json]) -> None:
        self.grants = grants

    @classmethod
    def of(cls, records: Iterable[Mapping[str, object]]) -> GrantList:
        return cls([dict(r) for r in records])

    @classmethod
    def from_json(cls, result: Mapping[str, object]) -> GrantList:
        return cls(_records(result.get("grants")))

    def to_json(self) -> Json:
        return {"grants": self.grants}


class Ready(_Reply):
    """``ready``: whether fiberd serves clones now."""

    __slots__ = ("ready",)

    def __init__(self, ready: bool) -> None:
        self.ready = ready

    @classmethod
    def of(cls, ready: object) -> Ready:
        return cls(bool(ready))

    @classmethod
    def from_json(cls, result: Mapping[str, object]) -> Ready:
        return cls(result.get("ready") is True)

    def to_json(self) -> Json:
        return {"ready": self.ready}


class Document(_Reply):
    """``status``, ``health``: an open document, the result itself (fields in the docs)."""

    __slots__ = ("data",)

    def __init__(self, data: Json) -> None:
        self.data = data

    @classmethod
    def of(cls, data: Mapping[str, object]) -> Document:
        return cls(dict(data))

    @classmethod
    def from_json(cls, result: Mapping[str, object]) -> Document:
        return cls(dict(result))

    def to_json(self) -> Json:
        return self.data


class Metrics(_Reply):
    """``metrics``: the Prometheus exposition and its content type."""

    __slots__ = ("content_type", "text")

    def __init__(self, content_type: str, text: str) -> None:
        self.content_type = content_type
        self.text = text

    @classmethod
    def of(cls, pair: tuple[str, str]) -> Metrics:
        return cls(*pair)

    @classmethod
    def from_json(cls, result: Mapping[str, object]) -> Metrics:
        return cls(str(result.get("content_type", "")), str(result.get("text", "")))

    def to_json(self) -> Json:
        return {"content_type": self.content_type, "text": self.text}


class BatchStarted(_Reply):
    """``clone_batch``'s ``started`` event: one entry per item, in the request's order:
    ``{"key", "ok": true, "fiber": record}``, ``{"key", "ok": false, "miss": {...}}`` or
    ``{"key", "ok": false, "error": {"code", "reason", "field"?}}``."""

    __slots__ = ("items",)

    def __init__(self, items: list[Json]) -> None:
        self.items = items

    @classmethod
    def of(cls, items: Iterable[Mapping[str, object]]) -> BatchStarted:
        return cls([dict(i) for i in items])

    @classmethod
    def from_json(cls, result: Mapping[str, object]) -> BatchStarted:
        return cls(_records(result.get("items")))

    def to_json(self) -> Json:
        return {"items": self.items}

    def fibers(self) -> dict[str, Fiber]:
        """The started fibers' records by item key."""
        return {str(i.get("key")): Fiber(_dict(i.get("fiber"))) for i in self.items
                if i.get("ok") and isinstance(i.get("fiber"), dict)}


class Cancelled(_Reply):
    """``cancel``'s answer, the ``cancelled`` event of the windowed batch streaming on the
    connection: the keys of its items that will not start (in the request's order)."""

    __slots__ = ("keys",)

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys

    @classmethod
    def of(cls, keys: Iterable[str]) -> Cancelled:
        return cls(list(keys))

    @classmethod
    def from_json(cls, result: Mapping[str, object]) -> Cancelled:
        keys = result.get("keys")
        return cls([str(k) for k in keys] if isinstance(keys, list) else [])

    def to_json(self) -> Json:
        return {"keys": self.keys}


Reply = (Fiber | BatchStarted | Cancelled | FiberList | Delivered | GrantList | Ready | Document
         | Metrics)
