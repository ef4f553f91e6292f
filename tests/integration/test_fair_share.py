"""Fair share between conversations (queue option ``fair_share``): bursts of several
conversations are served in turn, not in arrival order."""

from __future__ import annotations

import time

import pytest

from scheduler_lib.broker import Broker, InvalidArgument


def _burst(broker: Broker, name: str, count: int) -> None:
    handle = broker.begin_dialog("InitiatorService", "TargetService", "AsyncContract")
    for i in range(count):
        broker.send(handle, "AsyncSent", f"{name}{i}")


def _receive_all(broker: Broker) -> list[str]:
    order = []
    while True:
        got = broker.receive("TargetQueue", timeout=0)
        if not got:
            return order
        order.extend(m.text or "" for m in got)


def test_without_fair_share_bursts_are_served_in_arrival_order(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    for name in "abc":
        _burst(broker, name, 3)
    assert _receive_all(broker) == ["a0", "a1", "a2", "b0", "b1", "b2", "c0", "c1", "c2"]


def test_with_fair_share_bursts_are_served_in_turn(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    broker.alter_queue("TargetQueue", fair_share=1.0)
    for name in "abc":
        _burst(broker, name, 3)
    assert _receive_all(broker) == ["a0", "b0", "c0", "a1", "b1", "c1", "a2", "b2", "c2"]
    # Within a conversation the order is still the sequence order
    assert broker.queue("TargetQueue").fair_share_quantum == 1.0


def test_a_late_conversation_is_not_queued_behind_a_backlog(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    broker.alter_queue("TargetQueue", fair_share=1.0)
    _burst(broker, "a", 20)
    time.sleep(0.05)
    _burst(broker, "b", 1)
    order = _receive_all(broker)
    assert order.index("b0") <= 2  # served next to a's first messages, not after all 20
    assert [m for m in order if m.startswith("a")] == [f"a{i}" for i in range(20)]


def test_priority_levels_come_before_fair_share(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    broker.alter_queue("TargetQueue", fair_share=1.0)
    broker.create_service("UrgentService", "TargetQueue", ["AsyncContract"])
    broker.create_priority("urgent", local_service="UrgentService", level=9)
    _burst(broker, "a", 3)
    urgent = broker.begin_dialog("InitiatorService", "UrgentService", "AsyncContract")
    for i in range(2):
        broker.send(urgent, "AsyncSent", f"u{i}")
    assert _receive_all(broker)[:2] == ["u0", "u1"]


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "1", True])
def test_fair_share_must_be_a_positive_number_of_seconds(
    scheduler_catalog: Broker, bad: object
) -> None:
    with pytest.raises(InvalidArgument, match="fair_share"):
        scheduler_catalog.alter_queue("TargetQueue", fair_share=bad)  # type: ignore[arg-type]
    assert scheduler_catalog.queue("TargetQueue").fair_share_quantum is None


def test_send_many_sends_in_order_and_all_or_nothing(scheduler_catalog: Broker) -> None:
    broker = scheduler_catalog
    broker.alter_queue("TargetQueue", fair_share=1.0)
    handle = broker.begin_dialog("InitiatorService", "TargetService", "AsyncContract")
    # The first call creates the target endpoint (checked path), the second is one statement
    assert broker.send_many(handle, "AsyncSent", ["a0", "a1"]) == [0, 1]
    assert broker.send_many(handle, "AsyncSent", [b"a2", "a3", None]) == [2, 3, 4]
    other = broker.begin_dialog("InitiatorService", "TargetService", "AsyncContract")
    broker.send_many(other, "AsyncSent", ["b0", "b1"])
    # Fair share still interleaves the two bursts; each stays in sequence order
    order = _receive_all(broker)
    assert [m for m in order if m.startswith("a")] == ["a0", "a1", "a2", "a3"]
    assert order.index("b0") < order.index("a2")
    # A message the contract forbids: nothing of the batch is sent
    broker.create_message_type("Other", "NONE")
    with pytest.raises(Exception, match="not part of contract"):
        broker.send_many(handle, "Other", ["x", "y"])
    assert broker.peek("TargetQueue") == []
    assert broker.send_many(handle, "AsyncSent", []) == []
