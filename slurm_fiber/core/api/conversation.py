"""The socket conversation of one connection as a state table (docs/socket-protocol.md,
"The conversation"), h11-style: states by events to the next state and action, or a violation.

The server feeds each connection's ``Conversation`` what happens on it (a request came,
a reply or event went out, the peer hung up) and does what the returned ``Action`` says;
a pair the table does not hold raises ``Violation`` (a defect of the server, never of
the client: every frame a client can send has a row in every state). Pure: no I/O, no
clock; ``TABLE`` is the whole contract, and the protocol document's table is checked
against it (tests/core/api/test_conversation.py).
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    """Where a connection's conversation is."""

    IDLE = "idle"  # between requests: the next frame is a request
    ANSWERING = "answering"  # a request is being answered: one reply (or a stream) follows
    STREAMING = "streaming"  # a waited clone or batch: its events follow, the last final
    WINDOWED = "windowed"  # a waited windowed batch: as streaming, and it takes a cancel
    CLOSED = "closed"  # the connection is over


class Event(enum.Enum):
    """What happens on a connection: frames from the client, replies and events to it."""

    REQUEST = "request"  # a frame that is not a cancel (valid or not)
    CANCEL = "cancel"  # a frame that is a valid cancel request
    BROKEN_FRAME = "broken frame"  # a length header of 0 or over the cap: the stream is lost
    REPLY = "reply"  # a final reply: a result, an error, a miss, or a final started event
    STARTED = "started"  # a non-final started event: the stream begins (or goes on)
    STARTED_WINDOW = "started, window"  # a windowed batch's stream begins: its first
    # non-final started event, or its task window opened (core/api/window_stream.py)
    EXIT = "exit"  # a non-final exit, result or later started event of the stream
    CANCELLED = "cancelled"  # the cancelled event of a windowed batch
    FINAL = "final"  # the stream's final event
    HANG_UP = "hang-up"  # the peer closed the connection (end of stream)
    CLOSE = "close"  # the server closes it: idle timeout, shed for room, fiberd stopping


class Action(enum.Enum):
    """What the server does on that event (besides sending what the event names)."""

    ANSWER = "answer"  # validate the request and answer it (refusals included)
    IGNORE = "ignore"  # take the frame, answer nothing (a cancel with nothing to cancel)
    BUSY = "busy"  # answer the frame with a busy error; the stream goes on
    CANCEL = "cancel"  # start none of the batch's items not started; send its cancelled event
    REFUSE_AND_CLOSE = "refuse and close"  # one error reply (bad_frame, frame_too_large), close
    SEND = "send"  # the reply or event goes out
    HANG_UP_FIBERS = "hang up fibers"  # SIGHUP every fiber still running (with hangup) and
    # start none of a window's items not started; then close
    DROP = "drop"  # the request's answer, if any comes, is not sent; close
    CLOSE = "close"  # close the connection


class Violation(Exception):
    """The server did something the table does not allow in the state it was in."""


TABLE: dict[tuple[State, Event], tuple[State, Action]] = {
    (State.IDLE, Event.REQUEST): (State.ANSWERING, Action.ANSWER),
    (State.IDLE, Event.CANCEL): (State.IDLE, Action.IGNORE),
    (State.IDLE, Event.BROKEN_FRAME): (State.CLOSED, Action.REFUSE_AND_CLOSE),
    (State.IDLE, Event.HANG_UP): (State.CLOSED, Action.CLOSE),
    (State.IDLE, Event.CLOSE): (State.CLOSED, Action.CLOSE),
    (State.ANSWERING, Event.REPLY): (State.IDLE, Action.SEND),
    (State.ANSWERING, Event.STARTED): (State.STREAMING, Action.SEND),
    (State.ANSWERING, Event.STARTED_WINDOW): (State.WINDOWED, Action.SEND),
    (State.ANSWERING, Event.HANG_UP): (State.CLOSED, Action.DROP),
    (State.ANSWERING, Event.CLOSE): (State.CLOSED, Action.DROP),
    (State.STREAMING, Event.REQUEST): (State.STREAMING, Action.BUSY),
    (State.STREAMING, Event.CANCEL): (State.STREAMING, Action.BUSY),
    (State.STREAMING, Event.BROKEN_FRAME): (State.CLOSED, Action.HANG_UP_FIBERS),
    (State.STREAMING, Event.EXIT): (State.STREAMING, Action.SEND),
    (State.STREAMING, Event.FINAL): (State.IDLE, Action.SEND),
    (State.STREAMING, Event.HANG_UP): (State.CLOSED, Action.HANG_UP_FIBERS),
    (State.STREAMING, Event.CLOSE): (State.CLOSED, Action.CLOSE),
    (State.WINDOWED, Event.REQUEST): (State.WINDOWED, Action.BUSY),
    (State.WINDOWED, Event.CANCEL): (State.WINDOWED, Action.CANCEL),
    (State.WINDOWED, Event.BROKEN_FRAME): (State.CLOSED, Action.HANG_UP_FIBERS),
    (State.WINDOWED, Event.EXIT): (State.WINDOWED, Action.SEND),
    (State.WINDOWED, Event.CANCELLED): (State.WINDOWED, Action.SEND),
    (State.WINDOWED, Event.FINAL): (State.IDLE, Action.SEND),
    (State.WINDOWED, Event.HANG_UP): (State.CLOSED, Action.HANG_UP_FIBERS),
    (State.WINDOWED, Event.CLOSE): (State.CLOSED, Action.CLOSE),
}
# Frames a client may send, in any state but closed: each has a row there.
CLIENT_EVENTS = (Event.REQUEST, Event.CANCEL, Event.BROKEN_FRAME, Event.HANG_UP)


class Conversation:
    """One connection's place in ``TABLE``; ``on`` moves it and says what to do."""

    def __init__(self) -> None:
        self.state = State.IDLE

    def on(self, event: Event) -> Action:
        """Take ``event``: the action for it, the state moved on. Raises Violation for a
        pair the table does not hold (the state is left as it was)."""
        try:
            self.state, action = TABLE[self.state, event]
        except KeyError:
            raise Violation(f"{event.value} while {self.state.value}") from None
        return action
