"""RETENTION keeps the messages an endpoint sends (issue 22, point 3), on SQLite and
PostgreSQL.

SQL Server (CREATE QUEUE, RETENTION): "all messages sent or received on conversations
that use this queue are retained in the queue until the conversations have ended". A
message sent by an endpoint whose queue has retention on stays on that queue as status 3
(retained sent message), under the sender's handle and group: RECEIVE never returns it,
nothing counts it as ready, ``peek`` shows it, and ending the conversation removes it.

Waiting is on RECEIVE with a timeout, never a sleep.
"""

from __future__ import annotations

import time

import pytest

from scheduler_lib.broker import END_DIALOG, ERROR, Broker, Message, MessageStatus

INITIATOR = "InitiatorService"
PLAIN_INITIATOR = "PlainInitiatorService"
TARGET = "TargetService"
CONTRACT = "JobContract"
IQ = "InitiatorQueue"  # RETENTION = ON
PQ = "PlainQueue"  # RETENTION = OFF
TQ = "TargetQueue"  # RETENTION = OFF unless a test turns it on
DEADLINE = 5.0  # seconds any expected message may take to show up
SENT = MessageStatus.RETAINED_SENT


@pytest.fixture
def catalog(broker: Broker) -> Broker:
    """Job (initiator) / Done (target) between an initiator on a retention queue, one on
    a plain queue, and a target on a plain queue."""
    broker.create_message_type("Job", "NONE")
    broker.create_message_type("Done", "NONE")
    broker.create_contract(CONTRACT, {"Job": "INITIATOR", "Done": "TARGET"})
    broker.create_queue(IQ, retention=True)
    broker.create_queue(PQ)
    broker.create_queue(TQ)
    broker.create_service(INITIATOR, IQ)
    broker.create_service(PLAIN_INITIATOR, PQ)
    broker.create_service(TARGET, TQ, [CONTRACT])
    return broker


def rows(broker: Broker, queue: str) -> list[tuple[int, str, bytes | None, MessageStatus]]:
    """The queue's rows as (sequence number, type, body, status)."""
    return [
        (m.message_sequence_number, m.message_type_name, m.body, m.status)
        for m in broker.peek(queue)
    ]


def receive_all(broker: Broker, queue: str, n: int) -> list[Message]:
    got: list[Message] = []
    while len(got) < n:
        batch = broker.receive(queue, top=n - len(got), timeout=DEADLINE)
        assert batch, f"expected {n} messages on {queue}, got {len(got)}"
        got.extend(batch)
    return got


def test_sent_messages_stay_on_the_senders_queue_in_order(catalog: Broker) -> None:
    broker = catalog
    # Given a dialog from a service whose queue has retention on
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    group = broker.conversation_endpoint(handle).conversation_group_id
    # When it sends three messages (the first creates the target; the rest would go the
    # one-statement way on PostgreSQL)
    seqs = [broker.send(handle, "Job", body) for body in (b"a", b"b", b"c")]
    # Then each stays on the sender's queue as a retained sent message, in order, under
    # the sender's handle and group
    assert seqs == [0, 1, 2]
    assert rows(broker, IQ) == [
        (0, "Job", b"a", SENT),
        (1, "Job", b"b", SENT),
        (2, "Job", b"c", SENT),
    ]
    for m in broker.peek(IQ):
        assert m.conversation_handle == handle
        assert m.conversation_group_id == group
        assert m.service_name == INITIATOR
        assert m.service_contract_name == CONTRACT
    # and the target got them as usual
    assert [m.body for m in receive_all(broker, TQ, 3)] == [b"a", b"b", b"c"]


