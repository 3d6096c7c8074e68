"""Value classes that cost next to nothing to define: ``@record`` for the hooks and fiberd.

The prolog and epilog start a fresh interpreter for every job and define some
twenty value classes (the job, its paths, the site config, the grant spec,
lease records). As dataclasses they cost about 1.5 ms each to create (each
compiles several generated functions) plus ``dataclasses`` itself, which
imports ``inspect`` (with ast, dis and tokenize): together 35-50 ms of a
hook's wall time on a 2-core machine. In fiberd, which lives as long as its
job, the generated functions of its seventy-odd value classes held about
0.5 MB of its memory (measured with tracemalloc). ``@record`` gives a class what
``@dataclass`` and ``@dataclass(frozen=True)`` give for the part this project
uses, and compiles nothing:

- ``__init__`` taking the annotated fields in order, by position or name;
  a class-level value is the default, ``field(default_factory=f)`` a default
  made by calling ``f()`` for each instance (as dataclasses' ``field``). The
  first ``COMPILE_AFTER`` instances of a class go through one generic
  ``__init__``; then the class gets its own, compiled (one small function, about
  three times faster: fiberd makes some thirty records per Clone, a hook a few
  of each class);
- ``__eq__`` by exact class and field values, ``__repr__``, ``__match_args__``;
- ``frozen=True``: assignment and deletion raise ``FrozenRecordError`` (an
  AttributeError, like dataclasses' FrozenInstanceError) and ``__hash__``
  hashes the fields; a mutable record is unhashable, as a dataclass with eq.

``replace(obj, **changes)`` and ``as_dict(obj)`` (shallow) work on records.
Fields are read from ``__annotations__`` of the class itself (no
inheritance of fields). Pure; standard library only.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (about 3 ms of every
if TYPE_CHECKING:  # fiberctl inside a job, whose socket is found through records)
    from collections.abc import Callable
    from typing import Any, TypeVar, dataclass_transform, overload

    T = TypeVar("T")

_MISSING = object()


class FrozenRecordError(AttributeError):
    """An assignment to, or deletion of, a field of a frozen record."""


class _Factory:
    """A field default made afresh for each instance (what ``field`` returns)."""

    __slots__ = ("factory",)

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory = factory


def field(*, default_factory: Callable[[], T]) -> T:
    """A field default made afresh for each instance: ``names: list[str] =
    field(default_factory=list)``. Typed as the field's value for type checkers."""
    return _Factory(default_factory)  # type: ignore[return-value]


COMPILE_AFTER = 8  # instances made through the generic __init__ before a class gets its own


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    # The generic __init__, built per call by hand: the common cases loop over nothing but
    # the defaults left to fill.
    cls = type(self)
    names: tuple[str, ...] = cls.__record_fields__
    if kwargs and not kwargs.keys() <= cls.__record_names__:
        unknown = next(name for name in kwargs if name not in cls.__record_names__)
        raise TypeError(f"{_said(cls)} got an unexpected keyword argument {unknown!r}")
    if args:
        if len(args) > len(names):
            least = len(names) - len(cls.__record_defaults__)
            takes = (len(names) + 1 if least == len(names)
                     else f"from {least + 1} to {len(names) + 1}")
            raise TypeError(f"{_said(cls)} takes {takes} positional arguments but "
                            f"{len(args) + 1} were given")
        if not kwargs and len(args) == len(names):
            self.__dict__.update(zip(names, args, strict=True))
            return
        if kwargs:
            twice = next((name for name in names[:len(args)] if name in kwargs), None)
            if twice is not None:
                raise TypeError(f"{_said(cls)} got multiple values for argument {twice!r}")
        kwargs.update(zip(names, args, strict=False))
    if len(kwargs) < len(names):
        for name, default in cls.__record_defaults__.items():
            if name not in kwargs:
                kwargs[name] = default.factory() if isinstance(default, _Factory) else default
        if len(kwargs) < len(names):
            missing = next(name for name in names if name not in kwargs)
            raise TypeError(f"{_said(cls)} missing 1 required positional argument: "
                            f"{missing!r}")
    self.__dict__.update(kwargs)


def _said(cls: type) -> str:
    """How Python's own argument errors name ``cls``'s ``__init__`` (the generic one says
    the same as the compiled one)."""
    return f"{cls.__qualname__}.__init__()"


def _adaptive_init(cls: type) -> Callable[..., None]:
    """``cls``'s first ``__init__``: the generic one, until ``COMPILE_AFTER`` instances are
    made; then it puts ``_compiled_init(cls)`` in its place."""
    made = [0]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        _init(self, *args, **kwargs)
        made[0] += 1
        if made[0] >= COMPILE_AFTER:  # (threads may both count past it: both compile)
            type.__setattr__(cls, "__init__", _compiled_init(cls))

    return __init__


