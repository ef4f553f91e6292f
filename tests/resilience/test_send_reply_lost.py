"""A SEND on the broker itself (``broker.send``, no transaction) is one statement that
commits as it runs on PostgreSQL. The server restarts around it: a connection the
server closed while it sat in the pool is replaced before the SEND (the SEND goes, once,
no error), and a SEND whose reply is lost raises ``ConnectionLost(committing=True)``
instead of being sent again — the message is there once, never twice. And a SEND that
returned is on disk: the server crashing right after it (an immediate stop, its WAL
writer slowed so that nothing but the commit's own flush writes it) loses none."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from private_postgres import PrivatePostgres

from scheduler_lib.broker import Broker, ConnectionLost
from scheduler_lib.broker.db.store import Store

pytestmark = pytest.mark.postgres


@pytest.fixture
def broker(private_db_url: str) -> Iterator[Broker]:
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
    """A conversation whose next SEND takes the one-statement path (the message type's
    validation known, both endpoints there)."""
    handle = broker.begin_dialog("S", "S", "C")
    broker.send(handle, "Ping", b"warm")
    broker.send(handle, "Ping", b"warm")
    assert [m.body for m in broker.receive("Q", top=10, timeout=5)] == [b"warm", b"warm"]
    return handle


def _bodies(broker: Broker) -> list[bytes | None]:
    return [m.body for m in broker.receive("Q", top=10, timeout=0)]


def test_a_send_after_a_restart_goes_once_on_a_new_connection(
    broker: Broker, private_postgres: PrivatePostgres
) -> None:
    handle = _warm(broker)
    # Given the server restarted while the broker's connections sat in its pool
    private_postgres.restart()
    # When the next SEND runs, Then it goes, once, without an error: the dead pooled
    # connection was replaced before the statement (else it could not tell whether the
    # statement went, and would raise)
    broker.send(handle, "Ping", b"after the restart")
    assert _bodies(broker) == [b"after the restart"]


def test_a_send_whose_reply_is_lost_is_not_sent_twice(
    broker: Broker, private_postgres: PrivatePostgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle = _warm(broker)
    on_driver = Store._on_driver
    sprung: list[str] = []

    def reply_lost(self: Store, conn: Any, query: str, params: Mapping[str, Any]) -> Any:
        if query != "send_fast" or sprung:
            return on_driver(self, conn, query, params)
        sprung.append(query)
        on_driver(self, conn, query, params)  # it commits ...
        private_postgres.restart()  # ... and its connection dies before the reply:
        return on_driver(self, conn, query, params)  # what the store raises then

    monkeypatch.setattr(Store, "_on_driver", reply_lost)
    with pytest.raises(ConnectionLost) as lost:
        broker.send(handle, "Ping", b"once")
    assert sprung == ["send_fast"]
    assert lost.value.committing
    monkeypatch.undo()
    # The message went, once: not sent again behind the caller's back
    assert _bodies(broker) == [b"once"]


def test_sends_that_returned_survive_a_crash(
    broker: Broker, private_postgres: PrivatePostgres, slow_wal_writer: None
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