def test_receive_never_returns_retained_sent_messages(catalog: Broker) -> None:
    broker = catalog
    # Given a sender's queue that holds only retained sent messages
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(handle, "Job", b"a")
    broker.send(handle, "Job", b"b")
    group = broker.conversation_endpoint(handle).conversation_group_id
    assert [status for *_, status in rows(broker, IQ)] == [SENT, SENT]
    # When the sender's queue is received from, every way
    # Then nothing is returned, and nothing counts them as ready
    assert broker.receive(IQ, timeout=0) == []
    assert broker.receive(IQ, top=10, timeout=0.1) == []
    assert broker.receive(IQ, timeout=0, conversation=handle) == []
    assert broker.receive(IQ, timeout=0, group=group) == []
    assert broker.get_conversation_group(IQ, timeout=0) is None
    with broker.transaction() as tx:
        assert tx.receive(IQ, timeout=0) == []
    # and they are still there
    assert [status for *_, status in rows(broker, IQ)] == [SENT, SENT]


def test_answer_received_and_messages_sent_are_both_retained(catalog: Broker) -> None:
    broker = catalog
    # Given a job sent from the retention queue and answered by the target
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(handle, "Job", b"job")
    [job] = receive_all(broker, TQ, 1)
    broker.send(job.conversation_handle, "Done", b"done")
    # When the sender receives the answer
    [answer] = receive_all(broker, IQ, 1)
    # Then it got the answer, not its own message
    assert (answer.message_type_name, answer.body) == ("Done", b"done")
    assert answer.status is MessageStatus.RECEIVED
    # and its queue keeps both: what it sent (3) and what it received (0)
    assert sorted(rows(broker, IQ), key=lambda r: (r[3], r[0])) == [
        (0, "Done", b"done", MessageStatus.RECEIVED),
        (0, "Job", b"job", SENT),
    ]
    assert broker.receive(IQ, timeout=0) == []
    # the target's queue has no retention: it keeps nothing
    assert broker.peek(TQ) == []


def test_target_with_retention_keeps_its_answers(catalog: Broker) -> None:
    broker = catalog
    # Given the target's queue has retention on too
    broker.alter_queue(TQ, retention=True)
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(handle, "Job", b"job")
    [job] = receive_all(broker, TQ, 1)
    # When the target answers twice
    broker.send(job.conversation_handle, "Done", b"d1")
    broker.send(job.conversation_handle, "Done", b"d2")
    # Then the target's queue keeps the job it received and the answers it sent
    assert sorted(rows(broker, TQ), key=lambda r: (r[3], r[0])) == [
        (0, "Job", b"job", MessageStatus.RECEIVED),
        (0, "Done", b"d1", SENT),
        (1, "Done", b"d2", SENT),
    ]
    assert all(m.conversation_handle == job.conversation_handle for m in broker.peek(TQ))
    assert broker.receive(TQ, timeout=0) == []


def test_end_conversation_removes_retained_sent_messages(catalog: Broker) -> None:
    broker = catalog
    broker.alter_queue(TQ, retention=True)
    # Given both sides kept what they sent and received
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(handle, "Job", b"job")
    [job] = receive_all(broker, TQ, 1)
    broker.send(job.conversation_handle, "Done", b"done")
    receive_all(broker, IQ, 1)
    assert {status for *_, status in rows(broker, IQ)} == {SENT, MessageStatus.RECEIVED}
    assert {status for *_, status in rows(broker, TQ)} == {SENT, MessageStatus.RECEIVED}
    # When the initiator ends the conversation
    broker.end_conversation(handle)
    # Then its queue no longer keeps anything of it
    assert broker.peek(IQ) == []
    # the target keeps its rows until it ends too (next to the EndDialog it is to receive)
    assert sorted(rows(broker, TQ), key=lambda r: (r[3], r[0])) == [
        (0, "Job", b"job", MessageStatus.RECEIVED),
        (1, END_DIALOG, None, MessageStatus.READY),
        (0, "Done", b"done", SENT),
    ]
    [end] = receive_all(broker, TQ, 1)
    assert end.message_type_name == END_DIALOG
    broker.end_conversation(job.conversation_handle)
    assert broker.peek(TQ) == []


