"""A transaction whose statements all ran on the driver's own cursor (the hot path's
RECEIVE, SEND and take on PostgreSQL) is the driver's, not SQLAlchemy's: the session ends
it on the driver (``store.commit`` / ``store.rollback``). Its end must mean what
SQLAlchemy's did: a commit keeps what it did, a rollback gives the messages back, a commit
the server refuses is one line naming it with nothing kept, and the thread's connection is
clean for its next transaction."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from scheduler_lib.broker import AlreadyExists, Broker, ConnectionLost, DatabaseError, Transaction
from scheduler_lib.broker.db import store

pytestmark = pytest.mark.postgres


@pytest.fixture
def broker(postgres_url: str) -> Iterator[Broker]:
    b = Broker(postgres_url, timers=False)
    try:
        b.create_message_type("AsyncSent", "NONE")
        b.create_contract("AsyncContract", {"AsyncSent": "INITIATOR"})
        b.create_queue("InitiatorQueue")
        b.create_queue("TargetQueue")
        b.create_service("InitiatorService", "InitiatorQueue")
        b.create_service("TargetService", "TargetQueue", ["AsyncContract"])
        yield b
    finally:
        b.close()


def _sent(broker: Broker, *bodies: bytes) -> str:
    handle = str(broker.begin_dialog("InitiatorService", "TargetService", "AsyncContract"))
    for body in bodies:
        broker.send(handle, "AsyncSent", body)
    return handle


def test_a_receive_is_the_drivers_transaction_and_its_commit_keeps_it(broker: Broker) -> None:
    _sent(broker, b"one", b"two")
    # When a transaction receives one message and commits
    with broker.transaction() as tx:
        got = tx.receive("TargetQueue", top=1)
        conn = tx.session.connection()
        # (SQLAlchemy never saw it begin: only the driver's cursor ran)
        assert not conn.in_transaction() and store.in_transaction(conn)
    # Then it is gone for good, and the next transaction gets the next one
    assert [m.body for m in got] == [b"one"]
    with broker.transaction() as tx:
        assert [m.body for m in tx.receive("TargetQueue", top=5)] == [b"two"]


def _backend(tx: Transaction) -> int:
    """The server process of the transaction's connection."""
    return int(tx.session.connection().connection.dbapi_connection.info.backend_pid)


def _checkouts(broker: Broker) -> list[object]:
    """The pool checkouts of the transactions' engine from now on (none while a thread
    keeps its connection between its transactions)."""
    seen: list[object] = []
    sa.event.listen(broker._engine, "checkout", lambda *args: seen.append(args))
    return seen


def test_a_receive_rolled_back_on_the_driver_gives_its_message_back(broker: Broker) -> None:
    _sent(broker, b"one")
    # When the transaction that received it fails
    with pytest.raises(RuntimeError), broker.transaction() as tx:
        assert [m.body for m in tx.receive("TargetQueue", top=1)] == [b"one"]
        backend = _backend(tx)
        checkouts = _checkouts(broker)
        raise RuntimeError("the handler failed")
    # Then the message is back, and this thread's next transaction takes it on the same
    # connection: the rollback ended the driver's transaction, so the thread kept it
    # (one still in a transaction goes back to the pool, which rolls it back itself)
    with broker.transaction() as tx:
        assert [m.body for m in tx.receive("TargetQueue", top=1)] == [b"one"]
        assert _backend(tx) == backend
    assert checkouts == []  # kept: not from the pool


def _kill(broker: Broker, backend: int) -> None:
    """Terminate a server process from another connection (a restart, for one backend)."""
    with broker.transaction() as other:
        # (waiting up to 5 s for it to end: the next statement meets a dead connection)
        other.session.connection().exec_driver_sql(f"SELECT pg_terminate_backend({backend}, 5000)")


def test_a_transaction_whose_connection_was_lost_goes_no_further(broker: Broker) -> None:
    _sent(broker, b"one", b"two")
    # Given: a transaction received one message, then its server process was terminated
    with pytest.raises(ConnectionLost), broker.transaction() as tx:
        assert [m.body for m in tx.receive("TargetQueue", top=1)] == [b"one"]
        _kill(broker, _backend(tx))
        # When its next RECEIVE meets the dead connection and the caller goes on past it
        with contextlib.suppress(ConnectionLost):
            tx.receive("TargetQueue", top=1)
        # Then nothing more runs in it (not on a new connection, outside it)
        tx.receive("TargetQueue", top=1)
    # And both messages are still there, in order
    with broker.transaction() as tx:
        assert [m.body for m in tx.receive("TargetQueue", top=5)] == [b"one", b"two"]


