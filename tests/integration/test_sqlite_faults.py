"""SQLite's faults that stop a run — the file locked by another process for long, a full
disk — are one clear error naming the file and the way out, and nothing of the
transaction that met them is written."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from scheduler_lib.broker import Broker, DatabaseError
from scheduler_lib.broker.db import engine as engines
from scheduler_lib.scheduler import Target, Task, TaskScheduler, init


@pytest.fixture
def sqlite_broker(sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Broker]:
    # A busy timeout of 1 s instead of 60, so that "locked for long" comes quickly.
    monkeypatch.setattr(engines, "SQLITE_BUSY_TIMEOUT", 1)
    broker = Broker(sqlite_url, timers=False)
    try:
        init(broker, targets=[Target(activation=False)])
        yield broker
    finally:
        broker.close()


def test_a_file_locked_past_the_busy_timeout_is_one_clear_error(
    sqlite_broker: Broker, sqlite_url: str
) -> None:
    scheduler = TaskScheduler(sqlite_broker)
    handle = scheduler.get_scheduler()
    path = sa.make_url(sqlite_url).database
    assert path is not None
    # Given another process holds the file's write lock
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        # When a wave is sent, Then it fails with one line naming the file and what to do
        with pytest.raises(DatabaseError) as caught:
            scheduler.exec_many(handle, [Task.python("builtins:abs", i) for i in range(3)])
        text = str(caught.value)
        assert path in text and "stayed locked" in text and "hint:" in text
        assert "\n" not in text
    finally:
        other.execute("ROLLBACK")
        other.close()
    # And nothing of the wave was written: no row, no message
    assert scheduler.log(handle) == []
    assert sqlite_broker.receive("QueueAsyncTarget", timeout=0) == []


def test_a_full_disk_is_one_clear_error_and_nothing_half_written(sqlite_broker: Broker) -> None:
    scheduler = TaskScheduler(sqlite_broker)
    handle = scheduler.get_scheduler()
    small = scheduler.exec_async(handle, Task.python("builtins:abs", 1))

    # Given the database cannot grow (a full disk, as SQLite sees it: SQLITE_FULL)
    def cap(dbapi_connection: Any, _record: Any) -> None:
        pages = dbapi_connection.execute("PRAGMA page_count").fetchone()[0]
        dbapi_connection.execute(f"PRAGMA max_page_count={pages + 2}")

    sa.event.listen(sqlite_broker._engine, "connect", cap)
    sqlite_broker._engine.dispose()
    # When a wave too large for what is left is sent
    big = "x" * 200_000
    with pytest.raises(DatabaseError) as caught:
        scheduler.exec_many(handle, [Task.python("builtins:len", big) for _ in range(3)])
    # Then the error says the file could not be written, and how to fix it
    text = str(caught.value)
    assert "could not be written" in text and "free space" in text
    # And nothing of that wave was written: the one task before it is all there is
    sa.event.remove(sqlite_broker._engine, "connect", cap)
    sqlite_broker._engine.dispose()
    assert [r["log_id"] for r in scheduler.log(handle)] == [small]
    messages = sqlite_broker.receive("QueueAsyncTarget", top=10, timeout=0)
    assert len(messages) == 1