def test_cleanup_and_error_end_remove_retained_sent_messages(catalog: Broker) -> None:
    broker = catalog
    # Given two dialogs from the retention queue, each with retained sent messages
    first = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    second = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send_many(first, "Job", [b"1a", b"1b"])
    broker.send(second, "Job", b"2a")
    assert len(broker.peek(IQ)) == 3
    # When one ends WITH CLEANUP
    broker.end_conversation(first, cleanup=True)
    # Then only its rows are gone
    assert [(m.conversation_handle, m.body) for m in broker.peek(IQ)] == [(second, b"2a")]
    # When the other ends WITH ERROR
    broker.end_conversation(second, 50001, "gave up")
    # Then its rows are gone too
    assert broker.peek(IQ) == []
    # and the target got the messages and the Error as usual
    types = [m.message_type_name for m in receive_all(broker, TQ, 4)]
    assert sorted(types) == [ERROR, "Job", "Job", "Job"]


def test_far_side_ending_first_keeps_them_until_this_side_ends(catalog: Broker) -> None:
    broker = catalog
    # Given a job sent from the retention queue, and the target ends the conversation
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(handle, "Job", b"job")
    [job] = receive_all(broker, TQ, 1)
    broker.end_conversation(job.conversation_handle)
    # Then the sender still keeps its message (the conversation has not ended here) next
    # to the EndDialog it has to receive
    [end] = receive_all(broker, IQ, 1)
    assert end.message_type_name == END_DIALOG
    assert (0, "Job", b"job", SENT) in rows(broker, IQ)
    # When the sender ends its side (the last to leave closes the endpoint)
    broker.end_conversation(handle)
    # Then nothing of the conversation remains
    assert broker.peek(IQ) == []


def test_without_retention_nothing_sent_is_kept(catalog: Broker) -> None:
    broker = catalog
    # Given one dialog from a queue with retention and one from a queue without
    kept = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    plain = broker.begin_dialog(PLAIN_INITIATOR, TARGET, CONTRACT)
    # When both send, one at a time and several at once
    for handle in (kept, plain):
        broker.send(handle, "Job", b"one")
        broker.send(handle, "Job", b"two")
        broker.send_many(handle, "Job", [b"three", b"four"])
    # Then the plain queue holds nothing, the retention queue all four
    assert broker.peek(PQ) == []
    assert [body for _, _, body, _ in rows(broker, IQ)] == [b"one", b"two", b"three", b"four"]
    assert len(receive_all(broker, TQ, 8)) == 8


def test_send_many_keeps_all_of_them(catalog: Broker) -> None:
    broker = catalog
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    # When send_many sends first (it creates the target endpoint) and again (both
    # endpoints exist: the one-statement way on PostgreSQL, but for retention)
    assert broker.send_many(handle, "Job", [b"a", b"b", b"c"]) == [0, 1, 2]
    with broker.transaction() as tx:
        assert tx.send_many(handle, "Job", [b"d", b"e"]) == [3, 4]
    # Then every message is kept, in order
    assert rows(broker, IQ) == [
        (i, "Job", body, SENT) for i, body in enumerate([b"a", b"b", b"c", b"d", b"e"])
    ]
    assert [m.body for m in receive_all(broker, TQ, 5)] == [b"a", b"b", b"c", b"d", b"e"]


def test_a_send_that_rolls_back_keeps_nothing(catalog: Broker) -> None:
    broker = catalog
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(handle, "Job", b"kept")
    # When a transaction sends and rolls back
    with pytest.raises(RuntimeError), broker.transaction() as tx:
        tx.send(handle, "Job", b"undone")
        assert len(tx.peek(IQ)) == 2  # kept inside the transaction
        raise RuntimeError("roll back")
    # Then only the committed message is kept
    assert rows(broker, IQ) == [(0, "Job", b"kept", SENT)]


