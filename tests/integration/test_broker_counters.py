"""The broker's own counts of events (``scheduler_lib.broker.counters``, exported at
``/metrics``), on both backends: a message is counted once its transaction commits — sent,
received, or rolled back — and poison message handling counts what it turned off and
routed."""

from __future__ import annotations

import pytest

from scheduler_lib.broker import Broker, counters
from scheduler_lib.broker.poison import ROLLBACK_LIMIT, Log, PoisonDetector, PoisonPolicy

QUEUE = "TargetQueue"


class Boom(RuntimeError):
    pass


def count(name: str, **labels: str) -> float:
    return counters.REGISTRY.get_sample_value(f"scheduler_lib_{name}_total", labels) or 0.0


def counts(queue: str = QUEUE) -> dict[str, float]:
    return {
        name: count(name, queue=queue)
        for name in ("messages_sent", "messages_received", "receive_rollbacks", "queues_disabled")
    }


def delta(before: dict[str, float], queue: str = QUEUE) -> dict[str, float]:
    after = counts(queue)
    return {name: after[name] - before[name] for name in after}


def send(broker: Broker, *bodies: str) -> None:
    handle = broker.begin_dialog("InitiatorService", "TargetService", "AsyncContract")
    with broker.transaction() as tx:
        for body in bodies:
            tx.send(handle, "AsyncSent", body)


def test_messages_are_counted_when_their_transaction_commits(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    before = counts()
    # A SEND rolled back was never sent
    with pytest.raises(Boom), broker.transaction() as tx:
        handle = tx.begin_dialog("InitiatorService", "TargetService", "AsyncContract")
        tx.send(handle, "AsyncSent", "never")
        raise Boom("the sender changed its mind")
    assert delta(before)["messages_sent"] == 0
    # Three sent, one and then two received (one RECEIVE rolled back in between)
    send(broker, "1", "2", "3")
    assert broker.receive(QUEUE, top=1, timeout=0)
    with pytest.raises(Boom), broker.transaction() as tx:
        assert tx.receive(QUEUE, top=10, timeout=0)
        raise Boom("the handler failed")
    assert len(broker.receive(QUEUE, top=10, timeout=0)) == 2
    assert delta(before) == {
        "messages_sent": 3,
        "messages_received": 3,
        "receive_rollbacks": 1,
        "queues_disabled": 0,
    }


def test_a_workers_take_counts_as_received(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    send(broker, "work")
    before = counts()
    (lease,) = broker.take(QUEUE, timeout=0, lease=30)
    broker.complete(lease)
    assert delta(before)["messages_received"] == 1


def test_poison_handling_counts_the_queue_it_turned_off(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    send(broker, "poison")
    before = counts()
    for _ in range(ROLLBACK_LIMIT):
        with pytest.raises(Boom), broker.transaction() as tx:
            assert tx.receive(QUEUE, timeout=0)
            raise Boom("poison")
    assert not broker.queue(QUEUE).is_receive_enabled
    assert delta(before) == {
        "messages_sent": 0,
        "messages_received": 0,
        "receive_rollbacks": ROLLBACK_LIMIT,
        "queues_disabled": 1,
    }


def test_a_routed_poison_message_is_counted_by_disposition(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    broker.alter_queue(QUEUE, poison_message_handling=False)
    send(broker, "poison")
    before = count("poison_messages", queue=QUEUE, disposition="log")
    detector = PoisonDetector(broker, QUEUE, PoisonPolicy(threshold=2, dispositions=(Log(),)))

    def fail(*_: object) -> None:
        raise Boom("poison")

    while detector.handle_next(fail, timeout=0):
        pass
    assert detector.counts["routed"] == 1
    assert count("poison_messages", queue=QUEUE, disposition="log") - before == 1
