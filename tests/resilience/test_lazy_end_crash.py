"""A target of lazy start (``Target(durable_start=False)``, for tasks whose effects are
idempotent) ends its tasks without waiting for the WAL flush: the answer's one statement
commits, and the database server crashes before that commit reached the disk. What the
docs promise (docs/scheduler.md, "Durable or lazy start"): nothing half-written, the task
runs again (the target has a retry), and the caller gets one true answer.

The crash is not timed by hope: the store is patched so that the task's answer statement
(``send_fast+log_finish``) first has what came before it flushed (a durable write of the
test's own: the take and the start, lazy too, stay on disk), then runs, then the private
server stops at once (``immediate``: what it had not written of its WAL is gone) and
starts again (crash recovery), its WAL writer slowed to 10 s (``slow_wal_writer``: at its
200 ms it often wrote the answer's commit before the stop). Whether it wrote that commit
in the moment between is the server's business: both outcomes are checked, each against the
marks the task left outside the database.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from marking_tasks import marks
from private_postgres import PrivatePostgres

from scheduler_lib.broker import Broker
from scheduler_lib.broker.db.store import Store
from scheduler_lib.scheduler import (
    Executor,
    SynchronizationTimeout,
    Target,
    Task,
    TaskScheduler,
    init,
)

pytestmark = pytest.mark.postgres

QUEUE = "QueueAsyncTarget"
LEASE = 2.0  # the executor's lease: a lost end's lease expires this soon
WAIT = 60.0  # seconds any wait may take before the test fails


@pytest.fixture
def caller(private_db_url: str) -> Iterator[Broker]:
    broker = Broker(private_db_url)
    try:
        # lazy, and one retry: a lost end is a worker that stopped without an answer
        init(broker, targets=[Target(activation=False, durable_start=False, retries=1)])
        yield broker
    finally:
        broker.close()


@pytest.fixture
def worker(private_db_url: str, caller: Broker) -> Iterator[Broker]:
    broker = Broker(private_db_url)  # the executor's: another process's pools and caches
    try:
        yield broker
    finally:
        broker.close()


def _flush(url: str) -> None:
    """A durable commit of a write of our own: the WAL before it reaches the disk."""
    with psycopg.connect(
        sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False),
        autocommit=True,
    ) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS flushed (at float8)")
        conn.execute("INSERT INTO flushed VALUES (%s)", (time.time(),))


def test_a_crash_right_after_a_lazy_end_runs_the_task_again_and_tells_the_truth(
    caller: Broker,
    worker: Broker,
    private_postgres: PrivatePostgres,
    private_db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    slow_wal_writer: None,
) -> None:
    marks_file = str(tmp_path / "marks")
    scheduler = TaskScheduler(caller)
    handle = scheduler.get_scheduler()
    executor = Executor(worker, QUEUE, lease=LEASE, idle_timeout=WAIT)
    # Given one task has gone round (caches filled: the answer is the one statement)
    warm = Task.python("marking_tasks:mark", marks_file, "warm", 0.05, name="warm")
    warm_id = scheduler.exec_async(handle, warm)
    assert executor.run_one(timeout=WAIT)
    assert scheduler.synchronization(handle, timeout=WAIT).log_id == warm_id

    crashed, restarted = threading.Event(), threading.Event()
    on_driver = Store._on_driver

    def crashing(self: Store, conn: Any, query: str, params: Mapping[str, Any]) -> Any:
        if not query.startswith("send_fast+log_finish") or crashed.is_set():
            return on_driver(self, conn, query, params)
        _flush(private_db_url)
        result = on_driver(self, conn, query, params)  # committed, not waited for
        crashed.set()
        private_postgres.restart("immediate")
        restarted.set()
        return result

    monkeypatch.setattr(Store, "_on_driver", crashing)
    stop = threading.Event()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            while not stop.is_set():
                executor.run_one(timeout=0.5)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    try:
        # When the server crashes right after the task's lazy end committed
        task = Task.python("marking_tasks:mark", marks_file, "t", 0.2, name="t")
        log_id = scheduler.exec_async(handle, task)
        thread.start()
        # (the caller waits only once the server is back: its RECEIVE's durable commit
        # would flush the answer before the crash)
        assert restarted.wait(WAIT), "the answer's statement never ran"
        # Then the caller gets one answer, SUCCEEDED (the end survived, or the lease
        # expired and the task ran again)
        done = scheduler.synchronization(handle, timeout=WAIT)
        assert (done.log_id, done.status) == (log_id, "SUCCEEDED"), done
        with pytest.raises(SynchronizationTimeout):
            scheduler.synchronization(handle, timeout=LEASE * 2)
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(WAIT)
    assert not errors, errors
    # And the row says what the marks say: as many attempts as runs, each run whole
    starts, ends = marks(marks_file)
    runs = starts["t"]
    assert runs in (1, 2) and ends["t"] == runs, (starts, ends)
    (row,) = caller.fetch("log_get", log_id=log_id)
    assert (row["status"], row["attempts"], row["end_time"] is not None) == (
        "SUCCEEDED",
        runs,
        True,
    ), dict(row)
    # And nothing is left held
    assert caller.leases() == []
