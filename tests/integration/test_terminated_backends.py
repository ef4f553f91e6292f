"""Backends terminated again and again under a running scheduler (the cheap cousin of the
private-server restart tests, on the shared server: only this test's own database's
sessions are terminated). Waves of tasks run with two in-process executors while a killer
thread runs ``pg_terminate_backend`` on every backend of the test database every 100-300
ms: the waves end ok, every task ran exactly once (by the marks it left outside the
database), every row is SUCCEEDED with one attempt, none is left RUNNING, no lease is
left.

A failure prints its seed; ``TERMINATE_SEED=N`` replays the killer's schedule.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

# The marking task the resilience tests use (tasks leave marks outside the database).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "resilience"))
import marking_tasks

from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import Executor, Target, Task, TaskScheduler, init

pytestmark = pytest.mark.postgres

WAVES, TASKS, TASK_SECONDS = 10, 4, 0.2
EXECUTORS = 2
KILL_EVERY = (0.1, 0.3)  # seconds between two rounds of terminations
MAX_ROUNDS = 150  # bounds the killer whatever happens
RUN_TIMEOUT = 60.0  # seconds run_waves may wait for any one completion
QUEUE = "QueueAsyncTarget"


class Killer(threading.Thread):
    """Terminates every backend of ``database`` at seeded random intervals, from a
    session on the admin database, until told to stop (or MAX_ROUNDS)."""

    def __init__(self, admin_url: str, database: str, seed: int) -> None:
        super().__init__(daemon=True)
        self.engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
        self.database, self.random = database, random.Random(seed)
        self.done = threading.Event()
        self.rounds, self.terminated = 0, 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.engine.connect() as conn:
                # The interval is the schedule, not a hope that something happened
                while self.rounds < MAX_ROUNDS and not self.done.wait(
                    self.random.uniform(*KILL_EVERY)
                ):
                    self.terminated += int(
                        conn.exec_driver_sql(
                            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) "
                            "FROM pg_stat_activity WHERE datname = %(db)s "
                            "AND pid <> pg_backend_pid()",
                            {"db": self.database},
                        ).scalar_one()
                    )
                    self.rounds += 1
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.engine.dispose()

    def stop(self) -> None:
        self.done.set()
        self.join(30)


@pytest.fixture
def brokers(postgres_url: str) -> Iterator[tuple[Broker, Broker]]:
    """The caller's broker and the executors' broker (two processes' worth of pools)."""
    caller = Broker(postgres_url)
    worker = Broker(postgres_url)
    try:
        init(caller, targets=[Target(activation=False)])  # retries=0: a lost task FAILS
        yield caller, worker
    finally:
        worker.close()
        caller.close()


def test_waves_run_once_each_while_backends_are_terminated(
    brokers: tuple[Broker, Broker], postgres_server: str, postgres_url: str, tmp_path: Path
) -> None:
    caller, worker = brokers
    seed = int(os.environ.get("TERMINATE_SEED", random.randrange(1_000_000)))
    print(f"TERMINATE_SEED={seed}")
    marks_file = tmp_path / "marks"
    names = [[f"w{w}t{t}" for t in range(TASKS)] for w in range(WAVES)]
    waves = [
        [Task.python("marking_tasks:mark", str(marks_file), n, TASK_SECONDS, name=n) for n in wave]
        for wave in names
    ]
    stop = threading.Event()
    errors: list[BaseException] = []

    def serve(executor: Executor) -> None:
        try:
            executor.serve(stop)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    executors = [
        threading.Thread(
            target=serve, args=(Executor(worker, QUEUE, idle_timeout=120),), daemon=True
        )
        for _ in range(EXECUTORS)
    ]
    for thread in executors:
        thread.start()
    # Given a killer terminating every session of the test database every 100-300 ms
    killer = Killer(postgres_server, sa.make_url(postgres_url).database or "", seed)
    killer.start()
    started = time.monotonic()
    try:
        # When the waves run under it
        report = TaskScheduler(caller).run_waves(waves, timeout=RUN_TIMEOUT)
    finally:
        killer.stop()
        stop.set()
        for thread in executors:
            thread.join(30)
        # An executor's loop ended by an error is said first, even when the waves failed
        # for want of it (its task's lease expired): with where it was raised, as an
        # escaped driver error names no caller by itself
        assert errors == [], "".join(traceback.format_exception(errors[0])) + f"seed {seed}"
    took = time.monotonic() - started
    context = f"seed {seed}, {killer.rounds} rounds, {killer.terminated} sessions terminated"
    print(f"{context}, {took:.1f} s")
    assert killer.error is None, f"{killer.error!r} ({context})"
    assert not any(t.is_alive() for t in executors), f"an executor did not stop ({context})"
    # (the killer did its work while the waves ran)
    assert killer.rounds >= 5 and killer.terminated >= 5, context
    # Then the waves ended ok, one SUCCEEDED completion per task
    assert report.ok, (report.failures, context)
    everyone = sorted(n for wave in names for n in wave)
    assert sorted(c.task_name or "" for c in report.completions) == everyone, context
    # And each task ran exactly once, by the marks it left outside the database
    starts, ends = marking_tasks.marks(marks_file)
    once = Counter(everyone)
    assert (starts, ends) == (once, once), context
    # And execution_log agrees: SUCCEEDED, one attempt, ended; nothing RUNNING; no lease
    rows = caller.fetch("log_of_scheduler", handle=str(report.scheduler_handle))
    got = sorted(
        (r["task_name"], r["status"], r["attempts"], r["end_time"] is not None) for r in rows
    )
    assert got == [(n, "SUCCEEDED", 1, True) for n in everyone], context
    assert caller.leases() == [], context


def test_a_checkout_that_meets_only_closed_connections_is_ridden_through(
    postgres_server: str, postgres_url: str
) -> None:
    """The pool throws away a pooled connection the server closed and connects anew, and
    gives up when the new ones are closed too (SQLAlchemy's ``InvalidRequestError: This
    connection is closed``, after two tries): in a storm of terminations that escaped as
    a traceback and ended an executor's loop. It is a lost connection, ridden through."""
    broker = Broker(postgres_url)
    admin = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    database = sa.make_url(postgres_url).database
    killed: list[int] = []

    def closed_at_birth(dbapi_connection: object, _record: object) -> None:
        # The next three connections end as they begin, as under the killer's storm
        if len(killed) < 3:
            killed.append(1)
            with contextlib.suppress(Exception):
                dbapi_connection.execute("SELECT pg_terminate_backend(pg_backend_pid())")  # type: ignore[attr-defined]

    try:
        init(broker, targets=[Target(activation=False)])
        assert broker.queue(QUEUE).is_receive_enabled  # the pool now holds a connection
        # Given every pooled connection closed by the server while idle
        with admin.connect() as conn:
            conn.exec_driver_sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %(db)s AND pid <> pg_backend_pid()",
                {"db": database},
            )
            deadline = time.monotonic() + 30
            while conn.exec_driver_sql(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %(db)s",
                {"db": database},
            ).scalar_one():
                assert time.monotonic() < deadline, "the terminated sessions did not end"
                time.sleep(0.05)
        # And the new connections closed as they open
        sa.event.listen(sa.pool.Pool, "connect", closed_at_birth)
        try:
            # When the broker is asked something, it answers once a connection holds
            assert broker.queue(QUEUE).is_receive_enabled
        finally:
            sa.event.remove(sa.pool.Pool, "connect", closed_at_birth)
        # (the storm happened: the checkout met closed connections)
        assert len(killed) == 3
    finally:
        broker.close()
        admin.dispose()
