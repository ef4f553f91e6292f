"""Conversations, RECEIVE, transactions, timers and lifetimes, queue status, on SQLite
and PostgreSQL (the ``broker`` fixture runs each test once per backend).

Waiting is always on a condition with a deadline (RECEIVE with a timeout), never a sleep.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from scheduler_lib.broker import (
    DEFAULT,
    DIALOG_TIMER,
    END_DIALOG,
    ERROR,
    Broker,
    BrokerError,
    ConversationEndpoint,
    ConversationGroupNotFound,
    ConversationNotFound,
    ConversationStateError,
    EndpointState,
    Message,
    MessageStatus,
    QueueDisabled,
    TransactionError,
)
from scheduler_lib.broker.transport import delivery

INITIATOR = "InitiatorService"
TARGET = "TargetService"
CONTRACT = "AsyncContract"
IQ = "InitiatorQueue"
TQ = "TargetQueue"
DEADLINE = 5.0  # seconds any expected message may take to show up
LIFETIME_EXPIRED = -8489


def far_endpoint(broker: Broker, handle: uuid.UUID) -> ConversationEndpoint:
    """The other endpoint of the conversation ``handle`` belongs to."""
    me = broker.conversation_endpoint(handle)
    others = [
        e
        for e in broker.conversation_endpoints()
        if e.conversation_id == me.conversation_id and e.is_initiator != me.is_initiator
    ]
    assert len(others) == 1, f"expected one far endpoint, found {others}"
    return others[0]


def receive_until(
    broker: Broker, queue: str, done: Any, deadline: float = DEADLINE, **filters: Any
) -> list[Message]:
    """Receive from ``queue`` until ``done(messages so far)`` or the deadline passes."""
    got: list[Message] = []
    end = time.monotonic() + deadline
    while not done(got):
        remaining = end - time.monotonic()
        if remaining <= 0:
            break
        got += broker.receive(queue, top=100, timeout=remaining, **filters)
    return got


def receive_count(broker: Broker, queue: str, n: int, **filters: Any) -> list[Message]:
    return receive_until(broker, queue, lambda got: len(got) >= n, **filters)


def begin(broker: Broker, **kwargs: Any) -> uuid.UUID:
    return broker.begin_dialog(INITIATOR, TARGET, CONTRACT, **kwargs)


# --- dialogs and endpoint states -----------------------------------------------------


def test_dialog_endpoints_appear_and_change_state(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given a new dialog
    handle = begin(broker)
    # Then its handle is a UUID and only the initiator endpoint exists, started outbound
    assert isinstance(handle, uuid.UUID)
    [initiator] = broker.conversation_endpoints()
    assert initiator.conversation_handle == handle
    assert initiator.is_initiator is True
    assert initiator.state is EndpointState.STARTED_OUTBOUND
    assert (initiator.service_name, initiator.far_service_name) == (INITIATOR, TARGET)
    assert initiator.queue_name == IQ
    # When the first message is sent
    assert broker.send(handle, "AsyncSent", b"job0") == 0
    # Then the target endpoint appears, started inbound, on the target's queue
    target = far_endpoint(broker, handle)
    assert target.state is EndpointState.STARTED_INBOUND
    assert target.is_initiator is False
    assert (target.service_name, target.far_service_name) == (TARGET, INITIATOR)
    assert target.queue_name == TQ
    assert target.contract_name == CONTRACT
    assert target.conversation_handle != handle
    assert target.conversation_group_id != initiator.conversation_group_id
    assert broker.conversation_endpoint(handle).state is EndpointState.STARTED_OUTBOUND
    # When two more are sent, they are numbered 1 and 2
    assert broker.send(handle, "AsyncSent", "job1") == 1
    assert broker.send(handle, "AsyncSent", b"job2") == 2
    # When the target receives them and replies
    msgs = broker.receive(TQ, top=10, timeout=DEADLINE)
    assert [(m.message_sequence_number, m.body) for m in msgs] == [
        (0, b"job0"),
        (1, b"job1"),
        (2, b"job2"),
    ]
    assert {m.conversation_handle for m in msgs} == {target.conversation_handle}
    assert {(m.service_name, m.service_contract_name) for m in msgs} == {(TARGET, CONTRACT)}
    assert {m.queue_name for m in msgs} == {TQ}
    assert broker.send(target.conversation_handle, "AsyncDone", b"done") == 0
    # Then the target is conversing; and once the reply arrives, so is the initiator
    assert broker.conversation_endpoint(target.conversation_handle).state is (
        EndpointState.CONVERSING
    )
    [reply] = broker.receive(IQ, timeout=DEADLINE)
    assert (reply.message_type_name, reply.body) == ("AsyncDone", b"done")
    assert reply.conversation_handle == handle
    assert broker.conversation_endpoint(handle).state is EndpointState.CONVERSING
    # and the target numbers its own messages from 0 too
    assert broker.send(target.conversation_handle, "AsyncDone", None) == 1


def test_default_contract_lets_both_sides_send_default(broker: Broker) -> None:
    # Given services on the DEFAULT contract
    broker.create_queue("A")
    broker.create_queue("B")
    broker.create_service("SA", "A")
    broker.create_service("SB", "B", [DEFAULT])
    # When a dialog is begun without naming a contract and both sides send DEFAULT
    handle = broker.begin_dialog("SA", "SB")
    broker.send(handle, body=b"ping")
    [ping] = broker.receive("B", timeout=DEADLINE)
    broker.send(ping.conversation_handle, DEFAULT, "pong")
    [pong] = broker.receive("A", timeout=DEADLINE)
    # Then both arrive, typed DEFAULT, on the DEFAULT contract
    assert (ping.message_type_name, ping.body, ping.service_contract_name) == (
        DEFAULT,
        b"ping",
        DEFAULT,
    )
    assert (pong.message_type_name, pong.text, pong.conversation_handle) == (
        DEFAULT,
        "pong",
        handle,
    )


# --- receive -------------------------------------------------------------------------


def test_receive_takes_one_group_in_order_with_top_and_timeout(
    scheduler_catalog: Broker,
) -> None:
    broker = scheduler_catalog
    # Given two dialogs (two groups on the target queue), messages interleaved
    first, second = begin(broker), begin(broker)
    broker.send(first, "AsyncSent", b"a0")
    broker.send(second, "AsyncSent", b"b0")
    broker.send(first, "AsyncSent", b"a1")
    broker.send(first, "AsyncSent", b"a2")
    # When receiving with top=2
    got = broker.receive(TQ, top=2, timeout=DEADLINE)
    # Then only the first group's first two messages come, in sequence order
    assert [m.body for m in got] == [b"a0", b"a1"]
    assert len({m.conversation_group_id for m in got}) == 1
    # When receiving twice more with a large top
    second_take = broker.receive(TQ, top=10, timeout=DEADLINE)
    third_take = broker.receive(TQ, top=10, timeout=DEADLINE)
    # Then each RECEIVE returns one group's messages, and together they are the rest
    assert sorted([[m.body for m in second_take], [m.body for m in third_take]]) == [
        [b"a2"],
        [b"b0"],
    ]
    # When the queue is empty, timeout=0 returns [] at once
    started = time.monotonic()
    assert broker.receive(TQ, top=10, timeout=0) == []
    assert time.monotonic() - started < 1.0
    # and a short timeout returns [] after waiting about that long
    started = time.monotonic()
    assert broker.receive(TQ, timeout=0.2) == []
    assert time.monotonic() - started >= 0.19


def test_received_messages_are_gone_without_retention_and_kept_with_it(
    scheduler_catalog: Broker,
) -> None:
    broker = scheduler_catalog
    # Given a message on a queue without retention
    handle = begin(broker)
    broker.send(handle, "AsyncSent", b"plain")
    # When it is received
    [msg] = broker.receive(TQ, timeout=DEADLINE)
    # Then it is no longer in the queue
    assert msg.body == b"plain"
    assert broker.peek(TQ) == []
    # Given retention is turned on and two more messages are sent
    broker.alter_queue(TQ, retention=True)
    broker.send(handle, "AsyncSent", b"kept1")
    broker.send(handle, "AsyncSent", b"kept2")
    # When one is received
    [first] = broker.receive(TQ, timeout=DEADLINE)
    # Then it stays on the queue with status RECEIVED and is not received again
    assert first.body == b"kept1"
    assert first.status is MessageStatus.RECEIVED
    assert [(m.body, m.status) for m in broker.peek(TQ)] == [
        (b"kept1", MessageStatus.RECEIVED),
        (b"kept2", MessageStatus.READY),
    ]
    [second] = broker.receive(TQ, top=10, timeout=DEADLINE)
    assert second.body == b"kept2"
    assert broker.receive(TQ, timeout=0) == []
    assert {m.status for m in broker.peek(TQ)} == {MessageStatus.RECEIVED}
    # When the target ends the conversation
    broker.end_conversation(first.conversation_handle)
    # Then the retained rows are gone
    assert broker.peek(TQ) == []


def test_many_sends_arrive_exactly_once_in_order(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given one dialog
    handle = begin(broker)
    broker.send(handle, "AsyncSent", b"first")  # the target endpoint exists from here
    sent: dict[int, bytes] = {0: b"first"}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def sender(name: str) -> None:
        try:
            for i in range(15):
                body = f"{name}{i}".encode()
                seq = broker.send(handle, "AsyncSent", body)
                with lock:
                    assert seq not in sent
                    sent[seq] = body
        except BaseException as exc:
            errors.append(exc)

    # When two threads send 15 messages each on it concurrently
    threads = [threading.Thread(target=sender, args=(n,)) for n in "xy"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    # Then the sequence numbers are 0..30 with no gap or repeat
    assert sorted(sent) == list(range(31))
    # and receiving in small batches yields each message once, in sequence order
    got: list[Message] = []
    end = time.monotonic() + DEADLINE
    while len(got) < 31 and time.monotonic() < end:
        got += broker.receive(TQ, top=7, timeout=1)
    assert [m.message_sequence_number for m in got] == list(range(31))
    assert [m.body for m in got] == [sent[i] for i in range(31)]
    for prefix in ("x", "y"):  # each thread's messages keep that thread's order
        mine = [m.text for m in got if m.text and m.text.startswith(prefix)]
        assert mine == [f"{prefix}{i}" for i in range(15)]
    assert broker.receive(TQ, timeout=0) == []


def _arrival(far: Any, n: int, body: bytes) -> delivery.Fragment:
    """Message ``n`` for endpoint ``far`` as the transport hands it over, whole."""
    return delivery.Fragment(
        conversation_id=str(far.conversation_id),
        from_initiator=True,
        seq=n,
        index=0,
        count=1,
        from_service=far.far_service_name,
        to_service=far.service_name,
        contract=far.contract_name,
        message_type="AsyncSent",
        body=body,
    )


def test_arrivals_from_another_broker_are_delivered_once_and_in_order(
    scheduler_catalog: Broker,
) -> None:
    broker = scheduler_catalog
    # Given a target endpoint with nothing waiting on its queue
    handle = begin(broker)
    broker.send(handle, "AsyncSent", b"first")
    assert len(broker.receive(TQ, timeout=DEADLINE)) == 1
    far = far_endpoint(broker, handle)
    seq = far.receive_sequence
    receiver = delivery.Receiver(broker)

    def arrival(n: int, body: bytes) -> delivery.Fragment:
        return _arrival(far, n, body)

    # When the transport brings a message, a copy of it, and one that overtook its
    # predecessor — then the predecessor
    outcomes = receiver.accept_batch(
        [arrival(seq, b"a"), arrival(seq, b"a"), arrival(seq + 2, b"c")]
    )
    assert outcomes == [None, None, None]  # all acknowledged: stored or known
    assert [m.body for m in broker.peek(TQ)] == [b"a"]  # the early one is held back
    assert receiver.accept_batch([arrival(seq + 1, b"b")]) == [None]
    # Then each is on the queue once, in sequence order
    queued = broker.peek(TQ)
    assert [(m.message_sequence_number, m.body) for m in queued] == [
        (seq, b"a"),
        (seq + 1, b"b"),
        (seq + 2, b"c"),
    ]
    assert broker.conversation_endpoint(far.conversation_handle).receive_sequence == seq + 3


def test_a_held_message_is_not_forgotten_when_its_batch_emptied_the_hold_before(
    scheduler_catalog: Broker,
) -> None:
    broker = scheduler_catalog
    handle = begin(broker)
    broker.send(handle, "AsyncSent", b"first")
    assert len(broker.receive(TQ, timeout=DEADLINE)) == 1
    far = far_endpoint(broker, handle)
    seq = far.receive_sequence
    receiver = delivery.Receiver(broker)

    def arrival(n: int) -> delivery.Fragment:
        return _arrival(far, n, b"%d" % n)

    # Given n+1 held, then a batch that delivers n and n+1 (emptying the hold) and holds
    # n+3 in the same transaction
    assert receiver.accept_batch([arrival(seq + 1)]) == [None]
    assert receiver.accept_batch([arrival(seq), arrival(seq + 3)]) == [None, None]
    # When n+2 fills the gap
    assert receiver.accept_batch([arrival(seq + 2)]) == [None]
    # Then n+3 is delivered too: the hold was not forgotten
    assert [m.message_sequence_number for m in broker.peek(TQ)] == [seq + i for i in range(4)]


def test_receive_filters_and_get_conversation_group(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given two dialogs with two messages each on the target queue
    first, second = begin(broker), begin(broker)
    for h in (first, second, first, second):
        broker.send(h, "AsyncSent", f"{'a' if h == first else 'b'}")
    t1, t2 = far_endpoint(broker, first), far_endpoint(broker, second)
    # When receiving only the second conversation
    got = broker.receive(TQ, top=10, timeout=DEADLINE, conversation=t2.conversation_handle)
    # Then only its messages come
    assert [(m.conversation_handle, m.message_sequence_number) for m in got] == [
        (t2.conversation_handle, 0),
        (t2.conversation_handle, 1),
    ]
    # When filtering on a group with nothing for it, nothing comes
    assert broker.receive(TQ, timeout=0, group=t2.conversation_group_id) == []
    # When receiving by the first conversation's group
    got = broker.receive(TQ, top=10, timeout=DEADLINE, group=str(t1.conversation_group_id))
    assert [m.conversation_handle for m in got] == [t1.conversation_handle] * 2
    assert {m.conversation_group_id for m in got} == {t1.conversation_group_id}
    # Given one more message for the second conversation
    broker.send(second, "AsyncSent", b"b2")
    # When GET CONVERSATION GROUP runs, then RECEIVE on that group, in one transaction
    with broker.transaction() as tx:
        group = tx.get_conversation_group(TQ, timeout=DEADLINE)
        got = tx.receive(TQ, top=10, timeout=0, group=group)
    # Then the group is the second conversation's and holds its message
    assert group == t2.conversation_group_id
    assert [m.body for m in got] == [b"b2"]
    # and with nothing left, get_conversation_group returns None at once
    assert broker.get_conversation_group(TQ, timeout=0) is None


def test_move_conversation_to_another_group_of_the_queue(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given two dialogs whose target endpoints are in two groups on the target queue
    first, second = begin(broker), begin(broker)
    broker.send(first, "AsyncSent", b"a")
    broker.send(second, "AsyncSent", b"b")
    t1, t2 = far_endpoint(broker, first), far_endpoint(broker, second)
    old_group = t2.conversation_group_id
    # When the second moves to the first's group
    broker.move_conversation(t2.conversation_handle, t1.conversation_group_id)
    # Then the endpoint and its message are in that group, and one RECEIVE takes both
    assert broker.conversation_endpoint(t2.conversation_handle).conversation_group_id == (
        t1.conversation_group_id
    )
    assert {m.conversation_group_id for m in broker.peek(TQ)} == {t1.conversation_group_id}
    got = broker.receive(TQ, top=10, timeout=DEADLINE)
    assert sorted(m.body for m in got) == [b"a", b"b"]
    # and the emptied group is gone: moving into it is refused
    with pytest.raises(ConversationGroupNotFound):
        broker.move_conversation(t1.conversation_handle, old_group)
    # When moving to a group of another queue (the initiator's)
    initiator_group = broker.conversation_endpoint(first).conversation_group_id
    # Then ConversationGroupNotFound and nothing moves
    with pytest.raises(ConversationGroupNotFound):
        broker.move_conversation(t1.conversation_handle, initiator_group)
    with pytest.raises(ConversationGroupNotFound):
        broker.move_conversation(t1.conversation_handle, uuid.uuid4())
    assert broker.conversation_endpoint(t1.conversation_handle).conversation_group_id == (
        t1.conversation_group_id
    )


def test_related_conversation_and_related_group(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given a dialog
    first = begin(broker)
    group = broker.conversation_endpoint(first).conversation_group_id
    # When another dialog is begun related to it
    second = begin(broker, related_conversation=first)
    # Then both are in one group
    assert broker.conversation_endpoint(second).conversation_group_id == group
    # When dialogs are begun with a new group id, twice
    new_group = uuid.uuid4()
    third = begin(broker, related_group=new_group)
    fourth = begin(broker, related_group=str(new_group))
    # Then both are in that group
    assert broker.conversation_endpoint(third).conversation_group_id == new_group
    assert broker.conversation_endpoint(fourth).conversation_group_id == new_group
    # and joining the existing group by id works too
    fifth = begin(broker, related_group=group)
    assert broker.conversation_endpoint(fifth).conversation_group_id == group
    # and the DialogTimers of both related dialogs are received by that group
    broker.begin_conversation_timer(first, 0)
    broker.begin_conversation_timer(second, 0)
    got = receive_count(broker, IQ, 2, group=group)
    assert {m.conversation_handle for m in got} == {first, second}


# --- ending conversations ------------------------------------------------------------


def test_end_conversation_both_sides(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given a conversation with a reply waiting on the initiator's queue
    handle = begin(broker)
    broker.send(handle, "AsyncSent", b"job")
    [job] = broker.receive(TQ, timeout=DEADLINE)
    target = job.conversation_handle
    broker.send(target, "AsyncDone", b"unread reply")
    assert len(broker.peek(IQ)) == 1
    # When the initiator ends it
    broker.end_conversation(handle)
    # Then its unread messages are gone, it is disconnected outbound,
    assert broker.peek(IQ) == []
    assert broker.conversation_endpoint(handle).state is EndpointState.DISCONNECTED_OUTBOUND
    # and the target gets EndDialog (after the messages sent before it), state DI
    [end] = broker.receive(TQ, timeout=DEADLINE)
    assert end.message_type_name == END_DIALOG
    assert end.body is None
    assert end.conversation_handle == target
    assert end.message_sequence_number == 1
    assert broker.conversation_endpoint(target).state is EndpointState.DISCONNECTED_INBOUND
    # When the initiator ends it again, or the target sends on it
    # Then ConversationStateError
    with pytest.raises(ConversationStateError):
        broker.end_conversation(handle)
    with pytest.raises(ConversationStateError):
        broker.send(target, "AsyncDone", b"too late")
    # When the target ends it too
    broker.end_conversation(target)
    # Then both endpoints are gone and nothing more arrives
    assert broker.conversation_endpoints() == []
    for h in (handle, target):
        with pytest.raises(ConversationNotFound):
            broker.conversation_endpoint(h)
        with pytest.raises(ConversationNotFound):
            broker.end_conversation(h)
    assert broker.peek(IQ) == [] and broker.peek(TQ) == []


def test_end_conversation_with_error(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given a conversation the target has seen
    handle = begin(broker)
    broker.send(handle, "AsyncSent", b"job")
    [job] = broker.receive(TQ, timeout=DEADLINE)
    target = job.conversation_handle
    # When the target ends it with an error
    broker.end_conversation(target, 50001, "the job failed")
    # Then the initiator gets an Error message with the code and description, state ER
    [err] = broker.receive(IQ, timeout=DEADLINE)
    assert err.message_type_name == ERROR
    assert err.is_system
    assert err.error == (50001, "the job failed")
    assert err.conversation_handle == handle
    assert broker.conversation_endpoint(handle).state is EndpointState.ERROR
    assert broker.conversation_endpoint(target).state is EndpointState.DISCONNECTED_OUTBOUND
    # and it can no longer send
    with pytest.raises(ConversationStateError):
        broker.send(handle, "AsyncSent", b"more")
    # When the initiator ends its side
    broker.end_conversation(handle)
    # Then both endpoints are gone
    assert broker.conversation_endpoints() == []


def test_end_conversation_with_cleanup_tells_nobody(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given a conversation with two messages waiting for the target
    handle = begin(broker)
    broker.send(handle, "AsyncSent", b"1")
    broker.send(handle, "AsyncSent", b"2")
    target = far_endpoint(broker, handle)
    initiator_before = broker.conversation_endpoint(handle)
    # When the target cleans up its endpoint
    broker.end_conversation(target.conversation_handle, cleanup=True)
    # Then its endpoint and messages are gone
    with pytest.raises(ConversationNotFound):
        broker.conversation_endpoint(target.conversation_handle)
    assert broker.peek(TQ) == []
    # and the initiator was not told: no message, same state
    assert broker.peek(IQ) == []
    assert broker.conversation_endpoint(handle) == initiator_before
    # and the initiator can still end its own side, leaving nothing
    broker.end_conversation(handle)
    assert broker.conversation_endpoints() == []


def test_the_target_sending_after_the_initiator_cleaned_up_is_told_why(
    scheduler_catalog: Broker,
) -> None:
    broker = scheduler_catalog
    # Given a conversation whose initiator endpoint was removed WITH CLEANUP
    handle = begin(broker)
    broker.send(handle, "AsyncSent", b"1")
    target = far_endpoint(broker, handle).conversation_handle
    broker.end_conversation(handle, cleanup=True)
    # When the target answers on it
    # Then it is refused as a state error that names the missing side (not an assertion)
    with pytest.raises(ConversationStateError, match="the initiator endpoint no longer exists"):
        broker.send(target, "AsyncDone", b"done")
    # and nothing was queued for anybody
    assert broker.peek(IQ) == []


def test_send_after_target_cleaned_up_does_not_resurrect_the_target(
    scheduler_catalog: Broker,
) -> None:
    broker = scheduler_catalog
    # Given a conversation whose target endpoint was removed WITH CLEANUP
    handle = begin(broker)
    broker.send(handle, "AsyncSent", b"1")
    target = far_endpoint(broker, handle)
    broker.end_conversation(target.conversation_handle, cleanup=True)
    # When the initiator sends again
    try:
        broker.send(handle, "AsyncSent", b"2")
    except BrokerError:
        refused = True
    else:
        refused = False
    # Then no new target endpoint is made up for the old conversation
    assert [e.conversation_handle for e in broker.conversation_endpoints()] == [handle]
    # and the message is refused or held visibly, not handed to a stranger on the queue
    assert broker.peek(TQ) == []
    held = [r for r in broker.transmission_queue() if r["message_body"] == b"2"]
    assert refused or held, "the message vanished"


# --- transactions --------------------------------------------------------------------


def test_rolled_back_receive_and_send(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given a dialog begun but never sent on, and a second one with two messages waiting
    quiet = begin(broker)
    handle = begin(broker)
    broker.send(handle, "AsyncSent", b"1")
    broker.send(handle, "AsyncSent", b"2")
    target = far_endpoint(broker, handle).conversation_handle
    # When the messages are received, and the quiet dialog sends, in a failing transaction
    with pytest.raises(RuntimeError), broker.transaction() as tx:
        got = tx.receive(TQ, top=10, timeout=DEADLINE)
        assert [m.body for m in got] == [b"1", b"2"]
        assert tx.send(quiet, "AsyncSent", b"never") == 0
        assert tx.send(target, "AsyncDone", b"never either") == 0
        raise RuntimeError("work failed")
    # Then the received messages can be received again, same numbers, in order
    again = broker.receive(TQ, top=10, timeout=DEADLINE)
    assert [(m.message_sequence_number, m.body) for m in again] == [(0, b"1"), (1, b"2")]
    # and the sends left nothing: no message, no target endpoint, no used number
    assert broker.peek(TQ) == [] and broker.peek(IQ) == []
    assert broker.transmission_queue() == []
    assert {e.conversation_handle for e in broker.conversation_endpoints()} == {
        quiet,
        handle,
        target,
    }
    assert broker.conversation_endpoint(quiet).send_sequence == 0
    assert broker.conversation_endpoint(target).state is EndpointState.STARTED_INBOUND
    assert broker.send(quiet, "AsyncSent", b"now") == 0
    assert broker.send(target, "AsyncDone", b"now") == 0


def test_work_in_one_transaction_commits_together(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given the scheduler catalog
    # When a queue, a service, a dialog and two sends are done in one failing transaction
    with pytest.raises(RuntimeError), broker.transaction() as tx:
        tx.create_queue("Q3")
        tx.create_service("S3", "Q3", [CONTRACT])
        h = tx.begin_dialog(INITIATOR, "S3", CONTRACT)
        tx.send(h, "AsyncSent", b"x")
        raise RuntimeError("abort")
    # Then none of it exists
    assert [q.name for q in broker.queues()] == [IQ, TQ]
    assert broker.conversation_endpoints() == []
    # When the same work commits
    with broker.transaction() as tx:
        tx.create_queue("Q3")
        tx.create_service("S3", "Q3", [CONTRACT])
        h = tx.begin_dialog(INITIATOR, "S3", CONTRACT)
        tx.send(h, "AsyncSent", b"x")
        tx.send(h, "AsyncSent", b"y")
    # Then all of it is there
    got = broker.receive("Q3", top=10, timeout=DEADLINE)
    assert [m.body for m in got] == [b"x", b"y"]
    assert len(broker.conversation_endpoints()) == 2


def test_transaction_cannot_be_used_after_it_ended(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    handle = begin(broker)
    # Given a committed transaction and a rolled-back one
    with broker.transaction() as committed:
        committed.send(handle, "AsyncSent", b"ok")
    rolled_back = broker.transaction()
    with pytest.raises(RuntimeError), rolled_back:
        rolled_back.send(handle, "AsyncSent", b"undone")
        raise RuntimeError("abort")
    # When either is used again
    # Then TransactionError, and nothing is written
    for tx in (committed, rolled_back):
        with pytest.raises(TransactionError):
            tx.send(handle, "AsyncSent", b"late")
        with pytest.raises(TransactionError):
            tx.receive(TQ, timeout=0)
        with pytest.raises(TransactionError):
            tx.create_queue("Late")
        with pytest.raises(TransactionError):
            tx.commit()
    assert [m.body for m in broker.peek(TQ)] == [b"ok"]
    assert "Late" not in [q.name for q in broker.queues()]


# --- timers and lifetime -------------------------------------------------------------


def test_conversation_timer_fires_once_and_a_new_call_replaces_it(
    scheduler_catalog: Broker,
) -> None:
    broker = scheduler_catalog
    # Given two dialogs
    first, second = begin(broker), begin(broker)
    # When the first gets a 0.3 s timer, and the second a 0.1 s timer replaced by 0.8 s
    t0 = time.time()
    broker.begin_conversation_timer(first, 0.3)
    broker.begin_conversation_timer(second, 0.1)
    t1 = time.time()
    broker.begin_conversation_timer(second, 0.8)
    # Then each gets exactly one DialogTimer on the local (initiator) queue, not early
    got = receive_until(
        broker, IQ, lambda got: {m.conversation_handle for m in got} == {first, second}
    )
    got += broker.receive(IQ, top=10, timeout=0.3)  # anything extra would show up here
    timers = {m.conversation_handle: m for m in got}
    assert len(got) == 2, got
    assert all(m.message_type_name == DIALOG_TIMER and m.body is None for m in got)
    assert timers[first].enqueued_at >= t0 + 0.3 - 0.01
    assert timers[second].enqueued_at >= t1 + 0.8 - 0.01
    assert broker.peek(TQ) == []  # the far side is not told


def test_lifetime_expiry_errors_both_sides(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given a dialog with a 0.5 s lifetime whose target endpoint exists
    t0 = time.time()
    handle = begin(broker, lifetime=0.5)
    broker.send(handle, "AsyncSent", b"job")
    target = far_endpoint(broker, handle).conversation_handle

    def has_error(got: list[Message]) -> bool:
        return any(m.message_type_name == ERROR for m in got)

    # When the lifetime passes
    initiator_msgs = receive_until(broker, IQ, has_error)
    target_msgs = receive_until(broker, TQ, has_error)
    # Then both sides get an Error with code -8489, not before the lifetime ran out
    for msgs, h in ((initiator_msgs, handle), (target_msgs, target)):
        errors = [m for m in msgs if m.message_type_name == ERROR]
        assert len(errors) == 1, msgs
        assert errors[0].conversation_handle == h
        assert errors[0].error is not None
        assert errors[0].error[0] == LIFETIME_EXPIRED
        assert errors[0].enqueued_at >= t0 + 0.5 - 0.01
        assert broker.conversation_endpoint(h).state is EndpointState.ERROR
    # and neither side can send any more
    with pytest.raises(ConversationStateError):
        broker.send(handle, "AsyncSent", b"more")
    with pytest.raises(ConversationStateError):
        broker.send(target, "AsyncDone", b"more")
    # When both end their side, nothing is left
    broker.end_conversation(handle)
    broker.end_conversation(target)
    assert broker.conversation_endpoints() == []


# --- queue status --------------------------------------------------------------------


def test_disabled_queue_holds_messages_until_enabled(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    # Given the target queue is off
    broker.alter_queue(TQ, status=False)
    # When receiving from it
    # Then QueueDisabled, for RECEIVE and GET CONVERSATION GROUP
    with pytest.raises(QueueDisabled):
        broker.receive(TQ, timeout=0)
    with pytest.raises(QueueDisabled):
        broker.get_conversation_group(TQ, timeout=0)
    # When three messages are sent to it
    handle = begin(broker)
    for body in (b"1", b"2", b"3"):
        broker.send(handle, "AsyncSent", body)
    # Then they wait in the transmission queue, not in the queue
    held = broker.transmission_queue()
    assert [(r["message_sequence_number"], r["message_body"]) for r in held] == [
        (0, b"1"),
        (1, b"2"),
        (2, b"3"),
    ]
    assert all(r["to_queue_name"] == TQ for r in held)
    assert broker.peek(TQ) == []
    # When the queue is turned on
    assert broker.alter_queue(TQ, status=True).is_receive_enabled is True
    # Then the messages arrive in order and the transmission queue is empty
    got = broker.receive(TQ, top=10, timeout=DEADLINE)
    assert [m.body for m in got] == [b"1", b"2", b"3"]
    assert broker.transmission_queue() == []


def test_waiting_receivers_wake_for_messages_and_fail_when_queue_turns_off(
    scheduler_catalog: Broker,
) -> None:
    broker = scheduler_catalog
    results: dict[str, Any] = {}

    def wait(name: str, started: threading.Event) -> None:
        started.set()
        begun = time.monotonic()
        try:
            results[name] = broker.receive(TQ, top=10, timeout=15)
        except BaseException as exc:
            results[name] = exc
        results[name + "_elapsed"] = time.monotonic() - begun

    # Given a receiver waiting on an empty queue
    started = threading.Event()
    receiver = threading.Thread(target=wait, args=("first", started))
    receiver.start()
    assert started.wait(DEADLINE)
    # When a message is sent
    handle = begin(broker)
    broker.send(handle, "AsyncSent", b"wake up")
    # Then the receiver returns it well before its timeout
    receiver.join(timeout=DEADLINE)
    assert not receiver.is_alive()
    assert [m.body for m in results["first"]] == [b"wake up"]
    # Given another receiver waiting on the now empty queue
    started = threading.Event()
    receiver = threading.Thread(target=wait, args=("second", started))
    receiver.start()
    assert started.wait(DEADLINE)
    # When the queue is turned off
    broker.alter_queue(TQ, status=False)
    # Then the receiver gets QueueDisabled instead of waiting out its timeout
    receiver.join(timeout=DEADLINE)
    assert not receiver.is_alive()
    assert isinstance(results["second"], QueueDisabled)
    assert results["second_elapsed"] < DEADLINE
