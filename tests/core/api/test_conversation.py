"""The socket conversation's state table (core/api/conversation.py): walked pair by pair,
a hang-up in every state, and the same table as docs/socket-protocol.md writes it."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from slurm_fiber.client.connection import FiberdClient
from slurm_fiber.core.api.conversation import (
    CLIENT_EVENTS,
    TABLE,
    Action,
    Conversation,
    Event,
    State,
    Violation,
)
from tests.core.api.servicekit import Served

DOC = Path(__file__).parents[3] / "docs" / "socket-protocol.md"
READING = (State.IDLE, State.STREAMING, State.WINDOWED)  # where the server reads frames


def reach(state: State) -> Conversation:
    """A conversation brought to ``state`` by events of the table."""
    conv = Conversation()
    path = {State.IDLE: [], State.ANSWERING: [Event.REQUEST],
            State.STREAMING: [Event.REQUEST, Event.STARTED],
            State.WINDOWED: [Event.REQUEST, Event.STARTED_WINDOW],
            State.CLOSED: [Event.HANG_UP]}[state]
    for event in path:
        conv.on(event)
    assert conv.state is state
    return conv


@pytest.mark.parametrize(("state", "event"), list(itertools.product(State, Event)))
def test_every_pair_moves_as_the_table_says_or_is_a_violation(state: State,
                                                              event: Event) -> None:
    conv = reach(state)
    if (state, event) in TABLE:
        assert (conv.on(event), conv.state) == TABLE[state, event][::-1]
    else:
        with pytest.raises(Violation, match=f"{event.value} while {state.value}"):
            conv.on(event)
        assert conv.state is state


@pytest.mark.parametrize("state", [s for s in State if s is not State.CLOSED])
def test_a_hang_up_in_every_state_closes_and_a_stream_hangs_up_its_fibers(
        state: State) -> None:
    conv = reach(state)
    action = conv.on(Event.HANG_UP)
    assert conv.state is State.CLOSED
    assert action is {State.IDLE: Action.CLOSE, State.ANSWERING: Action.DROP,
                      State.STREAMING: Action.HANG_UP_FIBERS,
                      State.WINDOWED: Action.HANG_UP_FIBERS}[state]
    with pytest.raises(Violation):  # nothing follows a closed conversation
        conv.on(Event.HANG_UP)


def test_whatever_a_client_sends_where_the_server_reads_has_a_row() -> None:
    assert all((s, e) in TABLE for s in READING for e in CLIENT_EVENTS)
    assert not [pair for pair in TABLE if pair[0] is State.CLOSED]


def test_a_stream_goes_back_to_idle_only_by_its_final_event() -> None:
    conv = reach(State.WINDOWED)
    for event in (Event.EXIT, Event.CANCEL, Event.CANCELLED, Event.REQUEST, Event.EXIT):
        conv.on(event)
        assert conv.state is State.WINDOWED
    assert conv.on(Event.FINAL) is Action.SEND and conv.state is State.IDLE


def test_the_documents_table_is_the_codes() -> None:
    text = DOC.read_text()
    section = text[text.index("## The conversation"):text.index("## Requests")]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    documented = {}
    for row in rows:
        cells = [cell.strip().strip("`") for cell in row.strip("|").split("|")]
        state, event, nxt, action = cells[:4]
        documented[State(state), Event(event)] = (State(nxt), Action(action))
    assert documented == TABLE


def test_a_client_gone_before_its_started_event_has_its_fiber_hung_up(served: Served) -> None:
    """A hang-up found by the write of a waited clone's ``started`` event is the stream's
    hang-up: the fiber it started gets SIGHUP, as one found by a read would."""
    client = FiberdClient(served.path)
    client.send({"op": "clone", "grant": "slow-g", "exec": {"argv": ["sleep", "30"]},
                 "wait": True})
    client.close()  # gone before fiberd answers (it takes 0.5 s)
    deadline = time.monotonic() + 30
    while not served.service.fibers:
        assert time.monotonic() < deadline, "the clone never started"
        time.sleep(0.05)
    (fiber,) = served.service.fibers.values()
    end = served.call(fiber.wait)
    assert end.signal == 1  # SIGHUP
