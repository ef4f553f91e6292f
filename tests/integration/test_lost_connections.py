"""A PostgreSQL connection lost under the broker (a server restart, a failover, an idle
connection killed) is ridden through: a pooled connection the server closed is replaced
when it is taken, a call that meets a dead connection runs again on a fresh one, and a
task is never failed for it."""

from __future__ import annotations

import itertools
import logging
import threading
import time

import pytest
import sqlalchemy as sa
from multiproc import poll
from serving import Serving, init_by_hand, runs_a_task

from scheduler_lib.broker import Broker, ConnectionLost
from scheduler_lib.scheduler import Executor, Target, Task, TaskScheduler, init

pytestmark = pytest.mark.postgres


def _kill_our_backends(url: str) -> int:
    """Terminate every other backend of the database, and wait until they are gone (so
    that each has said goodbye on its socket)."""
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            # (the call in the select list: it runs for the rows the WHERE kept only)
            killed = [
                int(pid)
                for pid, terminated in conn.exec_driver_sql(
                    "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
                if terminated
            ]

            def gone() -> bool:
                left = conn.exec_driver_sql(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%(pids)s)",
                    {"pids": killed},
                ).scalar_one()
                return left == 0

            poll(gone, 30, "the terminated backends to exit")
            return len(killed)
    finally:
        engine.dispose()


def test_a_lost_connection_is_ridden_through_and_replaced(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    broker = Broker(postgres_url, timers=False)
    try:
        init(broker, targets=[Target(activation=False)])
        scheduler = TaskScheduler(broker)
        handle = scheduler.get_scheduler()
        assert broker.fetch("log_get", log_id=0) == []
        # Given the broker's pooled connections killed on the server
        assert _kill_our_backends(postgres_url) >= 1
        # When it goes on, Then the calls work, and none met a dead connection: each
        # closed one was replaced when the pool handed it out (else the one-statement
        # send, which commits as it runs, could not tell whether it went)
        with caplog.at_level(logging.WARNING, logger="scheduler_lib.broker.db.connections"):
            log_id = scheduler.exec_async(handle, Task.python("builtins:abs", -3))
        assert not [r for r in caplog.records if "connection was lost" in r.getMessage()]
        assert broker.availability.available
        # And an executor meeting lost connections runs the task, never fails it
        _kill_our_backends(postgres_url)
        executor = Executor(broker, "QueueAsyncTarget", idle_timeout=1)
        assert executor.run_one(timeout=5)
        (row,) = broker.fetch("log_get", log_id=log_id)
        assert (row["status"], row["attempts"], row["result"]) == ("SUCCEEDED", 1, "3")
        completion = scheduler.synchronization(handle, timeout=5)
        assert (completion.log_id, completion.status) == (log_id, "SUCCEEDED")
    finally:
        broker.close()


def test_a_savepoint_on_a_lost_connection_is_a_lost_connection(postgres_url: str) -> None:
    # END CONVERSATION and poison routing take savepoints, and an executor's loop rides
    # through a ConnectionLost only: CI once saw SQLAlchemy's own error for a savepoint on
    # a terminated backend end an executor (test_terminated_backends)
    broker = Broker(postgres_url, timers=False)
    try:
        # Given a transaction whose connection the server terminated, When it takes a
        # savepoint, Then that is a lost connection
        with pytest.raises(ConnectionLost), broker.transaction() as tx:
            tx.fetch_value("next_deadline")
            assert _kill_our_backends(postgres_url) >= 1
            with tx.savepoint():
                pass
        # And so is a loss inside the savepoint, whose undo fails too
        with pytest.raises(ConnectionLost), broker.transaction() as tx, tx.savepoint():
            tx.fetch_value("next_deadline")
            assert _kill_our_backends(postgres_url) >= 1
            tx.fetch_value("next_deadline")
        # And a statement SQLAlchemy ran itself, past the broker's one door
        with pytest.raises(ConnectionLost), broker.transaction() as tx:
            tx.fetch_value("next_deadline")
            assert _kill_our_backends(postgres_url) >= 1
            tx.session.connection().exec_driver_sql("SELECT 1")
        # And the broker goes on on fresh connections
        with broker.transaction() as tx:
            tx.fetch_value("next_deadline")
    finally:
        broker.close()


def test_a_reader_whose_database_is_gone_tries_again_slower_and_slower(
    postgres_server: str, postgres_url: str
) -> None:
    broker = Broker(postgres_url, timers=False)
    init(broker, targets=[Target(activation=False)])
    executor = Executor(broker, "QueueAsyncTarget", idle_timeout=600)
    looks: list[float] = []
    run_one = executor.run_one

    def looking(timeout: float | None = 0) -> bool:
        looks.append(time.monotonic())
        return run_one(timeout)

    executor.run_one = looking  # type: ignore[method-assign]
    stop = threading.Event()
    serving = threading.Thread(target=executor.serve, args=(stop,), daemon=True)
    try:
        # Given the database dropped under a reader: every look fails at once (a
        # connection refused, "does not exist": nothing to wait out)
        admin = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
        name = sa.make_url(postgres_url).database
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE "{name}" WITH (FORCE)')
        admin.dispose()
        serving.start()
        # When it keeps looking, Then it pauses between the failed looks, longer each
        # time (0.05 s, doubled, up to a second): not hundreds of looks a second
        poll(lambda: len(looks) >= 6, 60, "six looks")
        gaps = [b - a for a, b in itertools.pairwise(looks[:6])]
        assert all(gap >= 0.9 * 0.05 * 2**i for i, gap in enumerate(gaps)), gaps
        # And a stop ends it at once, not after its pause
        stop.set()
        serving.join(10)
        assert not serving.is_alive()
    finally:
        stop.set()
        broker.close()


def test_serve_says_once_that_its_database_is_gone_and_serves_it_again_once_back(
    postgres_server: str, postgres_url: str
) -> None:
    """The documented ``scheduler-lib serve --db URL`` in its own process, with default
    settings, when its database is dropped under it and restored."""
    broker = Broker(postgres_url, timers=False)
    init(broker)
    broker.close()
    admin = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    name = sa.make_url(postgres_url).database
    # A copy to restore it from in one statement (an empty database without the schema
    # in between is another state: the next test's)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}_copy" TEMPLATE "{name}"')
    serve = Serving(postgres_url)
    try:
        # Given its database dropped under it: every connection is refused for good
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE "{name}" WITH (FORCE)')
        # Then it says so, naming the cause (first, maybe, a connection lost to the DROP)
        poll(
            serve.said("unavailable", "does not exist"),
            30,
            "serve to say that its database is unavailable",
            explain=lambda: serve.tail(20),
        )
        # And it says nothing more while its loops keep failing
        serve.says_little()
        # When the database is restored, Then it serves it: a task runs
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}" TEMPLATE "{name}_copy"')
        runs_a_task(postgres_url)
        poll(serve.said("is back"), 30, "serve to say it is back")
        back = len(serve.lines)
        # And a SIGTERM while its database is gone again stops it as usual, without a
        # traceback either (it unregisters its waiters on the way out)
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE "{name}" WITH (FORCE)')
        poll(
            serve.said("unavailable", since=back),
            30,
            "serve to say again that its database is unavailable",
            explain=lambda: serve.tail(20),
        )
        assert serve.stop() == 0, serve.tail(20)
        assert not serve.tracebacks(), serve.tail(len(serve.lines))
    finally:
        serve.close()
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}_copy"')
        admin.dispose()


