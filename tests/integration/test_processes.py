"""The broker's promises hold across real processes, on SQLite and on PostgreSQL.

Every test starts its workers (``process_workers.py``) with the ``spawn`` method, so each
is a fresh interpreter with its own ``Broker`` and connections, as in production. Nothing
waits by sleeping: every wait is a condition with a deadline, and every child process is
killed and joined in a ``finally`` block.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import signal
import time
import uuid
from collections import defaultdict
from typing import TypeVar

import process_workers as workers
import pytest
from multiproc import collect, poll, running

from scheduler_lib.broker import (
    DIALOG_TIMER,
    ERROR,
    Broker,
    ConversationStateError,
    EndpointState,
    Message,
)

pytestmark = pytest.mark.slow

CTX = multiprocessing.get_context("spawn")
START_TIMEOUT = 30.0  # seconds for spawned workers to import, connect and meet at a barrier
LIFETIME_EXPIRED_CODE = -8489
# A woken WAITFOR returns well before the polling fallbacks (0.5 s SQLite, 1 s PostgreSQL)
# would have found the message: it was woken (data_version watcher, LISTEN/NOTIFY).
PROMPT_WAKEUP = 0.3

T = TypeVar("T")


# --- helpers -------------------------------------------------------------------------


def of_type(messages: list[Message], message_type: str) -> list[Message]:
    return [m for m in messages if m.message_type_name == message_type]


# --- 1. concurrent receivers and conversation group locks ------------------------------

DIALOGS = 20
SHARED_GROUPS = 4  # dialogs 0..11 share these groups, three dialogs each
SHARING_DIALOGS = 12
REPLIES = 5  # messages per dialog on the initiator queue


def _load_replies(broker: Broker) -> tuple[dict[str, list[bytes]], dict[str, str]]:
    """Twenty dialogs, some sharing a conversation group; each target answers REPLIES times
    so the messages sit on InitiatorQueue in the initiators' groups.

    :return: expected bodies per initiator handle (in sequence order), group per handle
    """
    shared = [uuid.uuid4() for _ in range(SHARED_GROUPS)]
    handles = [
        broker.begin_dialog(
            workers.INITIATOR_SERVICE,
            workers.TARGET_SERVICE,
            workers.CONTRACT,
            related_group=shared[i % SHARED_GROUPS] if i < SHARING_DIALOGS else None,
        )
        for i in range(DIALOGS)
    ]
    with broker.transaction() as tx:
        for handle in handles:
            tx.send(handle, workers.REQUEST, str(handle))
    expected: dict[str, list[bytes]] = defaultdict(list)
    while True:
        with broker.transaction() as tx:
            requests = tx.receive("TargetQueue", top=10, timeout=0)
            for request in requests:
                initiator = request.text
                assert initiator is not None
                for i in range(REPLIES):
                    body = f"{initiator}:{i}".encode()
                    assert tx.send(request.conversation_handle, workers.REPLY, body) == i
                    expected[initiator].append(body)
        if not requests:
            break
    groups = {str(h): str(broker.conversation_endpoint(h).conversation_group_id) for h in handles}
    return dict(expected), groups


def _check_exactly_once_in_order(
    batches: list[workers.Batch],
    expected: dict[str, list[bytes]],
) -> None:
    """Every expected message received once, each conversation in sequence order (batches
    of one conversation ordered by when their receiver held the group)."""
    received = [msg for batch in batches for msg in batch[4]]
    keys = [(handle, seq) for handle, seq, _, _ in received]
    assert len(keys) == len(set(keys)), "a message was received twice"
    assert len(received) == sum(len(bodies) for bodies in expected.values())
    per_conversation: dict[str, list[tuple[int, bytes | None]]] = defaultdict(list)
    for batch in sorted(batches, key=lambda b: b[2]):
        for handle, seq, _, body in batch[4]:
            per_conversation[handle].append((seq, body))
    assert set(per_conversation) == set(expected)
    for handle, bodies in expected.items():
        assert per_conversation[handle] == list(enumerate(bodies)), handle


def test_concurrent_receivers_never_hold_one_group_at_once(
    db_url: str, scheduler_catalog: Broker
) -> None:
    # Given 100 replies on InitiatorQueue in 20 dialogs, 12 of them sharing 4 groups
    broker = scheduler_catalog
    expected, group_of = _load_replies(broker)
    ready = broker.peek("InitiatorQueue")
    assert len(ready) == DIALOGS * REPLIES
    assert (
        len({m.conversation_group_id for m in ready}) == SHARED_GROUPS + DIALOGS - SHARING_DIALOGS
    )
    total = len(ready)

    # When 4 receiver processes drain it, each holding every batch's transaction 10 ms:
    # two take whatever group is free, two name a conversation of a shared group
    sharing = sorted(h for h, g in group_of.items() if list(group_of.values()).count(g) > 1)
    assert len(sharing) == SHARING_DIALOGS
    receivers = 4
    results = CTX.Queue()
    barrier = CTX.Barrier(receivers + 1, timeout=START_TIMEOUT)
    count = CTX.Value("i", 0)
    processes = [
        CTX.Process(
            target=workers.receive_loop,
            args=(db_url, "InitiatorQueue", 3, 0.2, 0.01, total, count, barrier, results, 40.0),
            kwargs={"conversations": sharing if r % 2 else None},
        )
        for r in range(receivers)
    ]
    with running(processes):
        barrier.wait()
        reports = collect(results, receivers)
    batches = [batch for _, payload in reports for batch in payload]

    # Then no two batches of one group overlap in time
    by_group: dict[str, list[workers.Batch]] = defaultdict(list)
    for batch in batches:
        by_group[batch[0]].append(batch)
    for group, held in by_group.items():
        held.sort(key=lambda b: b[2])
        latest_end, latest_pid = held[0][3], held[0][1]
        for _, pid, start, end, _ in held[1:]:
            assert start >= latest_end, (
                f"group {group} held by {pid} from {start} while {latest_pid} held it "
                f"until {latest_end}"
            )
            if end > latest_end:
                latest_end, latest_pid = end, pid
    # ... every batch came from the group it was locked as
    for group, _, _, _, messages in batches:
        assert {group_of[handle] for handle, _, _, _ in messages} == {group}
    # ... every message was received exactly once, each conversation in order
    _check_exactly_once_in_order(batches, expected)
    assert broker.peek("InitiatorQueue") == []
    # ... and on PostgreSQL the receivers really worked side by side
    if broker.dialect == "postgresql":
        assert len({pid for _, pid, _, _, _ in batches}) > 1


# --- 2. a receiver killed mid-transaction ---------------------------------------------


def test_receiver_killed_mid_transaction_loses_nothing(
    db_url: str, scheduler_catalog: Broker
) -> None:
    # Given three conversations with three requests each on TargetQueue
    broker = scheduler_catalog
    for c in range(3):
        handle = broker.begin_dialog(
            workers.INITIATOR_SERVICE, workers.TARGET_SERVICE, workers.CONTRACT
        )
        for i in range(3):
            broker.send(handle, workers.REQUEST, f"c{c}:{i}")
    before = {
        (str(m.conversation_handle), m.message_sequence_number, m.body)
        for m in broker.peek("TargetQueue")
    }
    assert len(before) == 9

    # ... and a process that received two groups in one open transaction and hangs
    results = CTX.Queue()
    hang = CTX.Event()
    child = CTX.Process(
        target=workers.receive_and_hang, args=(db_url, "TargetQueue", 2, 10, results, hang)
    )
    with running([child]):
        try:
            status, pid, held = results.get(timeout=START_TIMEOUT)
        except queue_module.Empty:
            pytest.fail("the receiving process did not report what it holds")
        assert status == "held", held
        held_handles = sorted({handle for handle, _, _, _ in held})
        assert len(held) == 6
        assert len(held_handles) == 2
        if broker.dialect == "postgresql":  # its group locks are real: nobody else gets them
            for handle in held_handles:
                assert broker.receive("TargetQueue", top=10, timeout=0, conversation=handle) == []

        # When it is killed with SIGKILL, transaction still open
        os.kill(pid, signal.SIGKILL)
        child.join(timeout=10)
        assert child.exitcode == -signal.SIGKILL

        # Then the same messages come back: same conversations, same sequence numbers
        deadline = time.monotonic() + 20
        for handle in held_handles:
            back = broker.receive(
                "TargetQueue",
                top=10,
                timeout=max(deadline - time.monotonic(), 0),
                conversation=handle,
            )
            assert [
                (str(m.conversation_handle), m.message_sequence_number, m.body) for m in back
            ] == [(h, seq, body) for h, seq, _, body in held if h == handle]
    # ... and the conversation it never touched is still whole
    rest = {
        (str(m.conversation_handle), m.message_sequence_number, m.body)
        for m in broker.peek("TargetQueue")
    }
    assert rest == before - {(h, seq, body) for h, seq, _, body in held}
    assert len(rest) == 3


# --- 3. timers and lifetimes fire with nobody waiting -----------------------------------


def test_conversation_timer_fires_with_no_process_waiting(
    db_url: str, scheduler_catalog: Broker
) -> None:
    # Given a process that began a dialog, set a 1 s conversation timer and exited
    broker = scheduler_catalog  # open: its timer thread runs; nobody calls receive
    results = CTX.Queue()
    child = CTX.Process(target=workers.begin_with_timer, args=(db_url, 1.0, None, results))
    with running([child]):
        [(_, (handle, timer_started))] = collect(results, 1)
        child.join(timeout=15)
    assert child.exitcode == 0

    # When the timer comes due
    timers = poll(
        lambda: of_type(broker.peek("InitiatorQueue"), DIALOG_TIMER),
        timeout=10,
        what="DialogTimer on InitiatorQueue",
    )

    # Then one DialogTimer for that conversation is on its queue, not before it was due
    assert [str(m.conversation_handle) for m in timers] == [handle]
    assert timers[0].enqueued_at >= timer_started + 1.0 - 0.01
    assert of_type(broker.peek("TargetQueue"), DIALOG_TIMER) == []
    assert broker.conversation_endpoint(handle).timer_due_at is None


def test_lifetime_expiry_with_no_process_waiting_puts_error_on_queues(
    db_url: str, scheduler_catalog: Broker
) -> None:
    # Given a process that began a dialog with a 1.5 s lifetime, sent once and exited
    broker = scheduler_catalog
    results = CTX.Queue()
    child = CTX.Process(target=workers.begin_with_timer, args=(db_url, None, 1.5, results))
    with running([child]):
        [(_, (handle, began))] = collect(results, 1)
        child.join(timeout=15)
    assert child.exitcode == 0

    # When the lifetime runs out
    def errors() -> tuple[list[Message], list[Message]] | None:
        initiator = of_type(broker.peek("InitiatorQueue"), ERROR)
        target = of_type(broker.peek("TargetQueue"), ERROR)
        return (initiator, target) if initiator and target else None

    initiator_errors, target_errors = poll(errors, timeout=10, what="lifetime Error on both queues")

    # Then each side has one lifetime Error, not before the lifetime ended
    initiator = broker.conversation_endpoint(handle)
    [target] = [
        e
        for e in broker.conversation_endpoints()
        if e.conversation_id == initiator.conversation_id and not e.is_initiator
    ]
    assert [str(m.conversation_handle) for m in initiator_errors] == [handle]
    assert [m.conversation_handle for m in target_errors] == [target.conversation_handle]
    for message in initiator_errors + target_errors:
        assert message.error is not None
        assert message.error[0] == LIFETIME_EXPIRED_CODE
        assert message.enqueued_at >= began + 1.5 - 0.01
    # ... both endpoints are in error and refuse further sends
    assert initiator.state is EndpointState.ERROR
    assert target.state is EndpointState.ERROR
    with pytest.raises(ConversationStateError):
        broker.send(handle, workers.REQUEST, b"too late")


# --- 4. senders and receivers in separate processes ------------------------------------


def test_sender_and_receiver_processes_deliver_everything_once_in_order(
    db_url: str, scheduler_catalog: Broker
) -> None:
    # Given 3 sender processes with 2 conversations of 15 requests each, and 2 receivers
    broker = scheduler_catalog
    senders, receivers, conversations, per_conversation = 3, 2, 2, 15
    total = senders * conversations * per_conversation
    results = CTX.Queue()
    barrier = CTX.Barrier(senders + receivers + 1, timeout=START_TIMEOUT)
    count = CTX.Value("i", 0)
    processes = [
        CTX.Process(
            target=workers.send_conversations,
            args=(db_url, s, conversations, per_conversation, barrier, results),
        )
        for s in range(senders)
    ] + [
        CTX.Process(
            target=workers.receive_loop,
            args=(db_url, "TargetQueue", 5, 0.2, 0.002, total, count, barrier, results, 40.0),
        )
        for _ in range(receivers)
    ]

    # When they all run at once
    with running(processes):
        barrier.wait()
        reports = collect(results, senders + receivers)
    sent = [m for _, payload in reports for m in payload if len(m) == 3]
    batches = [b for _, payload in reports for b in payload if len(b) == 5]

    # Then every sender numbered its conversations 0..14
    by_initiator: dict[str, list[int]] = defaultdict(list)
    for handle, seq, _ in sent:
        by_initiator[handle].append(seq)
    assert len(by_initiator) == senders * conversations
    assert all(seqs == list(range(per_conversation)) for seqs in by_initiator.values())
    # ... the receivers got exactly what was sent, no duplicates
    received = [msg for batch in batches for msg in batch[4]]
    assert len(received) == total
    assert sorted(body for _, _, _, body in received) == sorted(body for _, _, body in sent)
    # ... and each (target) conversation in sequence order, one sender conversation each
    expected: dict[str, list[bytes]] = {}
    for handle, _, _, body in received:
        assert body is not None
        prefix = body.decode().rsplit(":", 1)[0]
        expected[handle] = [f"{prefix}:{i}".encode() for i in range(per_conversation)]
    assert len(expected) == senders * conversations
    _check_exactly_once_in_order(batches, expected)
    assert broker.peek("TargetQueue") == []


# --- 5. WAITFOR wakes across processes -------------------------------------------------


def test_waiting_receiver_in_another_process_wakes_promptly_on_send(
    db_url: str, scheduler_catalog: Broker
) -> None:
    # Given a receiver process asleep in receive(timeout=30) on an empty TargetQueue
    broker = scheduler_catalog
    handle = broker.begin_dialog(
        workers.INITIATOR_SERVICE, workers.TARGET_SERVICE, workers.CONTRACT
    )
    results = CTX.Queue()
    blocked = CTX.Event()
    child = CTX.Process(
        target=workers.blocked_receive, args=(db_url, "TargetQueue", 30.0, blocked, results)
    )
    with running([child]):
        assert blocked.wait(START_TIMEOUT), "the receiver never started to wait"

        # When this process sends
        sent_at = time.monotonic()
        broker.send(handle, workers.REQUEST, b"wake up")
        [(_, (messages, returned_at))] = collect(results, 1)

    # Then the receiver got the message, having waited for it, within 5 s of the send
    assert [(seq, body) for _, seq, _, body in messages] == [(0, b"wake up")]
    assert returned_at > sent_at
    latency = returned_at - sent_at
    assert latency < 5.0
    # ... indeed at once: woken by the send, not by a polling fallback
    assert latency < PROMPT_WAKEUP, f"woke {latency:.3f} s after the send"
