"""END CONVERSATION against what is still queued or pending (issue 22, point 6), on SQLite
and PostgreSQL.

- The far side's END CONVERSATION WITH ERROR: SQL Server receives an Error before every
  other message of the dialog except a DialogTimer, and the messages that were waiting
  stay receivable after it ("Broker System Messages", ms166088). So the Error comes first.
- END cancels the endpoint's conversation timer: an endpoint that ended first waits (DO)
  for the far side's END, and no DialogTimer may arrive on it meanwhile.
- ``peek`` lists the queue in the order RECEIVE serves it, not by conversation handle.

The same Error order across two brokers: tests/transport/test_end_with_error_order.py.
Waiting is on a condition with a deadline, never a sleep.
"""

from __future__ import annotations

import uuid

from test_lifetimes_and_timers import (
    CONTRACT,
    INITIATOR,
    IQ,
    TARGET,
    TQ,
    wait_for,
)

from scheduler_lib.broker import DIALOG_TIMER, ERROR, Broker, EndpointState

TIMER = 0.3  # seconds: the timer END must cancel
CONTROL_TIMER = 0.6  # seconds: a timer due later, whose firing shows the first was due too
CONVERSATIONS = 4


def target_of(broker: Broker, initiator: uuid.UUID) -> uuid.UUID:
    conversation = broker.conversation_endpoint(initiator).conversation_id
    return next(
        e.conversation_handle
        for e in broker.conversation_endpoints()
        if not e.is_initiator and e.conversation_id == conversation
    )


def test_far_side_error_is_received_before_the_messages_still_queued(
    scheduler_catalog: Broker,
) -> None:
    broker = scheduler_catalog
    # Given two messages waiting on the target's queue
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    assert broker.send(handle, "AsyncSent", b"first") == 0
    assert broker.send(handle, "AsyncSent", b"second") == 1
    target = target_of(broker, handle)

    # When the initiator ends the conversation with an error
    broker.end_conversation(handle, error=42, description="gave up")

    # Then the target's peek and RECEIVE both show the Error first (sequence -1), and the
    # two messages stay receivable after it, in their order
    assert broker.conversation_endpoint(target).state is EndpointState.ERROR
    assert [m.message_type_name for m in broker.peek(TQ)] == [ERROR, "AsyncSent", "AsyncSent"]
    got = broker.receive(TQ, top=10, timeout=0)
    assert [(m.message_type_name, m.message_sequence_number) for m in got] == [
        (ERROR, -1),
        ("AsyncSent", 0),
        ("AsyncSent", 1),
    ], got
    assert got[0].error == (42, "gave up")
    assert [m.body for m in got[1:]] == [b"first", b"second"]
    assert all(m.conversation_handle == target for m in got)
    # and the target's END closes both sides
    broker.end_conversation(target)
    assert [
        e for e in broker.conversation_endpoints() if e.conversation_handle in {handle, target}
    ] == []


def test_far_side_error_still_follows_a_dialog_timer(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given a message and a fired DialogTimer waiting on the target's queue
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(handle, "AsyncSent", b"job")
    target = target_of(broker, handle)
    broker.begin_conversation_timer(target, 0)
    wait_for(
        broker,
        lambda: [m for m in broker.peek(TQ) if m.message_type_name == DIALOG_TIMER],
        "DialogTimer on the target queue",
    )
    # When the initiator ends with an error
    broker.end_conversation(handle, error=7, description="stop")
    # Then RECEIVE returns the DialogTimer, the Error, then the message (ms166088)
    got = broker.receive(TQ, top=10, timeout=0)
    assert [m.message_type_name for m in got] == [DIALOG_TIMER, ERROR, "AsyncSent"], got


def test_end_cancels_the_conversation_timer(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given a dialog whose initiator set a timer, and a control dialog whose target set a
    # later one
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(handle, "AsyncSent", b"job")
    control = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(control, "AsyncSent", b"control")
    control_target = target_of(broker, control)
    broker.begin_conversation_timer(handle, TIMER)

    # When the initiator ends while the target stays open (the initiator waits in DO)
    broker.end_conversation(handle)
    broker.begin_conversation_timer(control_target, CONTROL_TIMER)
    assert broker.conversation_endpoint(handle).state is EndpointState.DISCONNECTED_OUTBOUND
    assert broker.conversation_endpoint(handle).timer_due_at is None

    # Then once the later timer has fired, the ended endpoint got no DialogTimer
    wait_for(
        broker,
        lambda: [m for m in broker.peek(TQ) if m.message_type_name == DIALOG_TIMER],
        "the control DialogTimer",
    )
    assert broker.peek(IQ) == []
    assert broker.conversation_endpoint(handle).state is EndpointState.DISCONNECTED_OUTBOUND


def test_peek_lists_in_the_order_receive_serves(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given conversations in their own groups, the first messages sent in the reverse of
    # their target groups' order, then a second message on each
    handles = [broker.begin_dialog(INITIATOR, TARGET, CONTRACT) for _ in range(CONVERSATIONS)]
    for handle in handles:
        broker.send(handle, "AsyncSent", b"0")
    targets = {h: target_of(broker, h) for h in handles}
    groups = {h: broker.conversation_endpoint(t).conversation_group_id for h, t in targets.items()}
    assert len(set(groups.values())) == CONVERSATIONS
    # Received and sent again so that the arrival order is the one this test picks
    for _ in handles:
        assert len(broker.receive(TQ, timeout=0)) == 1
    order = sorted(handles, key=lambda h: str(groups[h]), reverse=True)
    for body in (b"first", b"second"):
        for handle in order:
            broker.send(handle, "AsyncSent", body)

    # Then peek lists group by group in arrival order of each group's first message, as
    # the RECEIVEs that follow return them
    expected = [(targets[h], b) for h in order for b in (b"first", b"second")]
    assert [(m.conversation_handle, m.body) for m in broker.peek(TQ)] == expected
    served = []
    while got := broker.receive(TQ, top=10, timeout=0):
        served.extend((m.conversation_handle, m.body) for m in got)
    assert served == expected
