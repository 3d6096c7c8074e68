"""framing.json_dumps and json_loads, which fiberctl run and call use instead of importing json,
are json.dumps and json.loads exactly: the same text, value or exception, every time."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_fiber.protocol.framing import json_dumps, json_loads

COMPACT = {"separators": (",", ":"), "ensure_ascii": False}

scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text()
           | st.sampled_from(["é", "\u2028", "\x00", "\ud800", '"\\/', "💡"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=4) | st.integers() | st.none() | st.booleans(), inner, max_size=4),
    max_leaves=20)


def outcome(function, value):
    """What ``function(value)`` gives: ("ok", its result) or (exception type, message)."""
    try:
        return "ok", function(value)
    except Exception as e:
        return type(e).__name__, str(e)


def same_value(a: object, b: object) -> bool:
    """Equal as JSON values, NaN equal to NaN (json.loads("NaN") is a fresh float each time)."""
    return type(a) is type(b) and json.dumps(a) == json.dumps(b)


@given(values)
def test_dumps_is_json_dumps(value: object) -> None:
    assert json_dumps(value) == json.dumps(value)
    assert json_dumps(value, compact=True) == json.dumps(value, **COMPACT)


@given(values)
def test_loads_reads_back_what_json_wrote_as_json_does(value: object) -> None:
    for text in (json.dumps(value), json.dumps(value, **COMPACT), json.dumps(value, indent=1)):
        assert same_value(json_loads(text), json.loads(text))


class Custom:
    pass


@pytest.mark.parametrize("value", [
    Custom(), {"a": {1, 2}}, {(1,): 2}, b"bytes", float("nan"), [float("inf"), -math.inf],
    {1.5: 1, True: 2, None: 3}, pytest.param(10**5000, id="int-of-5000-digits"), "x" * 10,
])
def test_dumps_raises_or_writes_as_json_does(value: object) -> None:
    for compact, kwargs in ((False, {}), (True, COMPACT)):
        assert outcome(lambda v, c=compact: json_dumps(v, c), value) == \
            outcome(lambda v, k=kwargs: json.dumps(v, **k), value)


def test_dumps_says_a_circular_reference_as_json_does() -> None:
    loop: list[object] = []
    loop.append(loop)
    assert outcome(json_dumps, loop) == outcome(json.dumps, loop) == \
        ("ValueError", "Circular reference detected")
    assert json_dumps([1]) == "[1]"  # nothing of the failed call is left behind


@pytest.mark.parametrize("text", [
    '{"a":1}', ' {"a":1}', '{"a":1} ', "\n[1]\t", "[NaN]", "Infinity", "-Infinity", "1.5e3",
    '"\\u00e9"', '{"a":1}x', "", " ", "\ufeff1", '{"a":"\x01"}', "[1,]", "nul", "9" * 5000,
    '{"a":1,"a":2}', "-0", "[1e400]", pytest.param("[" * 100_000 + "]" * 100_000, id="deep"),
    '"\\ud800"', "{'a':1}",
    '{"a":1}{"b":2}',
])
def test_loads_reads_or_raises_as_json_does(text: str) -> None:
    mine, theirs = outcome(json_loads, text), outcome(json.loads, text)
    assert mine[0] == theirs[0]
    assert same_value(mine[1], theirs[1]) if mine[0] == "ok" else mine == theirs


def test_a_malformed_reply_raises_json_s_own_error() -> None:
    with pytest.raises(json.JSONDecodeError) as raised:
        json_loads('{"ok": tru}')
    assert (raised.value.msg, raised.value.pos) == ("Expecting value", 7)
