"""A thread's single-statement operations (autocommit) keep one connection between them
instead of a pool's checkout and checkin each (``connections.Kept``): the pool is never
drained by threads keeping theirs, a thread that ends and a broker that closes give theirs
back, and a kept connection is as safe as a pooled one (a lost one is thrown away before
it is used: see test_lost_connections.py, which meets a kept one on the main thread)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from scheduler_lib.broker import Broker
from scheduler_lib.broker.db import connections
from scheduler_lib.broker.db import engine as engines

pytestmark = pytest.mark.postgres

TIMEOUT = 30  # seconds a thread of these tests may take for one SEND


@pytest.fixture
def catalogued(postgres_url: str) -> Iterator[Broker]:
    """A broker on PostgreSQL (the one with an autocommit lane) with a contract to send on."""
    # (a drained pool fails a checkout in seconds, not the default half minute)
    broker = Broker(postgres_url, timers=False, engine_options={"pool_timeout": 3})
    try:
        broker.create_message_type("AsyncSent", "NONE")
        broker.create_contract("AsyncContract", {"AsyncSent": "INITIATOR"})
        broker.create_queue("InitiatorQueue")
        broker.create_queue("TargetQueue")
        broker.create_service("InitiatorService", "InitiatorQueue")
        broker.create_service("TargetService", "TargetQueue", ["AsyncContract"])
        yield broker
    finally:
        broker.close()


def _pool(broker: Broker) -> sa.pool.QueuePool:
    engine = broker._autocommit_engine  # the single statements' engine
    assert engine is not None
    pool = engine.pool
    assert isinstance(pool, sa.pool.QueuePool)
    return pool


def _dialog(broker: Broker) -> str:
    return str(broker.begin_dialog("InitiatorService", "TargetService", "AsyncContract"))


def _drained(broker: Broker, n: int) -> list[bytes]:
    with broker.transaction() as tx:
        got = tx.receive("TargetQueue", top=n + 1)
    return sorted(m.body or b"" for m in got)


def _run_threads(n: int, target: object, *, together: bool) -> None:
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]  # type: ignore[arg-type]
    for t in threads:
        t.start()
        if not together:
            t.join(TIMEOUT)
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()


def test_a_thread_keeps_one_connection_for_its_sends(catalogued: Broker) -> None:
    broker = catalogued
    handle = _dialog(broker)
    pool = _pool(broker)
    for i in range(20):
        broker.send(handle, "AsyncSent", f"{i:02}".encode())
    # One connection made and kept: no checkin between the sends
    assert (pool.checkedout(), pool.checkedin()) == (1, 0)
    assert _drained(broker, 20) == [f"{i:02}".encode() for i in range(20)]
    broker.close()
    assert pool.checkedout() == 0


def test_threads_that_end_give_their_connection_back(catalogued: Broker) -> None:
    broker = catalogued
    handle = _dialog(broker)
    pool = _pool(broker)
    pool_capacity = engines.POOL_SIZE * 2  # its size and its overflow

    def one_send(i: int) -> None:
        broker.send(handle, "AsyncSent", f"{i:02}".encode())

    # More threads than the pool has connections, one after another: a connection kept
    # by a thread that ended and not given back would drain the pool (the next checkout
    # would wait for its timeout)
    _run_threads(pool_capacity + 10, one_send, together=False)
    assert pool.checkedout() == 0
    assert _drained(broker, 30) == [f"{i:02}".encode() for i in range(pool_capacity + 10)]


def test_threads_keep_at_most_their_share_of_the_pool(catalogued: Broker) -> None:
    broker = catalogued
    handle = _dialog(broker)
    pool = _pool(broker)
    for first in (b"first", b"second"):  # (a first SEND is a transaction, then autocommit)
        broker.send(handle, "AsyncSent", first)
    threads = 12
    sent = threading.Barrier(threads + 1, timeout=TIMEOUT)
    done = threading.Barrier(threads + 1, timeout=TIMEOUT)
    seen: list[int] = []

    def send_and_wait(i: int) -> None:
        broker.send(handle, "AsyncSent", f"{i:02}".encode())
        sent.wait()
        done.wait()

    runner = threading.Thread(
        target=_run_threads, args=(threads, send_and_wait), kwargs={"together": True}
    )
    runner.start()
    sent.wait()  # every thread has sent and lives on
    seen.append(pool.checkedout())
    done.wait()
    runner.join(TIMEOUT)
    # The kept ones (this thread's among them) hold half the pool at most; the rest went
    # back after each SEND, and the threads' kept ones when they ended
    assert seen == [int(engines.POOL_SIZE * connections.KEPT_SHARE)]
    assert pool.checkedout() == 1
    assert len(_drained(broker, threads + 2)) == threads + 2


def test_a_kept_connection_is_not_used_after_its_generation_was_thrown_away(
    catalogued: Broker,
) -> None:
    broker = catalogued
    engine = broker._autocommit_engine
    assert engine is not None
    kept = connections.Kept()
    try:
        first, keeping = kept.take(engine)
        assert keeping is not None
        # A transaction inside another on the same thread: the pool's, not the kept one
        inner, not_kept = kept.take(engine)
        assert inner is not first and not_kept is None
        kept.give_back(inner, not_kept)
        kept.give_back(first, keeping)
        assert kept.take(engine) == (first, keeping)
        kept.give_back(first, keeping)
        # A lost connection elsewhere threw the pool's connections away: so is this one
        connections.discard_pool(engine)
        again, keeping = kept.take(engine)
        assert again is not first and first.closed
        kept.give_back(again, keeping)
    finally:
        kept.close()
    assert _pool(broker).checkedout() == 0


def test_a_pool_too_small_to_share_keeps_nothing(postgres_url: str) -> None:
    # A pool of one: half of it rounds down to none (kept, it would be pinned by the
    # first thread, and every other would wait for the pool's timeout)
    engine = sa.create_engine(postgres_url, pool_size=1, max_overflow=0, pool_timeout=3)
    kept = connections.Kept()
    try:
        conn, keeping = kept.take(engine)
        assert keeping is None
        kept.give_back(conn, keeping)
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        kept.close()
        engine.dispose()


def test_a_transaction_dropped_without_an_end_does_not_stay_open(catalogued: Broker) -> None:
    broker = catalogued
    handle = _dialog(broker)
    pool = broker._engine.pool  # transactions' engine
    with broker.transaction() as tx:  # this thread keeps its connection from here
        tx.send(handle, "AsyncSent", b"kept")
    assert pool.checkedout() == 1
    # Given a transaction that sent, then was dropped: no commit, no rollback
    dropped = broker.transaction()
    dropped.send(handle, "AsyncSent", b"never")
    del dropped
    gc.collect()
    # Then its connection was not kept in its transaction (which would hold the
    # conversation's row lock for as long as the thread lives): the pool's again
    assert pool.checkedout() == 0
    with broker.transaction() as tx:  # the endpoint's row is free: no wait
        tx.send(handle, "AsyncSent", b"after")
    assert _drained(broker, 3) == [b"after", b"kept"]


def test_a_connection_is_kept_only_when_its_transaction_is_over() -> None:
    """The driver's word decides, not SQLAlchemy's alone (a unit test of the check)."""

    class Info:
        transaction_status = connections.IDLE

    class Fairy:
        dbapi_connection = type("Driver", (), {"info": Info()})()

    class Conn:
        connection = Fairy()

        def in_transaction(self) -> bool:
            return False

    assert connections._idle(Conn())  # type: ignore[arg-type]
    Info.transaction_status = 2  # INTRANS
    assert not connections._idle(Conn())  # type: ignore[arg-type]


def test_a_statement_is_prepared_at_its_second_execution(catalogued: Broker) -> None:
    """The broker's statements run prepared from their second execution on a connection
    (``engine.PREPARE_THRESHOLD``), not from psycopg's sixth: the costly ones are not parsed
    and planned anew while a new connection (every reader has its own) warms up; a script
    of several statements still runs (it cannot be prepared)."""
    broker = catalogued
    handle = _dialog(broker)
    with broker.transaction() as tx:
        driver = tx.session.connection().connection.driver_connection
        assert driver is not None
        tx.send(handle, "AsyncSent", b"one")
        tx.send(handle, "AsyncSent", b"two")
        for _ in range(2):
            driver.execute("SELECT 1; SELECT 2")
        prepared = [
            row[0]
            for row in driver.execute("SELECT statement FROM pg_prepared_statements").fetchall()
        ]
    assert any("INSERT INTO queue_messages" in text for text in prepared), prepared
    assert _drained(broker, 2) == [b"one", b"two"]


def test_the_sql_tasks_database_keeps_psycopgs_threshold(postgres_url: str) -> None:
    """The ``sql`` tasks' statements are the user's: their engine keeps psycopg's default
    (a pooler in transaction mode, a table whose columns change between runs)."""
    from scheduler_lib.scheduler import kinds

    with kinds._sql_engine(postgres_url).connect() as conn:
        driver = conn.connection.driver_connection
        assert driver is not None
        assert driver.prepare_threshold == 5  # psycopg's default
