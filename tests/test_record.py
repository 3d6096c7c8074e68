"""slurm_fiber.record: the dataclass behaviour the hook-path value classes rely on."""

from __future__ import annotations

import pickle

import pytest

from slurm_fiber.record import FrozenRecordError, as_dict, field, record, replace


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


@pytest.mark.parametrize(("args", "kwargs", "says"), [
    ((), {}, "missing required argument: 'x'"),
    ((1, 2, (), 4), {}, "takes 3 positional arguments but 4 were given"),
    ((1,), {"x": 2}, "multiple values for argument 'x'"),
    ((1,), {"z": 2}, "unexpected keyword argument 'z'"),
])
def test_bad_arguments_are_refused(args: tuple, kwargs: dict, says: str) -> None:
    with pytest.raises(TypeError, match=says):
        Point(*args, **kwargs)


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
