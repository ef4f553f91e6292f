"""MOVE CONVERSATION and the conversation group lock (issue 22.1), on SQLite and PostgreSQL.

A transaction that holds a group (GET CONVERSATION GROUP, RECEIVE) keeps it until it ends;
MOVE CONVERSATION waits for it, for the group it leaves and the group it joins, as in
SQL Server. On PostgreSQL the move is seen waiting in ``pg_stat_activity``; on SQLite the
whole database is the lock, so the move waits for this process's write gate.

Waiting is always on a condition with a deadline, never a sleep.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from scheduler_lib.broker import Broker, ConversationEndpoint, ConversationGroupNotFound

INITIATOR = "InitiatorService"
TARGET = "TargetService"
CONTRACT = "AsyncContract"
TQ = "TargetQueue"
DEADLINE = 10.0  # seconds any expected state may take to show up
POLL = 0.01  # seconds between two looks at a condition


def target_endpoint(broker: Broker, initiator: uuid.UUID) -> ConversationEndpoint:
    """The target endpoint of the conversation ``initiator`` began."""
    me = broker.conversation_endpoint(initiator)
    (far,) = [
        e
        for e in broker.conversation_endpoints()
        if e.conversation_id == me.conversation_id and not e.is_initiator
    ]
    return far


def dialog_with(broker: Broker, *bodies: bytes) -> ConversationEndpoint:
    """A dialog whose target endpoint, in a group of its own, has ``bodies`` queued."""
    handle = broker.begin_dialog(INITIATOR, TARGET, CONTRACT)
    for body in bodies:
        broker.send(handle, "AsyncSent", body)
    return target_endpoint(broker, handle)


def wait_until(condition: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"not within {DEADLINE} s: {what}")
        time.sleep(POLL)


def waits_for_a_lock(db_url: str, mover: threading.Thread) -> Callable[[], bool]:
    """Whether ``mover`` waits for a lock another transaction holds: on PostgreSQL a
    backend of the test database waiting on a heavyweight lock (only the mover can); on
    SQLite the mover's thread blocked at the write gate of this process."""
    if sa.make_url(db_url).get_backend_name() == "postgresql":
        engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)

        def waiting() -> bool:
            if not mover.is_alive():
                pytest.fail("the move finished while another transaction held its group")
            with engine.connect() as conn:
                return bool(
                    conn.scalar(
                        sa.text(
                            "SELECT count(*) FROM pg_stat_activity "
                            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                        )
                    )
                )

        return waiting

    def blocked_at_gate() -> bool:
        if not mover.is_alive():
            pytest.fail("the move finished while another transaction held its group")
        frame = sys._current_frames().get(mover.ident or 0)
        while frame is not None:
            if frame.f_code.co_name == "_enter_gate":
                return True
            frame = frame.f_back
        return False

    return blocked_at_gate


def start_move(
    broker: Broker, handle: uuid.UUID, group: uuid.UUID
) -> tuple[threading.Thread, dict[str, Any]]:
    """MOVE CONVERSATION in a thread of its own; the result says when it ended, or how."""
    result: dict[str, Any] = {}

    def move() -> None:
        try:
            broker.move_conversation(handle, group)
        except BaseException as exc:
            result["error"] = exc
        result["ended"] = time.monotonic()

    mover = threading.Thread(target=move, name="mover", daemon=True)
    mover.start()
    return mover, result


def test_move_out_of_a_held_group_waits_for_its_holder(
    scheduler_catalog: Broker, db_url: str
) -> None:
    broker = scheduler_catalog
    # Given conversation A (two messages) in group G1 and B (one message) in group G2
    a = dialog_with(broker, b"a1", b"a2")
    b = dialog_with(broker, b"b1")
    g1, g2 = a.conversation_group_id, b.conversation_group_id
    # When T1 holds G1 (GET CONVERSATION GROUP)
    with broker.transaction() as t1:
        assert t1.get_conversation_group(TQ, timeout=DEADLINE) == g1
        # and T2 moves A out of G1 into G2
        mover, moved = start_move(broker, a.conversation_handle, g2)
        # Then T2 waits for T1
        wait_until(waits_for_a_lock(db_url, mover), "the move waiting for the group lock")
        # and T1's RECEIVE on G1 returns A's messages (no deadlock)
        got = t1.receive(TQ, top=10, timeout=0, group=g1)
        assert [(m.conversation_handle, m.body) for m in got] == [
            (a.conversation_handle, b"a1"),
            (a.conversation_handle, b"a2"),
        ]
        assert mover.is_alive(), f"the move ended while T1 held G1: {moved}"
        committed = time.monotonic()
    # When T1 commits, then the move completes, without error
    mover.join(DEADLINE)
    assert not mover.is_alive(), "the move did not complete after T1 committed"
    assert "error" not in moved, moved.get("error")
    assert moved["ended"] >= committed
    # and A is in G2 with B; G1, emptied, is gone; B's message waits in G2
    assert broker.conversation_endpoint(a.conversation_handle).conversation_group_id == g2
    with pytest.raises(ConversationGroupNotFound):
        broker.move_conversation(b.conversation_handle, g1)
    assert [(m.conversation_group_id, m.body) for m in broker.peek(TQ)] == [(g2, b"b1")]


def test_move_into_a_held_group_waits_for_its_holder(
    scheduler_catalog: Broker, db_url: str
) -> None:
    broker = scheduler_catalog
    # Given conversation B (one message) in group G2 and A (one message) in group G1
    b = dialog_with(broker, b"b1")
    a = dialog_with(broker, b"a1")
    g1, g2 = a.conversation_group_id, b.conversation_group_id
    # When T1 holds G2 (a RECEIVE took B's message)
    with broker.transaction() as t1:
        got = t1.receive(TQ, top=10, timeout=DEADLINE)
        assert [(m.conversation_group_id, m.body) for m in got] == [(g2, b"b1")]
        # and T2 moves A into G2
        mover, moved = start_move(broker, a.conversation_handle, g2)
        # Then T2 waits for T1: no conversation joins a group while another holds it
        wait_until(waits_for_a_lock(db_url, mover), "the move waiting for the group lock")
        assert t1.receive(TQ, top=10, timeout=0, group=g2) == []
        committed = time.monotonic()
    # When T1 commits, then the move completes, without error
    mover.join(DEADLINE)
    assert not mover.is_alive(), "the move did not complete after T1 committed"
    assert "error" not in moved, moved.get("error")
    assert moved["ended"] >= committed
    # and A and its message are in G2; G1 is gone
    assert broker.conversation_endpoint(a.conversation_handle).conversation_group_id == g2
    assert [(m.conversation_group_id, m.body) for m in broker.peek(TQ)] == [(g2, b"a1")]
    with pytest.raises(ConversationGroupNotFound):
        broker.move_conversation(b.conversation_handle, g1)
