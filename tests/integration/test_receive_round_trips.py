"""What an empty RECEIVE costs on PostgreSQL: one look before it waits, and a connection
that keeps its prepared statements (psycopg drops them all at every ROLLBACK, so a
waiting reader whose idle transaction ended that way planned its statements anew)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from scheduler_lib.broker import Broker
from scheduler_lib.broker.store import Store

pytestmark = pytest.mark.postgres

QUEUE = "Inbox"


@pytest.fixture
def broker(postgres_url: str) -> Iterator[Broker]:
    broker = Broker(postgres_url, timers=False)
    try:
        broker.create_queue(QUEUE)
        yield broker
    finally:
        broker.close()


def _looks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The one-statement RECEIVEs run from now on."""
    ran: list[str] = []
    on_driver = Store._on_driver

    def counting(self: Store, conn: Any, query: str, params: Any) -> Any:
        if query.startswith("receive_fast"):
            ran.append(query)
        return on_driver(self, conn, query, params)

    monkeypatch.setattr(Store, "_on_driver", counting)
    return ran


def test_an_empty_receive_looks_once(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    broker.receive(QUEUE, timeout=0)  # the queue's settings are read once, then cached
    looks = _looks(monkeypatch)
    # When a RECEIVE that does not wait finds the queue empty, alone or in a transaction
    assert broker.receive(QUEUE, timeout=0) == []
    with broker.transaction() as tx:
        assert tx.receive(QUEUE, timeout=0) == []
    # Then each looked once
    assert looks == ["receive_fast", "receive_fast"]


def test_a_waiting_receive_keeps_the_prepared_statements(broker: Broker) -> None:
    with broker.transaction() as tx:
        # When RECEIVEs wait and find nothing, again and again (each of their looks runs
        # in a transaction of its own that wrote nothing and ends before the wait)
        for _ in range(8):
            assert tx.receive(QUEUE, timeout=0.02) == []
        # Then the connection still has the looks' statement prepared (psycopg prepares
        # a statement at its fifth run)
        prepared = tx._conn().exec_driver_sql(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE '%%queue_messages%%'"
        )
        assert prepared.scalar() >= 1
