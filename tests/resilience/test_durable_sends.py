"""A SEND on the broker itself that returned is on disk: the server crashing right after
it (an immediate stop: what it had not written of its WAL is lost) loses none. The
private server's WAL writer is slowed (``wal_writer_delay`` 10 s) so that what no commit
flushed stays unwritten until the crash, as it may on a busy server: a SEND that returned
before its commit's flush would be lost."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from private_postgres import PrivatePostgres

from scheduler_lib.broker import Broker

pytestmark = pytest.mark.postgres


@pytest.fixture
def slow_wal_writer(private_postgres: PrivatePostgres) -> Iterator[None]:
    def setting(value: str | None) -> None:
        with psycopg.connect(private_postgres.url, autocommit=True) as conn:
            if value is None:
                conn.execute("ALTER SYSTEM RESET wal_writer_delay")
            else:
                conn.execute(f"ALTER SYSTEM SET wal_writer_delay = '{value}'")
            conn.execute("SELECT pg_reload_conf()")

    setting("10s")
    try:
        yield
    finally:
        if not private_postgres.is_accepting():
            private_postgres.start()
        setting(None)


@pytest.fixture
def broker(private_db_url: str, slow_wal_writer: None) -> Iterator[Broker]:
    b = Broker(private_db_url, timers=False)
    try:
        b.create_message_type("Ping")
        b.create_contract("C", {"Ping": "ANY"})
        b.create_queue("Q")
        b.create_service("S", "Q", ["C"])
        yield b
    finally:
        b.close()


def _warm(broker: Broker) -> Any:
    """A conversation whose next SEND takes the one-statement path (in autocommit)."""
    handle = broker.begin_dialog("S", "S", "C")
    broker.send(handle, "Ping", b"warm")
    broker.send(handle, "Ping", b"warm")
    assert [m.body for m in broker.receive("Q", top=10, timeout=5)] == [b"warm", b"warm"]
    return handle


def test_sends_that_returned_survive_a_crash(
    broker: Broker, private_postgres: PrivatePostgres
) -> None:
    handle = _warm(broker)
    # Given SENDs that returned: one-statement SENDs, and SENDs in a transaction
    for i in range(10):
        broker.send(handle, "Ping", f"{i}".encode())
    for i in range(10, 20):
        with broker.transaction() as tx:
            tx.send(handle, "Ping", f"{i}".encode())
    # When the server crashes right after (what it had not written is lost)
    private_postgres.stop("immediate")
    private_postgres.start()
    # Then every one of them is there, in order
    got = [m.body for m in broker.receive("Q", top=100, timeout=0)]
    assert got == [f"{i}".encode() for i in range(20)]