def test_turning_retention_off_keeps_what_was_kept(catalog: Broker) -> None:
    broker = catalog
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send(handle, "Job", b"before")
    # When the sender's queue turns retention off
    broker.alter_queue(IQ, retention=False)
    broker.send(handle, "Job", b"after")
    # Then what it sent before stays until the conversation ends; nothing new is kept
    assert rows(broker, IQ) == [(0, "Job", b"before", SENT)]
    broker.end_conversation(handle)
    assert broker.peek(IQ) == []


def test_remote_conversation_keeps_sent_messages(catalog: Broker) -> None:
    broker = catalog
    # Given a service on another broker, reached by a route (nobody listens there: the
    # messages wait in the transmission queue)
    broker.create_route("elsewhere", "RemoteService", "tcp://127.0.0.1:9")
    handle = broker.begin_dialog(INITIATOR, "RemoteService", CONTRACT)
    # When it sends one message and then several
    broker.send(handle, "Job", b"a")
    broker.send_many(handle, "Job", [b"b", b"c", b"d"])
    # Then the sender's queue keeps them all, and they wait to be transmitted
    assert rows(broker, IQ) == [
        (i, "Job", body, SENT) for i, body in enumerate([b"a", b"b", b"c", b"d"])
    ]
    assert all(m.conversation_handle == handle for m in broker.peek(IQ))
    assert len(broker.transmission_queue()) == 4
    assert broker.receive(IQ, timeout=0) == []
    # When it ends the conversation
    broker.end_conversation(handle)
    # Then they are gone from its queue
    assert broker.peek(IQ) == []


def test_remote_without_retention_keeps_nothing(catalog: Broker) -> None:
    broker = catalog
    broker.create_route("elsewhere", "RemoteService", "tcp://127.0.0.1:9")
    kept = broker.begin_dialog(INITIATOR, "RemoteService", CONTRACT)
    plain = broker.begin_dialog(PLAIN_INITIATOR, "RemoteService", CONTRACT)
    for handle in (kept, plain):
        broker.send(handle, "Job", b"a")
        broker.send_many(handle, "Job", [b"b", b"c"])
    assert broker.peek(PQ) == []
    assert [body for _, _, body, _ in rows(broker, IQ)] == [b"a", b"b", b"c"]


def test_nothing_counts_retained_sent_messages_as_ready(catalog: Broker) -> None:
    broker = catalog
    # Given a retention queue that holds only retained sent messages, and has a monitor
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    broker.send_many(handle, "Job", [b"a", b"b"])
    assert len(broker.peek(IQ)) == 2
    with broker.transaction() as tx:
        tx.run("monitor_ensure", queue=IQ, now=time.time())
    # Then activation's looks at the queue find nothing ready
    with broker.transaction() as tx:
        assert tx.fetch_value("queue_head", queue=IQ) is None
        assert tx.fetch_value("queue_ready_count", queue=IQ, cap=10) == 0
    # and neither does its monitor (the `queues` command's "ready")
    [monitor] = [m for m in broker.queue_monitors() if m["queue_name"] == IQ]
    assert monitor["messages_ready"] == 0


def test_lifetime_expiry_keeps_them_until_the_conversation_ends(catalog: Broker) -> None:
    broker = catalog
    # Given a dialog with a short lifetime whose sender kept what it sent
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT, lifetime=0.3)
    broker.send(handle, "Job", b"job")
    # When the lifetime runs out (the sender gets the lifetime Error)
    deadline = time.monotonic() + DEADLINE
    got: list[Message] = []
    while not got:
        assert time.monotonic() < deadline, "no lifetime Error"
        broker.fire_timers()
        got = broker.receive(IQ, timeout=0.1)
    assert [m.message_type_name for m in got] == [ERROR]
    # Then the conversation has not ended here: the sent message is still kept
    assert (0, "Job", b"job", SENT) in rows(broker, IQ)
    # until the sender ends it
    broker.end_conversation(handle)
    assert broker.peek(IQ) == []