def _compiled_init(cls: type) -> Callable[..., None]:
    """An ``__init__`` for ``cls``'s fields, compiled: a default is a parameter's default, a
    factory's is called when the parameter is left out; Python refuses bad arguments
    (its own messages, naming ``cls.__init__``)."""
    names: tuple[str, ...] = cls.__record_fields__  # type: ignore[attr-defined]
    defaults: dict[str, Any] = cls.__record_defaults__  # type: ignore[attr-defined]
    scope: dict[str, Any] = {"__record_missing__": _MISSING}
    params, body = ["__record_self__"], []
    for n, name in enumerate(names):
        default = defaults.get(name, _MISSING)
        if default is _MISSING:
            params.append(name)
        elif isinstance(default, _Factory):
            scope[f"__record_factory_{n}__"] = default.factory
            params.append(f"{name}=__record_missing__")
            body.append(f"    if {name} is __record_missing__: {name} = __record_factory_{n}__()")
        else:
            scope[f"__record_default_{n}__"] = default
            params.append(f"{name}=__record_default_{n}__")
    body.append("    __record_dict__ = __record_self__.__dict__")
    body += [f"    __record_dict__[{name!r}] = {name}" for name in names]
    source = f"def __init__({', '.join(params)}):\n" + "\n".join(body) + "\n"
    exec(source, scope)  # the class's own field names and defaults only
    made: Any = scope["__init__"]
    qualname = f"{cls.__qualname__}.__init__"
    made.__code__ = made.__code__.replace(co_qualname=qualname)
    made.__qualname__ = qualname
    return made


def _values(self: Any) -> tuple[Any, ...]:
    return tuple(self.__dict__[name] for name in type(self).__record_fields__)


def _eq(self: Any, other: object) -> bool:
    if other.__class__ is not self.__class__:
        return NotImplemented
    return _values(self) == _values(other)


def _repr(self: Any) -> str:
    shown = ", ".join(f"{name}={self.__dict__[name]!r}" for name in type(self).__record_fields__)
    return f"{type(self).__qualname__}({shown})"


def _hash(self: Any) -> int:
    return hash(_values(self))


def _frozen_setattr(self: Any, name: str, value: Any) -> None:
    raise FrozenRecordError(f"cannot assign to field {name!r} of a frozen {type(self).__name__}")


def _frozen_delattr(self: Any, name: str) -> None:
    raise FrozenRecordError(f"cannot delete field {name!r} of a frozen {type(self).__name__}")


if TYPE_CHECKING:  # the signatures type checkers see; the run time has only the one below
    @overload
    @dataclass_transform(field_specifiers=(field,))
    def record(cls: type[T], /) -> type[T]: ...
    @overload
    def record(*, frozen: bool = False) -> Callable[[type[T]], type[T]]: ...


def record(cls: type[T] | None = None, *, frozen: bool = False) -> Any:
    """Make ``cls`` a record (see the module docstring); ``@record`` or ``@record(frozen=True)``.

    Declared with ``typing.dataclass_transform`` (``field`` as its field specifier, on
    the first overload), so type checkers see the generated ``__init__`` and frozen
    fields as for a dataclass.
    """

    def make(cls: type[T]) -> type[T]:
        # The class's own annotations, without importing inspect (get_annotations).
        names = tuple(cls.__dict__.get("__annotations__", {}))  # noqa: RUF063
        defaults = {}
        for name in names:
            if name in cls.__dict__:
                defaults[name] = cls.__dict__[name]
                if isinstance(defaults[name], _Factory):
                    delattr(cls, name)
        seen_default = False
        for name in names:
            if name in defaults:
                seen_default = True
            elif seen_default:
                raise TypeError(f"{cls.__name__}: field {name!r} without a default follows "
                                "one with a default")
        members: dict[str, object] = {
            "__record_fields__": names, "__record_names__": frozenset(names),
            "__record_defaults__": defaults,
            "__match_args__": names, "__init__": _adaptive_init(cls), "__eq__": _eq,
            "__repr__": _repr,
            "__hash__": _hash if frozen else None}
        if frozen:
            members |= {"__setattr__": _frozen_setattr, "__delattr__": _frozen_delattr}
        for member, value in members.items():  # setattr: the class is built, not typed, here
            setattr(cls, member, value)
        return cls

    return make if cls is None else make(cls)


def replace(obj: T, **changes: Any) -> T:
    """A copy of record ``obj`` with ``changes`` (field name -> new value)."""
    return type(obj)(**{**as_dict(obj), **changes})


def as_dict(obj: Any) -> dict[str, Any]:
    """The fields of record ``obj`` by name, in order (values as they are, not copied)."""
    return {name: obj.__dict__[name] for name in type(obj).__record_fields__}
