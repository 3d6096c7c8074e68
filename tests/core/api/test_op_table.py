"""The op table (protocol.TABLE): every op round-trips through fiberd's server and the typed
client, and an op the table does not hold is refused with its code."""

from __future__ import annotations

import inspect
import os
import signal
from collections.abc import Callable

import pytest

from slurm_fiber.client.connection import FiberdClient, Refused
from slurm_fiber.protocol.replies import Cancelled, Fiber
from slurm_fiber.protocol.validate import TABLE
from tests.core.runtime.fiberdkit import ThreadFiberd


def cancel_in_a_window(client: FiberdClient) -> Cancelled:
    """``cancel`` is answered in the windowed batch it cancels: one running (ended here by
    a signal), two not started."""
    items = [{"key": "s", "exec": {"argv": ["sleep", "30"]}},
             {"key": "a", "exec": {"argv": ["true"]}}, {"key": "b", "exec": {"argv": ["true"]}}]
    sleeper = client.clone_batch(items, wait=True, window=1).fibers()["s"]
    cancelled = client.cancel(within=30)
    assert cancelled.keys == ["a", "b"]
    os.kill(sleeper.pid or 0, signal.SIGTERM)
    assert client.wait_exit(within=30)["fiber_id"] == sleeper.id
    return cancelled


# How each op is called through the typed client, given a running fiber's id. A new op in the
# table without a line here fails test_every_op_has_a_typed_method_and_a_round_trip.
CALLS: dict[str, Callable[[FiberdClient, str], object]] = {
    "clone": lambda c, _f: c.clone(exec={"argv": ["true"]}),
    "clone_batch": lambda c, _f: c.clone_batch([{"key": "a", "exec": {"argv": ["true"]}}]),
    "cancel": lambda c, _f: cancel_in_a_window(c),
    "inspect_fiber": lambda c, f: c.inspect_fiber(f),
    "signal_fiber": lambda c, f: c.signal_fiber(f, "CONT"),
    "list_fibers": lambda c, _f: c.list_fibers(),
    "list_grants": lambda c, _f: c.list_grants(),
    "status": lambda c, _f: c.status(),
    "health": lambda c, _f: c.health(),
    "ready": lambda c, _f: c.ready(),
    "metrics": lambda c, _f: c.metrics(),
    "stop_fiber": lambda c, f: c.stop_fiber(f, 0.5),  # last: it ends the fiber
}


def test_every_op_has_a_typed_method_and_a_round_trip(fiberd_served: ThreadFiberd) -> None:
    assert set(CALLS) == set(TABLE), "an op in the table has no typed round trip here"
    with FiberdClient(fiberd_served.path) as client:
        sleeper = client.clone(exec={"argv": ["sleep", "30"]})
        assert isinstance(sleeper, Fiber) and sleeper.state == "running"
        replies = {}
        for name, call in CALLS.items():
            spec = TABLE[name]
            method = getattr(FiberdClient, name)
            assert inspect.signature(method).return_annotation == spec.reply.__name__, name
            reply = replies[name] = call(client, sleeper.id)
            assert isinstance(reply, spec.reply), name
            assert type(spec.reply.from_json(reply.to_json())) is spec.reply  # type: ignore[attr-defined]
        stopped = replies["stop_fiber"]
        assert isinstance(stopped, Fiber) and stopped.id == sleeper.id
        assert stopped.state != "running" and stopped.pid == sleeper.pid
        assert stopped.grant == sleeper.grant is not None


def test_the_typed_reply_is_what_the_wire_carries(fiberd_served: ThreadFiberd) -> None:
    with FiberdClient(fiberd_served.path) as client:
        assert client.ready().to_json() == client.request("ready") == {"ready": True}
        assert client.list_grants().to_json() == client.request("list_grants")
        assert client.metrics().content_type.startswith("text/plain")
        assert client.health().data["state"] == client.request("health")["state"]


@pytest.mark.parametrize("op", ["no_such_op", "clone_many", "List_fibers"])
def test_an_op_missing_from_the_table_is_refused_with_its_code(
        fiberd_served: ThreadFiberd, op: str) -> None:
    assert op not in TABLE
    with FiberdClient(fiberd_served.path) as client:
        with pytest.raises(Refused) as refused:
            client.request(op)
        assert refused.value.code == "unknown_op"
        assert "known: clone" in refused.value.reason
        assert client.ready().ready  # the connection carries on
