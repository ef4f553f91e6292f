"""What /metrics reads from the database, on both backends, without a server: a queue
turned off holds the messages sent to it (held, not waiting for a remote broker), and a
broker without the scheduler's schema still answers."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import init
from scheduler_lib.scheduler.metrics import BrokerCollector, database_check

CONTRACT, REQUEST = "c", "request"


def samples(broker: Broker) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in BrokerCollector(broker).collect()
        for s in family.samples
    }


@pytest.fixture
def broker(db_url: str) -> Iterator[Broker]:
    with Broker(db_url) as broker:
        broker.create_message_type(REQUEST)
        broker.create_contract(CONTRACT, {REQUEST: "INITIATOR"})
        broker.create_queue("from")
        broker.create_queue("to")
        broker.create_service("sender", "from")
        broker.create_service("receiver", "to", [CONTRACT])
        yield broker


def test_messages_for_a_queue_turned_off_are_held_not_in_transmission(broker: Broker) -> None:
    # Given a queue turned off (as poison message handling turns one off)
    broker.alter_queue("to", status=False)
    # When three messages are sent to it
    with broker.transaction() as tx:
        handle = tx.begin_dialog("sender", "receiver", CONTRACT)
        for i in range(3):
            tx.send(handle, REQUEST, f"{i}".encode())
    seen = samples(broker)
    # Then the scrape says they are held for it, none ready, and the queue is off
    to = (("queue", "to"),)
    assert seen[("scheduler_lib_queue_messages", (*to, ("state", "held")))] == 3
    assert seen[("scheduler_lib_queue_messages", (*to, ("state", "ready")))] == 0
    assert seen[("scheduler_lib_queue_enabled", to)] == 0
    # And none waits for a remote broker
    assert seen[("scheduler_lib_transmission_queue_messages", ())] == 0
    # And once it is on again they are ready, none held
    broker.alter_queue("to", status=True)
    seen = samples(broker)
    assert seen[("scheduler_lib_queue_messages", (*to, ("state", "ready")))] == 3
    assert seen[("scheduler_lib_queue_messages", (*to, ("state", "held")))] == 0


def test_a_broker_without_the_schedulers_schema_shows_its_queues(broker: Broker) -> None:
    # Given a broker made without the scheduler's schema (`init --no-scheduler`)
    families = {f.name for f in BrokerCollector(broker).collect()}
    # Then the scrape answers with the broker's figures, and no task figures
    assert samples(broker)[("scheduler_lib_database_up", ())] == 1
    assert "scheduler_lib_queue_readers" in families
    assert "scheduler_lib_tasks" not in families
    # And once the scheduler's schema is there, its figures are too
    init(broker)
    families = {f.name for f in BrokerCollector(broker).collect()}
    assert {"scheduler_lib_tasks", "scheduler_lib_semaphore_permits"} <= families


def test_a_scrape_neither_waits_for_a_long_write_nor_holds_it_up(broker: Broker) -> None:
    # Given messages on a queue, and a transaction that has written and stays open (a
    # long write: on SQLite it holds the database's one write lock)
    with broker.transaction() as tx:
        handle = tx.begin_dialog("sender", "receiver", CONTRACT)
        tx.send(handle, REQUEST, b"before")
    writer = broker.transaction()
    writer.send(handle, REQUEST, b"not committed yet")
    try:
        # When Prometheus scrapes and the orchestrator asks for health meanwhile
        started = time.monotonic()
        seen = samples(broker)
        healthy = database_check(broker)()
        took = time.monotonic() - started
        # Then both answer at once, from the last commit, and the writer still commits
        assert seen[("scheduler_lib_database_up", ())] == 1
        assert seen[("scheduler_lib_queue_messages", (("queue", "to"), ("state", "ready")))] == 1
        assert healthy == (True, "answers")
        assert took < 5, took  # SQLite's busy timeout is 30 s
    finally:
        writer.commit()
    assert len(broker.peek("to")) == 2
