"""A PostgreSQL connection lost under the broker (a server restart, a failover, an idle
connection killed) is a DatabaseError for the call that meets it — not the caller's
fault, try again — the pool replaces it, and a task is never failed for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import sqlalchemy as sa

from scheduler_lib.broker import Broker, DatabaseError
from scheduler_lib.scheduler import Executor, Target, Task, TaskScheduler, init

pytestmark = pytest.mark.postgres
T = TypeVar("T")


def _kill_our_backends(url: str) -> int:
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            return int(
                conn.exec_driver_sql(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                ).scalar_one()
            )
    finally:
        engine.dispose()


def _retried(call: Callable[[], T], errors: list[DatabaseError]) -> T:
    """``call`` until it works; each dead pooled connection fails one call."""
    for _ in range(30):
        try:
            return call()
        except DatabaseError as exc:
            errors.append(exc)
    raise AssertionError(f"still failing after 30 calls: {errors[-1]}")


def test_a_lost_connection_is_a_database_error_and_then_replaced(postgres_url: str) -> None:
    broker = Broker(postgres_url, timers=False)
    try:
        init(broker, targets=[Target(activation=False)])
        scheduler = TaskScheduler(broker)
        handle = scheduler.get_scheduler()
        assert broker.fetch("log_get", log_id=0) == []
        # Given the broker's pooled connections killed on the server
        assert _kill_our_backends(postgres_url) >= 1
        # When it goes on, Then the calls that meet a dead connection say so, as a
        # DatabaseError, and later calls work on new connections
        errors: list[DatabaseError] = []
        log_id = _retried(
            lambda: scheduler.exec_async(handle, Task.python("builtins:abs", -3)), errors
        )
        assert errors and all("connection was lost" in str(e) for e in errors)
        # And an executor meeting a lost connection fails its call, never the task
        _kill_our_backends(postgres_url)
        executor = Executor(broker, "QueueAsyncTarget", idle_timeout=1)
        errors.clear()
        _retried(lambda: executor.run_one(timeout=0), errors)
        (row,) = _retried(lambda: broker.fetch("log_get", log_id=log_id), errors)
        assert row["status"] != "FAILED", row["error"]
    finally:
        broker.close()
