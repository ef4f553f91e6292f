"""What a reader's transaction holds, per backend (issue 22.8).

On PostgreSQL a RECEIVE locks its conversation group's row: a sender on another queue goes
on while the reader's transaction is open. On SQLite the transaction holds the database's
write lock (``BEGIN IMMEDIATE``): that sender waits until the reader commits. The tests
hold a reader's transaction open for ``HOLD`` seconds and time a send on an unrelated
queue; docs/broker.md quotes what they show. ``scheduler-lib serve`` on SQLite says so
once for a queue configured with more than one such reader.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import activation_procedures as procs
import pytest
from multiproc import poll

from scheduler_lib.broker import Broker, activation

HOLD = 1.0  # seconds the reader keeps its transaction open
WAIT = 30.0  # seconds any step may take on a loaded machine


def two_pairs(broker: Broker) -> None:
    """Two independent routes: A (the reader's) and B (the sender's)."""
    broker.create_message_type("Job", "NONE")
    broker.create_contract("Jobs", {"Job": "INITIATOR"})
    for side in ("A", "B"):
        broker.create_queue(f"{side}From")
        broker.create_queue(f"{side}To")
        broker.create_service(f"{side}Client", f"{side}From")
        broker.create_service(f"{side}Work", f"{side}To", ["Jobs"])


def test_a_reader_transaction_blocks_other_senders_on_sqlite_only(broker: Broker) -> None:
    # Given a message waiting on queue A, and a second broker (its own connections)
    two_pairs(broker)
    handle = broker.begin_dialog("AClient", "AWork", "Jobs")
    broker.send(handle, "Job", b"a")
    other = Broker(broker.url.render_as_string(hide_password=False), migrate=False, timers=False)
    b_handle = other.begin_dialog("BClient", "BWork", "Jobs")
    sent: dict[str, Any] = {}
    go = threading.Event()

    def send_on_b() -> None:
        go.wait(WAIT)
        started = time.monotonic()
        other.send(b_handle, "Job", b"b")
        sent["took"] = time.monotonic() - started
        sent["at"] = time.monotonic()

    sender = threading.Thread(target=send_on_b, daemon=True)
    sender.start()
    try:
        # When a reader receives on A and keeps its transaction open for HOLD seconds
        with broker.transaction() as tx:
            [message] = tx.receive("ATo", timeout=5)
            assert message.body == b"a"
            go.set()
            held_until = time.monotonic() + HOLD
            if broker.dialect == "postgresql":
                # Then on PostgreSQL the send on B completes while the reader still holds A
                poll(lambda: "at" in sent, WAIT, "the send on queue B")
                assert sent["at"] < held_until, sent
            else:
                time.sleep(HOLD)  # the hold itself is what is measured, not a wait for a state
            committed = time.monotonic()
        sender.join(WAIT)
        assert not sender.is_alive(), "the send on B never finished"
        if broker.dialect == "sqlite":
            # Then on SQLite the send on B finished only once the reader committed
            assert sent["at"] >= committed, sent
            assert sent["took"] >= HOLD * 0.9, sent
        assert [m.body for m in other.receive("BTo", timeout=5)] == [b"b"]
    finally:
        other.close()


def test_serve_on_sqlite_warns_once_for_a_queue_of_several_transactional_readers(
    broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    # Given an activating queue for up to 2 readers that receive inside their transactions
    two_pairs(broker)
    broker.create_queue(
        "Work",
        activation_status=True,
        activation_procedure="activation_procedures.reader",
        max_queue_readers=2,
    )
    broker.create_service("WorkService", "Work", ["Jobs"])
    procs.reset()
    caplog.set_level(logging.WARNING, logger="scheduler_lib.broker.activation")
    # When its messages are served, twice
    with activation.running(broker, check_interval=0.1):
        for n in (1, 2):
            handle = broker.begin_dialog("AClient", "WorkService", "Jobs")
            broker.send(handle, "Job", b"{}")
            poll(lambda n=n: len(procs.events("done")) == n, WAIT, f"job {n} to be done")
    # Then SQLite said once that the readers are serialized; PostgreSQL said nothing
    said = [
        m
        for m in map(logging.LogRecord.getMessage, caplog.records)
        if "lock is the whole database" in m
    ]
    if broker.dialect == "sqlite":
        assert len(said) == 1, said
        assert said[0].startswith("queue Work: max_queue_readers=2 on SQLite")
    else:
        assert said == []
