"""A task's outcome on PostgreSQL: its answer (``AsyncDone``), the end of its lease and
the end of its ``execution_log`` row in one statement (``Store.riding``), in autocommit —
and a lease lost meanwhile writes none of the three (the answer of a lost lease would
race the poison policy's own)."""

from __future__ import annotations

import json
import time

import pytest
import sqlalchemy as sa
from statement_spy import statements as _statements

from scheduler_lib.broker import Broker, LeaseLost
from scheduler_lib.scheduler import (
    Executor,
    SynchronizationTimeout,
    Task,
    TaskScheduler,
)

pytestmark = pytest.mark.postgres

QUEUE = "QueueAsyncTarget"


@pytest.fixture
def sched(pg_scheduler_broker: Broker) -> Broker:
    return pg_scheduler_broker


def lose_the_lease(url: str) -> str:
    """A task whose lease ends while it runs, as an expiry would end it (on a connection
    of its own: the executor's are the broker's)."""
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM message_leases"))
    finally:
        engine.dispose()
    return "ran"


def test_the_answer_is_one_statement_with_the_lease_and_the_row(
    sched: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = TaskScheduler(sched)
    handle = scheduler.get_scheduler()
    executor = Executor(sched, QUEUE)
    task = Task.python("builtins:len", "abc", name="t")
    scheduler.exec_async(handle, task)  # the first one: caches filled
    assert executor.run_one(timeout=5)
    assert scheduler.synchronization(handle, timeout=5).ok
    log_id = scheduler.exec_async(handle, task)
    ran = _statements(monkeypatch)
    assert executor.run_one(timeout=5)
    # The outcome: one statement in autocommit, no transaction (BEGIN, pipeline, COMMIT)
    answers = [s for s in ran if "log_finish" in s or "send" in s]
    assert answers == ["send_fast+log_finish (autocommit)"], ran
    assert not [s for s in ran if s.startswith("pipeline:")], ran
    monkeypatch.undo()
    # And all three are there: the lease ended, the row ended, the answer sent
    assert sched.leases(QUEUE) == []
    (row,) = sched.fetch("log_get", log_id=log_id)
    assert (row["status"], row["result"]) == ("SUCCEEDED", "3")
    done = scheduler.synchronization(handle, timeout=5)
    assert done.ok and done.log_id == log_id


def test_a_lost_lease_writes_no_answer(
    sched: Broker, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    scheduler = TaskScheduler(sched)
    handle = scheduler.get_scheduler()
    executor = Executor(sched, QUEUE)
    scheduler.exec_async(handle, Task.python("builtins:len", "abc", name="warm"))
    assert executor.run_one(timeout=5)
    assert scheduler.synchronization(handle, timeout=5).ok
    log_id = scheduler.exec_async(
        handle,
        Task.python(f"{__name__}:lose_the_lease", postgres_url, name="loses its lease"),
    )
    ran = _statements(monkeypatch)
    assert executor.run_one(timeout=5)
    # The one statement was tried first and wrote nothing (else nothing would follow it)
    answers = [s for s in ran if "log_finish" in s or "send" in s]
    assert answers[0] == "send_fast+log_finish (autocommit)" and len(answers) > 1, ran
    monkeypatch.undo()
    # No answer: the lease's loss is the poison policy's to answer (here nobody's)
    with pytest.raises(SynchronizationTimeout):
        scheduler.synchronization(handle, timeout=0.5)
    # The row still says how this run ended (written after, by the executor)
    (row,) = sched.fetch("log_get", log_id=log_id)
    assert (row["status"], row["result"]) == ("SUCCEEDED", json.dumps("ran"))


def test_the_statement_alone_writes_nothing_for_a_lost_lease(sched: Broker) -> None:
    """Through the front, without the executor: an answer completing a lease that is
    gone raises LeaseLost and leaves no message, no row's end and no lease's end."""
    scheduler = TaskScheduler(sched)
    handle = scheduler.get_scheduler()
    scheduler.exec_async(handle, Task.python("builtins:len", "abc", name="warm"))
    assert Executor(sched, QUEUE).run_one(timeout=5)  # caches filled: the one statement
    assert scheduler.synchronization(handle, timeout=5).ok
    log_id = scheduler.exec_async(handle, Task.python("builtins:len", "abc", name="t"))
    (lease,) = sched.take(QUEUE, timeout=5, lease=30)
    target = lease.message.conversation_handle
    sched.run(
        "log_start",
        lease_id=lease.lease_id,
        log_id=log_id,
        worker="w",
        activated_task_id=None,
        application_id=None,
        job_group=None,
        ui_url=None,
        now=time.time(),
    )
    sched.complete(lease)  # gone, as an expiry would end it
    finish = {"log_id": log_id, "status": "SUCCEEDED", "error": None, "result": "3"}
    with pytest.raises(LeaseLost):
        sched.send(
            target,
            "AsyncDone",
            json.dumps(finish),
            completing=lease,
            before=("log_finish", {"now": time.time(), "worker": "w", **finish}),
        )
    (row,) = sched.fetch("log_get", log_id=log_id)
    assert (row["status"], row["end_time"]) == ("RUNNING", None)
    with pytest.raises(SynchronizationTimeout):
        scheduler.synchronization(handle, timeout=0.5)
