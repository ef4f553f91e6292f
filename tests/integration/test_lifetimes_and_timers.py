"""Dialog lifetimes and conversation timers against the ends of a conversation (issue 22,
points 2 and 6), on SQLite and PostgreSQL.

- A lifetime that runs out after one side ended its endpoint (state DO) closes that
  endpoint and tells nobody; only open endpoints (SO, SI, CO) get the lifetime Error.
- SQL Server receives a conversation's DialogTimer before any other message of it, then a
  broker-made Error, then the rest in sequence order ("Broker System Messages",
  ms166088): so do we.

Waiting is on a condition with a deadline, never a sleep.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import pytest

from scheduler_lib.broker import (
    DIALOG_TIMER,
    END_DIALOG,
    ERROR,
    Broker,
    ConversationEndpoint,
    EndpointState,
)

INITIATOR = "InitiatorService"
TARGET = "TargetService"
CONTRACT = "AsyncContract"
IQ = "InitiatorQueue"
TQ = "TargetQueue"
DEADLINE = 10.0  # seconds an expected lifetime or timer may take to fire
LIFETIME = 0.5  # seconds
LIFETIME_EXPIRED = -8489
CONVERSATIONS = 3  # a leak would grow with each of them

T = TypeVar("T")


def wait_for(broker: Broker, probe: Callable[[], T | None], what: str) -> T:
    """Fire due timers and probe until ``probe()`` returns something, or fail at the
    deadline (the timer thread fires them too; firing here does not wait for its tick)."""
    end = time.monotonic() + DEADLINE
    while True:
        broker.fire_timers()
        found = probe()
        if found:
            return found
        assert time.monotonic() < end, f"no {what} within {DEADLINE} s"
        time.sleep(0.02)  # between probes of the condition, not instead of one


def endpoints_of(broker: Broker, handles: list[uuid.UUID]) -> list[ConversationEndpoint]:
    wanted = set(handles)
    return [e for e in broker.conversation_endpoints() if e.conversation_handle in wanted]


def open_dialogs(broker: Broker) -> tuple[list[uuid.UUID], list[uuid.UUID]]:
    """CONVERSATIONS dialogs with a short lifetime whose target endpoints exist and whose
    first message was received: (initiator handles, target handles)."""
    initiators = [
        broker.begin_dialog(INITIATOR, TARGET, CONTRACT, lifetime=LIFETIME)
        for _ in range(CONVERSATIONS)
    ]
    for handle in initiators:
        broker.send(handle, "AsyncSent", b"job")
    targets: list[uuid.UUID] = []
    for _ in initiators:
        (got,) = broker.receive(TQ, timeout=DEADLINE)
        targets.append(got.conversation_handle)
    assert broker.peek(TQ) == [] and broker.peek(IQ) == []
    by_conversation = {e.conversation_id: e for e in endpoints_of(broker, initiators)}
    ordered = {
        by_conversation[e.conversation_id].conversation_handle: e.conversation_handle
        for e in endpoints_of(broker, targets)
    }
    return initiators, [ordered[h] for h in initiators]


@pytest.mark.parametrize("ended_first", ["initiator", "target"])
def test_lifetime_closes_an_endpoint_its_side_already_ended(
    scheduler_catalog: Broker, ended_first: str
) -> None:
    broker = scheduler_catalog
    # Given dialogs with a 0.5 s lifetime, and one side of each ended before it ran out
    initiators, targets = open_dialogs(broker)
    ended, other = (initiators, targets) if ended_first == "initiator" else (targets, initiators)
    ended_queue, other_queue = (IQ, TQ) if ended_first == "initiator" else (TQ, IQ)
    for handle in ended:
        broker.end_conversation(handle)
    assert {e.state for e in endpoints_of(broker, ended)} == {EndpointState.DISCONNECTED_OUTBOUND}
    assert {e.state for e in endpoints_of(broker, other)} == {EndpointState.DISCONNECTED_INBOUND}

    # When the lifetime runs out (the ended endpoints leave state DO, one way or another)
    wait_for(
        broker,
        lambda: all(
            e.state is not EndpointState.DISCONNECTED_OUTBOUND for e in endpoints_of(broker, ended)
        ),
        "lifetime expiry on the ended endpoints",
    )

    # Then the ended endpoints are closed, and nothing was put on their queue
    assert endpoints_of(broker, ended) == []
    assert broker.peek(ended_queue) == []
    # and the other side, still to END, keeps its EndDialog and gets no Error on top
    assert {e.state for e in endpoints_of(broker, other)} == {EndpointState.DISCONNECTED_INBOUND}
    rows = broker.peek(other_queue)
    assert sorted((m.conversation_handle, m.message_type_name) for m in rows) == sorted(
        (h, END_DIALOG) for h in other
    )

    # When the other side receives its EndDialogs and ends its endpoints
    for _ in other:
        (got,) = broker.receive(other_queue, timeout=DEADLINE)
        assert got.message_type_name == END_DIALOG
        broker.end_conversation(got.conversation_handle)

    # Then no endpoint, queue row or held message is left of any of the conversations
    assert broker.conversation_endpoints() == []
    assert broker.peek(IQ) == [] and broker.peek(TQ) == []
    assert broker.transmission_queue() == []


def test_an_ended_endpoint_whose_group_is_held_closes_once_the_holder_commits(
    scheduler_catalog: Broker,
) -> None:
    broker = scheduler_catalog
    if broker.dialect != "postgresql":
        pytest.skip("on SQLite a transaction holding a group holds the whole database")
    # Given an ended initiator endpoint (DO) with a short lifetime, and a second dialog in
    # its conversation group with an answer waiting on the initiator queue
    first = broker.begin_dialog(INITIATOR, TARGET, CONTRACT, lifetime=LIFETIME)
    second = broker.begin_dialog(INITIATOR, TARGET, CONTRACT, related_conversation=first)
    for handle in (first, second):
        broker.send(handle, "AsyncSent", b"job")
    by_handle = {m.conversation_handle: m for m in broker.receive(TQ, timeout=DEADLINE)}
    by_handle.update({m.conversation_handle: m for m in broker.receive(TQ, timeout=DEADLINE)})
    second_id = broker.conversation_endpoint(second).conversation_id
    second_target = next(
        h for h in by_handle if broker.conversation_endpoint(h).conversation_id == second_id
    )
    broker.send(second_target, "AsyncDone", b"done")
    broker.end_conversation(first)
    group = broker.conversation_endpoint(first).conversation_group_id
    due = broker.conversation_endpoint(first).lifetime_expires_at
    assert due is not None

    # When a transaction holds that group while the lifetime runs out
    with broker.transaction() as tx:
        (answer,) = tx.receive(IQ, group=group, timeout=DEADLINE)
        assert answer.conversation_handle == second

        def looked_at() -> bool:
            rows = endpoints_of(broker, [first])
            return (
                not rows
                or rows[0].state is not EndpointState.DISCONNECTED_OUTBOUND
                or ((rows[0].lifetime_expires_at or 0.0) > due)
            )

        wait_for(broker, looked_at, "lifetime expiry looking at the ended endpoint")
        # Then expiry does not wait for the group: the endpoint stays, still ended, with
        # nothing put on its queue, to be looked at again
        (still,) = endpoints_of(broker, [first])
        assert still.state is EndpointState.DISCONNECTED_OUTBOUND
        assert [m.message_type_name for m in broker.peek(IQ)] == ["AsyncDone"]

    # When the holder commits
    # Then the ended endpoint is closed, and no Error was put anywhere
    wait_for(broker, lambda: endpoints_of(broker, [first]) == [], "the ended endpoint closed")
    assert broker.peek(IQ) == []
    assert ERROR not in {m.message_type_name for m in broker.peek(TQ)}


def test_dialog_timer_is_received_before_the_lifetime_error_and_waiting_messages(
    scheduler_catalog: Broker,
) -> None:
    broker = scheduler_catalog
    # Given a dialog with a 0.5 s lifetime and two messages waiting on the target's queue
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT, lifetime=LIFETIME)
    assert broker.send(handle, "AsyncSent", b"first") == 0
    assert broker.send(handle, "AsyncSent", b"second") == 1
    target = next(
        e.conversation_handle
        for e in broker.conversation_endpoints()
        if not e.is_initiator
        and e.conversation_id == broker.conversation_endpoint(handle).conversation_id
    )

    # When the lifetime runs out (its Error arrives while the two messages wait)
    wait_for(
        broker,
        lambda: [m for m in broker.peek(TQ) if m.message_type_name == ERROR],
        "lifetime Error on the target queue",
    )
    # and then a conversation timer fires on the target side
    broker.begin_conversation_timer(target, 0)
    wait_for(
        broker,
        lambda: [m for m in broker.peek(TQ) if m.message_type_name == DIALOG_TIMER],
        "DialogTimer on the target queue",
    )

    # Then RECEIVE returns the DialogTimer first, then the Error, then the two messages in
    # their order — whatever order the timer and the Error arrived in (ms166088)
    got = broker.receive(TQ, top=10, timeout=0)
    assert [(m.message_type_name, m.body) for m in got[2:]] == [
        ("AsyncSent", b"first"),
        ("AsyncSent", b"second"),
    ]
    assert [m.message_type_name for m in got[:2]] == [DIALOG_TIMER, ERROR], got
    assert got[1].error is not None and got[1].error[0] == LIFETIME_EXPIRED
    assert all(m.conversation_handle == target for m in got)
    assert broker.peek(TQ) == []