@pytest.mark.parametrize("work", ["receive", "end_conversation", "first_send"])
def test_a_transaction_whose_connection_was_lost_does_not_commit(broker: Broker, work: str) -> None:
    # No silent success; nor may the wake-ups a commit sends for the queues its checked
    # statements wrote to (a NOTIFY before its COMMIT) run on a new connection. (EndDialog
    # goes the checked way; a conversation's first SEND is one statement that notifies
    # itself: a guard that the commit refuses it all the same.)
    handle = _sent(broker, b"one")
    fresh = str(broker.begin_dialog("InitiatorService", "TargetService", "AsyncContract"))
    arrivals = broker.arrivals("TargetQueue")
    # Given: a transaction received or wrote, then lost its connection, and its caller
    # went on past the ConnectionLost of its next statement to the end of the block
    with pytest.raises(ConnectionLost) as raised, broker.transaction() as tx:
        if work == "receive":
            assert [m.body for m in tx.receive("TargetQueue", top=1)] == [b"one"]
        elif work == "end_conversation":
            tx.end_conversation(handle)  # EndDialog to the target's queue
        else:
            tx.send(fresh, "AsyncSent", b"first")  # makes the target endpoint
        _kill(broker, _backend(tx))
        with contextlib.suppress(ConnectionLost):
            tx.receive("TargetQueue", top=1)
    # Then its commit says so, and nothing of it was kept: the message is back, alone
    assert "commit" in str(raised.value)
    if work == "receive":
        # and this process's readers waiting on its queue are woken to take it at once
        # (no NOTIFY announces a rollback; they would wait for their next poll)
        assert broker.arrivals("TargetQueue") > arrivals
    with broker.transaction() as tx:
        assert [m.body for m in tx.receive("TargetQueue", top=5)] == [b"one"]


def test_a_commit_the_server_refuses_is_one_line_and_keeps_nothing(
    broker: Broker, postgres_url: str
) -> None:
    _sent(broker, b"one")
    # Given: a table whose deferred check refuses every row at COMMIT
    with broker.transaction() as tx:
        tx.session.connection().exec_driver_sql(
            "CREATE TABLE refused_at_commit (id int);"
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS "
            "$$BEGIN RAISE EXCEPTION 'refused at commit'; END$$;"
            "CREATE CONSTRAINT TRIGGER refuse AFTER INSERT ON refused_at_commit "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse()"
        )
    # When a transaction receives the message and writes such a row on the driver's
    # cursor too (the transaction stays the driver's alone), then commits
    with pytest.raises(DatabaseError) as raised, broker.transaction() as tx:
        assert [m.body for m in tx.receive("TargetQueue", top=1)] == [b"one"]
        conn = tx.session.connection()
        conn.connection.driver_connection.execute("INSERT INTO refused_at_commit VALUES (1)")
        backend = _backend(tx)
        checkouts = _checkouts(broker)
        assert not conn.in_transaction()
    # Then the caller is told in one line what the server said, at the commit
    text = str(raised.value)
    assert text.startswith("commit:") and "refused at commit" in text
    assert "\n" not in text.strip()
    # And nothing of it was kept: the message is back, for this thread's next transaction,
    # on the same connection (the failed COMMIT ended the driver's transaction)
    with broker.transaction() as tx:
        assert _backend(tx) == backend
        assert [m.body for m in tx.receive("TargetQueue", top=1)] == [b"one"]
        assert (
            tx.session.connection()
            .exec_driver_sql("SELECT count(*) FROM refused_at_commit")
            .scalar()
            == 0
        )
    assert checkouts == []  # kept: not from the pool


REFUSED = "DO $$BEGIN RAISE EXCEPTION 'refused' USING DETAIL = 'the detail', HINT = 'a hint'; END$$"
DUPLICATE = "CREATE TEMP TABLE twice (id int PRIMARY KEY); INSERT INTO twice VALUES (1), (1)"


@pytest.mark.parametrize("sql", [REFUSED, DUPLICATE], ids=["raised", "duplicate"])
@pytest.mark.parametrize("path", ["driver", "sqlalchemy"])
def test_a_statement_the_server_refuses_is_said_in_one_line(
    broker: Broker, sql: str, path: str
) -> None:
    # PostgreSQL's errors come with DETAIL, HINT and CONTEXT lines: said as they come, a
    # command's one-line error would be several
    with pytest.raises(Exception) as raised, broker.transaction() as tx:
        conn = tx.session.connection()
        try:
            if path == "driver":  # the hot path's statements run on the driver's cursor
                conn.connection.driver_connection.execute(sql)
            else:
                conn.exec_driver_sql(sql)
        except sa.exc.IntegrityError as exc:  # as Store.execute says a constraint's
            raise store._integrity_error("the statement", exc) from exc
        except sa.exc.DBAPIError as exc:
            raise store.dbapi_error(conn, "the statement", exc) from exc
        except Exception as exc:
            raise store._driver_error(conn, "the statement", exc) from exc
    text = str(raised.value)
    assert isinstance(raised.value, DatabaseError | AlreadyExists), text
    assert text.startswith("the statement:") and "\n" not in text, text
    if sql == REFUSED:
        assert "the detail" in text and "a hint" in text
    else:  # said as AlreadyExists, on both paths
        assert isinstance(raised.value, AlreadyExists) and "Key (id)=(1)" in text
