"""slurm_fiber.record: the dataclass behaviour the hook-path value classes rely on."""

from __future__ import annotations

import pickle

import pytest

from slurm_fiber.record import (
    COMPILE_AFTER,
    FrozenRecordError,
    as_dict,
    field,
    record,
    replace,
)


@record(frozen=True)
class Point:
    x: int
    y: int = 0
    tags: tuple[str, ...] = ()


@record
class Bag:
    name: str
    items: list[int] = field(default_factory=list)


def test_init_by_position_name_and_default() -> None:
    assert Point(1, 2) == Point(x=1, y=2) == Point(1, y=2, tags=())
    assert Point(3).y == 0
    assert repr(Point(1, 2)) == "Point(x=1, y=2, tags=())"
    assert Point.__match_args__ == ("x", "y", "tags")


def points(compiled: bool) -> type[Point]:
    """A class like Point, made fresh: its first instances go through the generic
    ``__init__``; with ``compiled``, COMPILE_AFTER of them are made first, so it has its
    own."""

    @record(frozen=True)
    class Point:
        x: int
        y: int = 0
        tags: list[str] = field(default_factory=list)

    for n in range(COMPILE_AFTER if compiled else 0):
        Point(n)
    assert ("__record_self__" in Point.__init__.__code__.co_varnames) is compiled
    return Point


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize(("args", "kwargs", "says"), [
    ((), {}, r"Point.__init__\(\) missing 1 required positional argument: 'x'"),
    ((1, 2, (), 4), {}, "takes from 2 to 4 positional arguments but 5 were given"),
    ((1,), {"x": 2}, "got multiple values for argument 'x'"),
    ((1,), {"z": 2}, "got an unexpected keyword argument 'z'"),
])
def test_bad_arguments_are_refused_alike_before_and_after_compiling(
        compiled: bool, args: tuple, kwargs: dict, says: str) -> None:
    with pytest.raises(TypeError, match=says):
        points(compiled)(*args, **kwargs)


def test_the_compiled_init_takes_the_same_arguments() -> None:
    made = [(cls(1, 2, ["t"]), cls(x=1), cls(1, tags=["u"]), cls(1), cls(1))
            for cls in (points(False), points(True))]
    for full, by_name, mixed, fresh, other in made:
        assert as_dict(full) == {"x": 1, "y": 2, "tags": ["t"]}
        assert as_dict(by_name) == {"x": 1, "y": 0, "tags": []}
        assert as_dict(mixed) == {"x": 1, "y": 0, "tags": ["u"]}
        assert fresh.tags == [] and fresh.tags is not other.tags
        with pytest.raises(FrozenRecordError):
            full.x = 2  # type: ignore[misc]


def test_equality_is_by_exact_class_and_values() -> None:
    @record(frozen=True)
    class Other:
        x: int
        y: int = 0
        tags: tuple[str, ...] = ()

    assert Point(1) != Point(2)
    assert Point(1) != Other(1)
    assert Point(1) != (1, 0, ())


def test_frozen_refuses_assignment_and_hashes_by_value() -> None:
    p = Point(1)
    with pytest.raises(FrozenRecordError):
        p.x = 2  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del p.y
    assert hash(Point(1, 2)) == hash(Point(1, 2))
    assert len({Point(1), Point(1), Point(2)}) == 2


def test_mutable_record_assigns_is_unhashable_and_gets_fresh_factory_values() -> None:
    a, b = Bag("a"), Bag("b")
    a.items.append(1)
    a.name = "c"
    assert (a.name, a.items, b.items) == ("c", [1], [])
    assert "items" not in Bag.__dict__  # the factory is no class attribute
    with pytest.raises(TypeError):
        hash(a)


def test_replace_as_dict_and_pickle() -> None:
    p = Point(1, 2, ("t",))
    assert replace(p, y=5) == Point(1, 5, ("t",))
    assert as_dict(p) == {"x": 1, "y": 2, "tags": ("t",)}
    assert pickle.loads(pickle.dumps(p)) == p


def test_a_field_without_default_after_one_with_is_refused() -> None:
    with pytest.raises(TypeError, match="'b' without a default"):
        @record
        class Bad:
            a: int = 0
            b: int