def test_serve_says_once_that_its_database_is_empty_and_serves_it_once_initialized(
    postgres_server: str, postgres_url: str
) -> None:
    """The documented ``scheduler-lib serve --db URL`` when its database is dropped and
    created again empty under it (as ``dropdb``, ``createdb`` and a ``pg_restore`` to come
    do): its tables are gone, not its connections."""
    broker = Broker(postgres_url, timers=False)
    init(broker)  # the scheduler's queues: serve has readers on them
    broker.close()
    admin = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    name = sa.make_url(postgres_url).database
    serve = Serving(postgres_url)
    try:
        runs_a_task(postgres_url)
        # Given its database dropped and created again, empty
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE "{name}" WITH (FORCE)')
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        # Then it says in one line that the schema is missing and how to make it
        poll(
            serve.said("unavailable", "schema is missing", "scheduler-lib init"),
            30,
            "serve to say that its database has no schema",
            explain=lambda: serve.tail(20),
        )
        # And nothing more while its loops keep failing (before: 600 lines in 8 s, a
        # traceback of "relation ... does not exist" per loop per turn)
        serve.says_little()
        # When the user creates the schema as that line says, in a process of their own
        init_by_hand(postgres_url)
        # Then it serves it again: a task runs, and it says it is back
        runs_a_task(postgres_url)
        poll(serve.said("is back"), 30, "serve to say it is back")
        serve.stops_cleanly()
    finally:
        serve.close()
        admin.dispose()
