"""RECEIVE's order where physical insert order is not sequence order (issue 22.5), on
SQLite and PostgreSQL.

Inside the group RECEIVE serves, conversations come by level, then by the arrival of their
oldest ready message, then by sequence number (docs/broker.md, "Sending and receiving").
Each test makes the order the rows were inserted in differ from that order, and receives
one message at a time (``top=1``), so the query's ORDER BY chooses which message comes, not
the sort of the received batch in Python; the conversation tests also take whole batches.

Two sends on one conversation cannot interleave: the sequence number is taken under the
sending endpoint's row lock, held until the sending transaction ends (SQLite: the database
lock), so the rows of one conversation are inserted out of sequence order only by the
broker itself — a DialogTimer numbered below the messages already waiting, messages given
back by their lease holders.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import pytest

from scheduler_lib.broker import Broker
from scheduler_lib.broker.models import DIALOG_TIMER

INITIATOR = "InitiatorService"
TARGET = "TargetService"
CONTRACT = "AsyncContract"
IQ = "InitiatorQueue"
TQ = "TargetQueue"
DEADLINE = 10.0  # seconds a conversation timer may take to fire

T = TypeVar("T")


def wait_for(broker: Broker, probe: Callable[[], T | None], what: str) -> T:
    """Fire due timers and probe until ``probe()`` returns something, or fail at the
    deadline."""
    end = time.monotonic() + DEADLINE
    while True:
        broker.fire_timers()
        found = probe()
        if found:
            return found
        assert time.monotonic() < end, f"no {what} within {DEADLINE} s"
        time.sleep(0.02)  # between probes of the condition, not instead of one


def target_of(broker: Broker, initiator: uuid.UUID) -> uuid.UUID:
    """The target handle of the conversation ``initiator`` began (after its first send)."""
    me = broker.conversation_endpoint(initiator)
    (far,) = [
        e.conversation_handle
        for e in broker.conversation_endpoints()
        if e.conversation_id == me.conversation_id and not e.is_initiator
    ]
    return far


def receive_one_at_a_time(broker: Broker, queue: str) -> list[tuple[uuid.UUID, int, bytes | None]]:
    """RECEIVE TOP (1) until the queue is empty: (handle, sequence number, body) each."""
    got = []
    while batch := broker.receive(queue, top=1, timeout=0):
        (m,) = batch
        got.append((m.conversation_handle, m.message_sequence_number, m.body))
    return got


@pytest.mark.parametrize("retention", [False, True])
def test_a_dialog_timer_numbered_below_waiting_messages_is_received_first(
    scheduler_catalog: Broker, retention: bool
) -> None:
    broker = scheduler_catalog
    # Given two messages waiting on the target's queue (which keeps received messages
    # until their conversation ends, or not)
    broker.alter_queue(TQ, retention=retention)
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(handle, "AsyncSent", b"first")
    broker.send(handle, "AsyncSent", b"second")
    target = target_of(broker, handle)
    # and a conversation timer that fires after them: inserted last, numbered -2
    broker.begin_conversation_timer(target, 0)
    wait_for(
        broker,
        lambda: [m for m in broker.peek(TQ) if m.message_type_name == DIALOG_TIMER],
        "DialogTimer on the target queue",
    )

    # When RECEIVE takes one message at a time
    got = receive_one_at_a_time(broker, TQ)

    # Then the timer comes first, then the messages in their order
    assert [(seq, body) for _, seq, body in got] == [(-2, None), (0, b"first"), (1, b"second")]


def test_leases_given_back_out_of_order_are_received_in_sequence_order(
    scheduler_catalog: Broker,
) -> None:
    broker = scheduler_catalog
    # Given three messages of one conversation, taken under leases
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    for body in (b"m0", b"m1", b"m2"):
        broker.send(handle, "AsyncSent", body)
    leases = broker.take(TQ, top=3, timeout=0)
    assert [lease.message.message_sequence_number for lease in leases] == [0, 1, 2]

    # When the holder gives them back last first (each is queued again as a new row)
    for lease in reversed(leases):
        broker.release(lease)

    # Then RECEIVE still returns them in sequence order
    got = receive_one_at_a_time(broker, TQ)
    assert [(seq, body) for _, seq, body in got] == [(0, b"m0"), (1, b"m1"), (2, b"m2")]


# Equal-level conversations of a group come by the arrival of their oldest ready message
# (issue 22.5), not by their handles' text.


@pytest.mark.parametrize("top", [1, 10])
def test_equal_level_conversations_of_a_group_come_in_arrival_order_not_handle_order(
    scheduler_catalog: Broker, top: int
) -> None:
    broker = scheduler_catalog
    # Given two dialogs in one conversation group on the initiator's side
    one = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    two = broker.begin_dialog(INITIATOR, TARGET, CONTRACT, related_conversation=one)
    assert (
        broker.conversation_endpoint(one).conversation_group_id
        == broker.conversation_endpoint(two).conversation_group_id
    )
    for handle in (one, two):
        broker.send(handle, "AsyncSent", b"hello")
    assert len(broker.receive(TQ, top=10, timeout=0)) == 1
    assert len(broker.receive(TQ, top=10, timeout=0)) == 1
    # whose replies arrive first on the conversation whose handle sorts last as text,
    # interleaved with the other's
    early, late = sorted((one, two), key=str, reverse=True)
    replies = [(early, b"e0"), (late, b"l0"), (early, b"e1"), (late, b"l1")]
    for handle, body in replies:
        broker.send(target_of(broker, handle), "AsyncDone", body)

    # (peek lists the group as one RECEIVE of it would serve it)
    assert [m.body for m in broker.peek(IQ)] == [b"e0", b"e1", b"l0", b"l1"]

    # When RECEIVE takes the group
    if top == 1:
        got = [body for _, _, body in receive_one_at_a_time(broker, IQ)]
    else:
        batch = broker.receive(IQ, top=top, timeout=0)
        got = [m.body for m in batch]
        assert broker.receive(IQ, top=top, timeout=0) == []

    # Then the conversation whose oldest ready reply arrived first comes first: in one
    # batch it comes whole; one at a time, each RECEIVE looks again at what is ready
    # (after e0, the late conversation's l0 is older than e1)
    if top == 1:
        assert got == [b"e0", b"l0", b"e1", b"l1"]
    else:
        assert got == [b"e0", b"e1", b"l0", b"l1"]


def test_a_conversation_moved_into_a_group_keeps_its_place_by_arrival(
    scheduler_catalog: Broker,
) -> None:
    broker = scheduler_catalog
    # Given two target endpoints in groups of their own, the one whose handle sorts last
    # as text with the older message
    firsts = []
    for _ in range(2):
        handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
        broker.send(handle, "AsyncSent", b"first")
        firsts.append(target_of(broker, handle))
    older, newer = firsts
    if str(older) < str(newer):
        # the older one's handle sorts first: make the newer one the one that arrived
        # first by receiving the older one's message and sending it another one now
        assert broker.receive(TQ, top=1, timeout=0, conversation=older)
        (initiator,) = [
            e.conversation_handle
            for e in broker.conversation_endpoints()
            if e.is_initiator
            and e.conversation_id == broker.conversation_endpoint(older).conversation_id
        ]
        broker.send(initiator, "AsyncSent", b"first")
        older, newer = newer, older
    assert str(older) > str(newer)
    # When the newer conversation moves into the older one's group
    broker.move_conversation(newer, broker.conversation_endpoint(older).conversation_group_id)

    # Then RECEIVE returns the older conversation's message first
    got = receive_one_at_a_time(broker, TQ)
    assert [handle for handle, _, _ in got] == [older, newer]
