"""What happens when a held message ARRIVES (issue 22, points 7 and 9), on both backends.

A SEND to a service whose queue is off holds the message in the transmission queue; it
arrives when the queue is turned on (or its service moves to a queue that is on).

- Point 7 (seed 001): the target endpoint gets its level when the conversation's first
  message reaches the target queue, from the priorities that exist then; its released
  messages carry that level. An endpoint that had a message arrive before keeps its level.
- Point 9: a held message whose type's validation changed since the SEND, so that its
  body fails now, is not delivered, nor is anything of its conversation held after it;
  the conversation fails with an Error (code -9617, naming the message type), as a
  message from another broker does. A target endpoint whose first message it was never
  comes to be.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import pytest

from scheduler_lib.broker import Broker, EndpointState, Message
from scheduler_lib.broker.transport.delivery import INVALID_MESSAGE_CODE

INITIATOR = "InitiatorService"
TARGET = "TargetService"
CONTRACT = "SimpleContract"
REQUEST = "RequestMessage"
NOTE = "NoteMessage"  # a second type the initiator sends, checked differently
REPLY = "ReplyMessage"
DEFAULT_LEVEL = 5


def _catalog(broker: Broker) -> None:
    broker.create_message_type(REQUEST, "NONE")
    broker.create_message_type(NOTE, "NONE")
    broker.create_message_type(REPLY, "NONE")
    broker.create_contract(CONTRACT, {REQUEST: "INITIATOR", NOTE: "INITIATOR", REPLY: "TARGET"})
    broker.create_queue("InitiatorQueue")
    broker.create_queue("TargetQueue")
    broker.create_queue("OtherQueue")
    broker.create_service(INITIATOR, "InitiatorQueue")
    broker.create_service(TARGET, "TargetQueue", [CONTRACT])


def _target_priority(broker: Broker, level: int) -> None:
    """A priority matching only target endpoints of CONTRACT (local TARGET)."""
    broker.create_priority(
        "TargetSide", contract=CONTRACT, local_service=TARGET, remote_service=INITIATOR, level=level
    )


def _target_of(broker: Broker, handle: uuid.UUID) -> uuid.UUID:
    conversation_id = broker.conversation_endpoint(handle).conversation_id
    (target,) = [
        e
        for e in broker.conversation_endpoints()
        if e.conversation_id == conversation_id and not e.is_initiator
    ]
    return target.conversation_handle


def _receive_all(broker: Broker, queue: str) -> list[Message]:
    received: list[Message] = []
    while batch := broker.receive(queue, top=100, timeout=0):
        received += batch
    return received


def _turn_on_by_alter_queue(broker: Broker) -> None:
    broker.alter_queue("TargetQueue", status=True)


def _turn_on_by_moving_service(broker: Broker) -> None:
    broker.alter_service(TARGET, queue="OtherQueue")


RELEASES: dict[str, Callable[[Broker], None]] = {
    "alter_queue": _turn_on_by_alter_queue,
    "alter_service": _turn_on_by_moving_service,
}


def _target_queue(release: str) -> str:
    return "TargetQueue" if release == "alter_queue" else "OtherQueue"


def _error_of(message: Message) -> dict[str, object]:
    assert message.message_type_name == "Error", message
    assert message.body is not None
    body = json.loads(message.body)
    assert isinstance(body, dict)
    return body


# --- point 7: the target endpoint's level --------------------------------------------


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_target_level_is_taken_when_the_first_message_arrives(broker: Broker, release: str) -> None:
    # Given a conversation whose first messages were received at level 3 ...
    _catalog(broker)
    _target_priority(broker, 3)
    earlier = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(earlier, REQUEST, b"first")
    (first,) = _receive_all(broker, "TargetQueue")
    assert first.priority == 3
    # ... and, with TargetQueue off, a new conversation's messages and a later message
    # of the earlier conversation, all held
    broker.alter_queue("TargetQueue", status=False)
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    assert broker.send(handle, REQUEST, b"one") == 0
    assert broker.send(handle, REQUEST, b"two") == 1
    assert broker.send(earlier, REQUEST, b"later") == 1
    held = broker.transmission_queue()
    assert [r["priority"] for r in held] == [3, 3, 3]  # the level known at SEND
    target = _target_of(broker, handle)
    assert broker.conversation_endpoint(target).priority == 3

    # When the target side's priority becomes 8 while they wait, and they arrive
    broker.alter_priority("TargetSide", level=8)
    RELEASES[release](broker)

    # Then the new conversation's target endpoint took level 8 as its first message
    # arrived, and so did its messages ...
    assert broker.transmission_queue() == []
    assert broker.conversation_endpoint(target).priority == 8
    received = _receive_all(broker, _target_queue(release))
    by_handle = {(m.conversation_handle, m.message_sequence_number): m for m in received}
    assert by_handle[(target, 0)].priority == 8
    assert by_handle[(target, 1)].priority == 8
    # ... while the earlier conversation's endpoint, whose first message had arrived
    # before, keeps its level 3, and so does its later message
    later = by_handle[(first.conversation_handle, 1)]
    assert (later.body, later.priority) == (b"later", 3)
    assert broker.conversation_endpoint(first.conversation_handle).priority == 3
    # ... and the initiator endpoints (created at BEGIN DIALOG) are untouched
    assert broker.conversation_endpoint(handle).priority == DEFAULT_LEVEL


def test_target_level_falls_back_when_the_priority_is_dropped_while_held(
    broker: Broker,
) -> None:
    # Given a target-side priority of level 9, and TargetQueue off
    _catalog(broker)
    _target_priority(broker, 9)
    broker.alter_queue("TargetQueue", status=False)
    # ... a conversation whose first message is held at the level known at SEND
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(handle, REQUEST, b"one")
    assert [r["priority"] for r in broker.transmission_queue()] == [9]

    # When the priority is dropped and the queue turned on
    broker.drop_priority("TargetSide")
    broker.alter_queue("TargetQueue", status=True)

    # Then no priority matches as the message arrives: level 5
    (message,) = _receive_all(broker, "TargetQueue")
    assert message.priority == DEFAULT_LEVEL
    assert broker.conversation_endpoint(message.conversation_handle).priority == DEFAULT_LEVEL


# --- point 9: validation on arrival ---------------------------------------------------


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_first_message_failing_on_arrival_answers_the_sender_with_an_error(
    broker: Broker, release: str
) -> None:
    # Given TargetQueue off, a conversation whose first message (a body, under
    # VALIDATION = NONE) is held, and another conversation with an empty body, held too
    _catalog(broker)
    broker.alter_queue("TargetQueue", status=False)
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(handle, REQUEST, b"not empty")
    broker.send(handle, NOTE, b"after it")
    fine = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(fine, REQUEST, None)
    target = _target_of(broker, handle)

    # When the message type becomes VALIDATION = EMPTY and the messages arrive
    broker.alter_message_type(REQUEST, "EMPTY")
    RELEASES[release](broker)

    # Then neither message of the failed conversation was delivered, its target endpoint
    # never came to be, and the empty body of the other conversation arrived
    assert broker.transmission_queue() == []
    (delivered,) = _receive_all(broker, _target_queue(release))
    assert delivered.body is None
    assert delivered.conversation_handle == _target_of(broker, fine)
    handles = {e.conversation_handle for e in broker.conversation_endpoints()}
    assert target not in handles
    # ... and the sender got an Error naming the message type, and is in error
    (answer,) = _receive_all(broker, "InitiatorQueue")
    assert answer.conversation_handle == handle
    error = _error_of(answer)
    assert error["code"] == INVALID_MESSAGE_CODE
    assert REQUEST in str(error["description"])
    assert broker.conversation_endpoint(handle).state is EndpointState.ERROR

    # When the sender ends its side, nothing of the conversation is left
    broker.end_conversation(handle)
    handles = {e.conversation_handle for e in broker.conversation_endpoints()}
    assert handle not in handles


def test_later_message_failing_on_arrival_fails_the_conversation_on_both_sides(
    broker: Broker,
) -> None:
    # Given a conversation whose first message arrived (the target knows it) ...
    _catalog(broker)
    broker.alter_message_type(NOTE, "WELL_FORMED_XML")
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(handle, REQUEST, b"first")
    (first,) = _receive_all(broker, "TargetQueue")
    target = first.conversation_handle
    # ... then, with TargetQueue off: a valid message, a body that will fail, and valid
    # messages after it
    broker.alter_queue("TargetQueue", status=False)
    broker.send(handle, REQUEST, b"second")
    broker.send(handle, NOTE, b"<note>third</note>")
    broker.send(handle, REQUEST, b"fourth")
    broker.send(handle, NOTE, b"<note/>")

    # When the type NOTE is altered so that "<note>third</note>" no longer passes: JSON
    broker.alter_message_type(NOTE, "JSON")
    broker.alter_queue("TargetQueue", status=True)

    # Then an Error replaced the failing message (received first, like every Error the
    # broker makes), the message held before the failing one arrived, nothing held after
    # it did, and nothing is left held
    received = _receive_all(broker, "TargetQueue")
    assert [m.message_type_name for m in received] == ["Error", REQUEST]
    assert received[1].body == b"second"
    error = _error_of(received[0])
    assert error["code"] == INVALID_MESSAGE_CODE
    assert NOTE in str(error["description"])
    assert broker.transmission_queue() == []
    # ... and both sides are in error: the sender got an Error too
    (answer,) = _receive_all(broker, "InitiatorQueue")
    assert _error_of(answer)["code"] == INVALID_MESSAGE_CODE
    assert broker.conversation_endpoint(target).state is EndpointState.ERROR
    assert broker.conversation_endpoint(handle).state is EndpointState.ERROR

    # When each side ends, the conversation is gone
    broker.end_conversation(target)
    broker.end_conversation(handle)
    assert broker.conversation_endpoints() == []


def test_reply_failing_on_arrival_at_the_initiator(broker: Broker) -> None:
    # Given a conversation under way, and InitiatorQueue off while the target replies
    _catalog(broker)
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(handle, REQUEST, b"request")
    (request,) = _receive_all(broker, "TargetQueue")
    broker.alter_queue("InitiatorQueue", status=False)
    broker.send(request.conversation_handle, REPLY, b"reply")

    # When the reply's type becomes VALIDATION = EMPTY and InitiatorQueue is turned on
    broker.alter_message_type(REPLY, "EMPTY")
    broker.alter_queue("InitiatorQueue", status=True)

    # Then the initiator gets an Error instead of the reply, and the target one too
    (at_initiator,) = _receive_all(broker, "InitiatorQueue")
    assert _error_of(at_initiator)["code"] == INVALID_MESSAGE_CODE
    assert REPLY in str(_error_of(at_initiator)["description"])
    (at_target,) = _receive_all(broker, "TargetQueue")
    assert at_target.conversation_handle == request.conversation_handle
    assert _error_of(at_target)["code"] == INVALID_MESSAGE_CODE
    assert broker.conversation_endpoint(handle).state is EndpointState.ERROR
    target_endpoint = broker.conversation_endpoint(request.conversation_handle)
    assert target_endpoint.state is EndpointState.ERROR


def test_sender_that_already_ended_is_closed_not_told(broker: Broker) -> None:
    # Given, with TargetQueue off, a conversation's message and then its END, both held
    _catalog(broker)
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(handle, REQUEST, b"first")
    (first,) = _receive_all(broker, "TargetQueue")
    broker.alter_queue("TargetQueue", status=False)
    broker.send(handle, REQUEST, b"will fail")
    broker.end_conversation(handle)
    assert broker.conversation_endpoint(handle).state is EndpointState.DISCONNECTED_OUTBOUND

    # When the body fails on arrival
    broker.alter_message_type(REQUEST, "EMPTY")
    broker.alter_queue("TargetQueue", status=True)

    # Then the initiator, whose application has left, is closed; the target gets the
    # Error (not the EndDialog held after the failing message) and ends alone
    (error,) = _receive_all(broker, "TargetQueue")
    assert _error_of(error)["code"] == INVALID_MESSAGE_CODE
    assert _receive_all(broker, "InitiatorQueue") == []
    handles = {e.conversation_handle for e in broker.conversation_endpoints()}
    assert handles == {first.conversation_handle}
    broker.end_conversation(first.conversation_handle)
    assert broker.conversation_endpoints() == []
