"""Early results (protocol v4) against the real fiberd: with ``early``, a waited call
fiber's result (or error) comes as a ``result`` event as soon as the fiber has written
it, before its ``exit`` event, which still carries it; exec fibers get none; a clone
that does not ask gets the events it always got. A fiberd older than v4 refuses
``early`` as ``unsupported_version``, and the TaskRunner reports it (no fallback)."""

from __future__ import annotations

import pytest

from slurm_fiber.client.connection import FiberdClient, Refused
from slurm_fiber.client.tasks import Task, TaskRunner
from slurm_fiber.protocol import validate as protocol
from tests.core.api.servicekit import Served
from tests.core.runtime.fiberdkit import Site, ThreadFiberd

T = "tests.core.runtime.targetkit"


def events_until(client: FiberdClient, exits: int) -> list[tuple[str, dict[str, object]]]:
    """The events of a waited clone or batch up to its ``exits``th exit event."""
    seen: list[tuple[str, dict[str, object]]] = []
    while sum(1 for name, _ in seen if name == "exit") < exits:
        seen.append(client.wait_event(within=30))
    return seen


def test_a_waited_call_gets_its_result_before_its_exit_and_the_exit_still_carries_it(
        fiberd_served: ThreadFiberd, site: Site) -> None:
    with FiberdClient(fiberd_served.path) as client:
        fiber = client.clone(wait=True, early=True, v=4,
                             call={"target": f"{T}:getenv", "args": ["SF_TEST_MARK"]})
        seen = events_until(client, 1)
        assert [name for name, _ in seen] == ["result", "exit"]
        assert seen[0][1] == {"fiber_id": fiber.id, "result": site.mark}
        assert seen[1][1]["result"] == site.mark and seen[1][1]["status"] == 0
        assert client.ready().ready  # the stream ended with the exit event

        client.clone(wait=True, early=True, v=4, call={"target": f"{T}:no_such_function"})
        (name, raised), (_, end) = events_until(client, 1)
        assert name == "result" and isinstance(raised["error"], dict)
        assert raised["error"]["type"] == "AttributeError" and end["error"] == raised["error"]

        client.clone(wait=True, early=True, v=4, exec={"argv": ["true"]})
        assert [name for name, _ in events_until(client, 1)] == ["exit"]  # no result: exec

        client.clone(wait=True, call={"target": f"{T}:getenv", "args": ["SF_TEST_MARK"]})
        assert [name for name, _ in events_until(client, 1)] == ["exit"]  # not asked: v3's


def test_a_batch_with_early_gets_each_calls_result_before_its_own_exit(
        fiberd_served: ThreadFiberd) -> None:
    items = [{"key": "c1", "call": {"target": f"{T}:sleep", "args": [0]}},
             {"key": "x", "exec": {"argv": ["true"]}},
             {"key": "c2", "call": {"target": f"{T}:sleep", "args": [0.2]}}]
    with FiberdClient(fiberd_served.path) as client:
        fibers = client.clone_batch(items, wait=True, early=True, v=4).fibers()
        seen = events_until(client, 3)
    order = [(name, body["fiber_id"]) for name, body in seen]
    calls = [fibers["c1"].id, fibers["c2"].id]
    assert sorted(f for name, f in order if name == "result") == sorted(calls)
    for fiber_id in calls:
        assert order.index(("result", fiber_id)) < order.index(("exit", fiber_id))
    assert len([name for name, _ in order if name == "exit"]) == 3


def test_early_needs_protocol_v4(fiberd_served: ThreadFiberd) -> None:
    with FiberdClient(fiberd_served.path) as client, pytest.raises(Refused) as refused:
        client.clone(wait=True, early=True, exec={"argv": ["true"]})
    assert refused.value.code == "bad_request" and "\"v\": 4" in str(refused.value)


def test_a_runner_passes_a_calls_result_on_before_its_end(fiberd_served: ThreadFiberd,
                                                         site: Site) -> None:
    runner = TaskRunner(fiberd_served.path)
    got: list[dict[str, object]] = []
    many: list[tuple[int, dict[str, object]]] = []
    try:
        outcome = runner.run(Task(call={"target": f"{T}:getenv", "args": ["SF_TEST_MARK"]}),
                             got.append)
        outcomes = runner.run_many([Task(call={"target": f"{T}:sleep", "args": [0]}),
                                    Task(exec={"argv": ["true"]})],
                                   result=lambda i, event: many.append((i, event)))
    finally:
        runner.close()
    assert outcome.ok and got == [{"fiber_id": outcome.fiber_id, "result": site.mark}]
    assert all(o.ok for o in outcomes)
    assert [(i, event["fiber_id"]) for i, event in many] == [(0, outcomes[0].fiber_id)]


def test_a_runner_does_not_ask_a_v3_fiberd_again_without_early_results(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "VERSIONS", (1, 2, 3))  # this server speaks up to v3
    runner = TaskRunner(served.path)
    got: list[dict[str, object]] = []
    try:
        outcome = runner.run(Task(call={"target": "json:dumps", "args": [[1]]}), got.append)
    finally:
        runner.close()
    assert not outcome.ok and outcome.refused and outcome.exit is None and got == []
    assert outcome.failure is not None and outcome.failure.startswith("unsupported_version:")
    assert outcome.attempts == 1
    assert [r.code for r in served.refusals] == ["unsupported_version"]  # asked once


def test_a_call_result_past_a_reply_is_a_result_too_large_error_and_the_connection_goes_on(
        fiberd_served: ThreadFiberd) -> None:
    """fiberd's own path bounds a call's record as a task window does: a value that no
    reply could carry ends as a ``ResultTooLarge`` error (early and in the exit), not as
    a reply fiberd cannot encode, and the next request on the connection is answered."""
    with FiberdClient(fiberd_served.path) as client:
        client.clone(wait=True, early=True, v=4,
                     call={"target": "operator:mul", "args": ["y", 17 << 20]})
        (name, early), (_, end) = events_until(client, 1)
        assert name == "result" and early["error"]["type"] == "ResultTooLarge"
        assert end["error"] == early["error"] and end.get("result") is None
        client.clone(wait=True, call={"target": "operator:mul", "args": ["x", 2 << 20]})
        (_, whole), = events_until(client, 1)
        assert whole["result"] == "x" * (2 << 20)
        assert client.ready().ready
