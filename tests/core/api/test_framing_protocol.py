"""Frames and request validation as pure functions."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_fiber.protocol import requests as rq
from slurm_fiber.protocol import validate as protocol
from slurm_fiber.protocol.framing import FrameDecoder, FramingError, encode_frame
from slurm_fiber.protocol.validate import ApiError, parse_request

messages = st.lists(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=20),
                                    max_size=4), min_size=1, max_size=6)


@given(messages, st.lists(st.integers(min_value=1, max_value=40), min_size=1))
def test_any_chunking_yields_the_same_frames(msgs, cuts) -> None:
    stream = b"".join(encode_frame(m) for m in msgs)
    decoder, got, i = FrameDecoder(), [], 0
    for n in cuts * (len(stream) // sum(cuts) + 1):
        decoder.feed(stream[i:i + n])
        i += n
        while (frame := decoder.next_frame()) is not None:
            got.append(frame.body)
    assert got == msgs and not decoder.mid_frame


def test_descriptors_belong_to_the_frame_they_arrived_with() -> None:
    r, w = os.pipe()
    decoder = FrameDecoder()
    first, second = encode_frame({"a": 1}), encode_frame({"b": 2})
    decoder.feed(first + second[:3])
    decoder.feed(second[3:], [r, w])  # arrives mid-frame: belongs to the second
    one, two = decoder.next_frame(), decoder.next_frame()
    assert (one.fds, two.fds) == ([], [r, w])
    two.close_fds()
    with pytest.raises(OSError):
        os.fstat(r)


def test_oversize_and_zero_headers_are_fatal_bad_json_is_not() -> None:
    decoder = FrameDecoder(max_frame=100)
    decoder.feed(b"\x00\x00\x00\x02{]" + encode_frame({"ok": 1}))
    assert decoder.next_frame().error.startswith("frame body is not JSON")
    assert decoder.next_frame().body == {"ok": 1}
    decoder.feed(b"\x00\x00\x01\x00")
    with pytest.raises(FramingError) as e:
        decoder.next_frame()
    assert e.value.code == "frame_too_large"
    with pytest.raises(ValueError):
        encode_frame({"x": "y" * 200}, max_frame=100)


def test_valid_requests_parse() -> None:
    req = parse_request({"op": "clone", "id": "r1", "grant": "job-42",
                         "call": {"target": "pkg.mod:Cls.method", "args": [1],
                                  "kwargs": {"n": 2}},
                         "env": {"A": "b"}, "stdio": ["stdout", "stderr"], "wait": True}, 2)
    assert req.id == "r1" and isinstance(req.request, rq.Clone)
    assert req.request.call is not None and req.request.call.target == "pkg.mod:Cls.method"
    assert req.request.stdio == ("stdout", "stderr") and req.request.hangup is True
    assert parse_request({"op": "signal_fiber", "fiber": "f1", "signal": "int"}, 0).request == \
        rq.SignalFiber("f1", 2)
    assert parse_request({"op": "metrics", "v": 1}, 0).request == rq.Metrics()


@pytest.mark.parametrize(("body", "nfds", "code", "field"), [
    ({"op": "clone", "exec": {"argv": ["x"]}, "grant": "bad uid"}, 0, "bad_request", "grant"),
    ({"op": "clone", "exec": {"argv": ["x"]}, "grant": "a", "token": "t"}, 0, "bad_request",
     None),
    ({"op": "clone", "exec": {"argv": ["x\0y"]}}, 0, "bad_request", "exec"),
    ({"op": "clone", "exec": {"argv": ["x"], "cwd": "rel"}}, 0, "bad_request", "exec"),
    ({"op": "clone", "exec": {"argv": ["x"], "shell": True}}, 0, "bad_request", "shell"),
    ({"op": "clone", "call": {"target": "os.system"}}, 0, "bad_request", "call"),
    ({"op": "clone", "call": {"target": "a:b", "kwargs": {"1x": 0}}}, 0, "bad_request", "call"),
    ({"op": "clone", "exec": {"argv": ["x"]}, "env": {"A B": "c"}}, 0, "bad_request", "env"),
    ({"op": "clone", "exec": {"argv": ["x"]}, "env": {"A": 1}}, 0, "bad_request", "env"),
    ({"op": "clone", "exec": {"argv": ["x"]}, "wait": 1}, 0, "bad_request", "wait"),
    ({"op": "clone", "exec": {"argv": ["x"]}, "stdio": ["stdout", "stdout"]}, 2,
     "bad_request", "stdio"),
    ({"op": "clone", "exec": {"argv": ["x"]}}, 1, "bad_fds", None),
    ({"op": "clone", "exec": {"argv": ["x"]}, "stdio": ["stdin"]}, 4, "bad_fds", None),
    ({"op": "stop_fiber", "fiber": "f1", "grace": -1}, 0, "bad_request", "grace"),
    ({"op": "stop_fiber", "fiber": "f1", "grace": True}, 0, "bad_request", "grace"),
    ({"op": "signal_fiber", "fiber": "f1", "signal": 999}, 0, "bad_request", "signal"),
    ({"op": "signal_fiber", "fiber": "f1"}, 0, "bad_request", "signal"),
    ({"op": "inspect_fiber", "fiber": "../x"}, 0, "bad_request", "fiber"),
    ({"op": "status", "id": [1]}, 0, "bad_request", "id"),
    ({"op": "status", "v": True}, 0, "unsupported_version", None),
    ({"op": "status", "v": 6}, 0, "unsupported_version", None),
    # a pickled call is a v2 feature, checked only for shape (fiberd never unpickles)
    ({"op": "clone", "call": {"pickled": "gAR9lC4="}}, 0, "bad_request", "call"),
    ({"op": "clone", "v": 2, "call": {"pickled": "not base64!"}}, 0, "bad_request", "call"),
    ({"op": "clone", "v": 2, "call": {"pickled": ""}}, 0, "bad_request", "call"),
    ({"op": "clone", "v": 2, "call": {"pickled": "gAR9lC4=", "args": [1]}}, 0,
     "bad_request", "call"),
    ({"op": "clone", "v": 2, "call": {"pickled": "gAR9lC4=", "target": "os.system"}}, 0,
     "bad_request", "call"),
    # clone_batch (v3): what is wrong with the request as a whole refuses all of it
    ({"op": "clone_batch", "items": [{"key": "a", "exec": {"argv": ["x"]}}]}, 0,
     "bad_request", "v"),
    ({"op": "clone_batch", "v": 3, "items": []}, 0, "bad_request", "items"),
    ({"op": "clone_batch", "v": 3}, 0, "bad_request", "items"),
    ({"op": "clone_batch", "v": 3, "items": [{"key": "a", "exec": {"argv": ["x"]}}] * 65}, 0,
     "bad_request", "items"),
    ({"op": "clone_batch", "v": 3, "grant": "../g", "items": [{"key": "a"}]}, 0,
     "bad_request", "grant"),
    ({"op": "clone_batch", "v": 3, "items": [{"key": "a", "stdio": ["stdout", "stdout"]}]},
     2, "bad_request", "stdio"),
    ({"op": "clone_batch", "v": 3, "items": [{"key": "a", "stdio": ["stdout"]}]}, 2,
     "bad_fds", None),
    ({"op": "clone_batch", "v": 3, "items": [{"key": "a"}]}, 193, "bad_fds", None),
    ({"op": "clone_batch", "v": 3, "items": [{"key": "a"}], "stdio": ["stdin"]}, 0,
     "bad_request", "stdio"),
    # list_fibers' paging is v3
    ({"op": "list_fibers", "limit": 10}, 0, "bad_request", "v"),
    ({"op": "list_fibers", "v": 3, "after": "abc"}, 0, "bad_request", "after"),
    ({"op": "list_fibers", "v": 3, "limit": 0}, 0, "bad_request", "limit"),
    ({"op": 3}, 0, "bad_request", "op"),
    ({"op": "status"}, 1, "bad_fds", None),
    ({"op": "format_disk"}, 0, "unknown_op", None),
])
def test_invalid_requests_are_refused_with_a_code(body, nfds, code, field) -> None:
    with pytest.raises(ApiError) as e:
        parse_request(body, nfds)
    assert (e.value.code, e.value.field) == (code, field)
    assert "\n" not in e.value.reason


def test_a_bad_batch_item_is_refused_alone() -> None:
    items = [{"key": "a", "exec": {"argv": ["x"]}}, {"key": "a", "exec": {"argv": ["y"]}},
             {"key": "-b", "exec": {"argv": ["x"]}}, {"key": "c", "exec": {"argv": []}},
             {"key": "d", "exec": {"argv": ["x"]}, "env": {"B": "2"}, "stdio": ["stdout"]}]
    op = parse_request({"op": "clone_batch", "v": 3, "env": {"A": "1"}, "items": items},
                       1).request
    assert isinstance(op, rq.CloneBatch) and op.wait is False and op.hangup is True
    assert [(i.key, i.error.field if i.error else None) for i in op.items] == [
        ("a", None), ("a", "key"), (None, "key"), ("c", "exec"), ("d", None)]
    last = op.items[-1].clone
    assert last is not None and dict(last.env) == {"A": "1", "B": "2"}
    assert last.stdio == ("stdout",) and op.items[-1].stdio == ("stdout",)


def test_an_integer_past_the_digit_limit_is_refused_not_raised() -> None:
    from slurm_fiber.protocol.framing import parse_body

    value, error = parse_body(b'{"op":"status","n":' + b"1" * 5000 + b"}")
    assert value is None and error is not None
    assert error.startswith("frame body is not usable JSON (Exceeds the limit (4300 digits)")


def test_nesting_is_bounded_exactly_and_brackets_in_strings_do_not_count() -> None:
    from slurm_fiber.protocol.framing import MAX_DEPTH, parse_body

    deepest = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert parse_body(deepest)[1] is None
    for body in (b"[" + deepest + b"]", b'{"a":' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1),
                 b"[" * 100_000 + b"]" * 100_000):
        value, error = parse_body(body)
        assert value is None and error == f"frame body nests arrays/objects deeper than " \
                                           f"{MAX_DEPTH} levels"
    tricky = b'{"s":"' + b"[{" * 200 + b'\\"]","t":[' + b'"\\\\[",' * 100 + b"1]}"
    assert parse_body(tricky) == (json.loads(tricky), None)


def test_a_pickled_call_is_passed_on_as_text_with_or_without_a_target() -> None:
    bare = parse_request({"op": "clone", "v": 2, "call": {"pickled": "gAR9lC4="}}, 0)
    assert bare.request.call.pickled == "gAR9lC4=" and bare.request.call.target is None
    named = parse_request({"op": "clone", "v": 2,
                           "call": {"pickled": "gAR9lC4=", "target": "m:f"}}, 0)
    assert (named.request.call.target, named.request.call.pickled) == ("m:f", "gAR9lC4=")


def test_version_1_requests_mean_the_same_under_version_2() -> None:
    body = {"op": "clone", "call": {"target": "m:f", "args": [1]}}
    assert parse_request(body, 0) == parse_request({**body, "v": 1}, 0) \
        == parse_request({**body, "v": 2}, 0)


SAMPLES: list[tuple[rq.Request, int]] = [
    (rq.Clone(exec=rq.ExecTarget(("sleep", "1"), "/tmp"), grant="g1", env={"A": "b"},
              stdio=("stdout",), wait=True, hangup=False), 1),
    (rq.Clone(call=rq.CallTarget("m:f", args=(1, [2]), kwargs={"k": 3}, path=("/p",)),
              token="t.o.k", early=True, wait=True), 0),
    (rq.Clone(call=rq.CallTarget(None, pickled="gAR9lC4=")), 0),
    (rq.CloneBatch((rq.BatchItem("a", rq.Clone(exec=rq.ExecTarget(("true",)))),
                    rq.BatchItem("b", rq.Clone(call=rq.CallTarget("m:f"), env={"B": "2"}),
                                 stdio=("stdin",))),
                   grant="g1", wait=True, window=2), 1),
    (rq.Cancel(), 0),
    (rq.InspectFiber("f1"), 0),
    (rq.StopFiber("f1", 2.5), 0),
    (rq.SignalFiber("f1", 15), 0),
    (rq.ListFibers(after="7", limit=10, ended=True), 0),
    (rq.ListGrants(), 0), (rq.Status(), 0), (rq.Health(), 0), (rq.Ready(), 0),
    (rq.Metrics(), 0),
]


def test_every_request_type_is_the_one_both_ends_use() -> None:
    """What a client builds is what the server reads back: one type per op, each a row of
    the table, each round-tripping through its frame body and validation unchanged (a
    batch item's clone as validation completes it: the batch's shared fields merged in,
    its own descriptor names)."""
    assert {type(r).OP for r, _n in SAMPLES} == set(protocol.TABLE)
    assert all(name == spec.request.OP for name, spec in protocol.TABLE.items())
    for request, nfds in SAMPLES:
        body = json.loads(json.dumps(request.to_json("r")))
        parsed = parse_request(body, nfds)
        assert parsed.id == "r" and type(parsed.request) is type(request)
        if isinstance(request, rq.CloneBatch):
            assert isinstance(parsed.request, rq.CloneBatch)
            for sent, got in zip(request.items, parsed.request.items, strict=True):
                assert got.key == sent.key and got.error is None and got.clone is not None
                assert sent.clone is not None and got.clone.stdio == sent.stdio
                assert (got.clone.call, got.clone.exec, got.clone.grant) == (
                    sent.clone.call, sent.clone.exec, request.grant)
                assert dict(got.clone.env) == {**request.env, **sent.clone.env}
            assert (parsed.request.window, parsed.request.wait) == (request.window, True)
        else:
            assert parsed.request == request, type(request).__name__
