"""The worker's look for cancel requests: a running task asked to stop is told within
``CANCEL_POLL``; a task never wakes the watcher, so a short one that ends between two
looks costs none (an isolated short task paid a query beside its own statements, and a
thread switch, when its start woke the watcher to look at once)."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa
from multiproc import poll

from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import Task, TaskScheduler
from scheduler_lib.scheduler import executor as executor_module
from scheduler_lib.scheduler.executor import CancelWatcher
from scheduler_lib.scheduler.kinds import TaskContext

POLL = 0.3  # the watcher's interval here (seconds)


def _context(log_id: int) -> TaskContext:
    return TaskContext(log_id, Task.python("builtins:len", "ab"), "", lambda *_: None)


def test_a_short_task_costs_no_look_and_a_running_one_is_told(
    sched: Broker, scheduler: TaskScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(executor_module, "CANCEL_POLL", POLL)
    handle = scheduler.get_scheduler()
    short, long = (scheduler.exec_async(handle, Task.python("builtins:len", "ab")) for _ in "ab")
    # Given the second task running and asked to stop (as fail fast asks)
    engine = sa.create_engine(sched.url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE execution_log SET status = 'RUNNING', start_time = :now, "
                    "cancel_requested_at = :now, cancel_reason = 'told to stop' "
                    "WHERE log_id = :log_id"
                ),
                {"now": time.time(), "log_id": long},
            )
    finally:
        engine.dispose()
    looks: list[float] = []
    fetch = sched.fetch

    def counted(query: str, /, **params: object) -> list:
        if query == "log_cancel_requests":
            looks.append(time.monotonic())
        return fetch(query, **params)

    monkeypatch.setattr(sched, "fetch", counted)
    watcher = CancelWatcher(sched)
    # When a short task runs and ends, and then the long one runs
    with watcher.watching(_context(short)):
        pass
    context = _context(long)
    started = time.monotonic()
    with watcher.watching(context):
        # Then the long one is told, within a few polls
        poll(context.cancelled.is_set, 10 * POLL + 5, "the running task is told to stop")
        told = time.monotonic()
    assert context.cancel_reason == "told to stop"
    # ... by the first look, which came after the short task (it cost none) and no sooner
    # than a poll after the long one started
    assert len(looks) == 1, looks
    assert looks[0] - started >= POLL * 0.9 and told >= looks[0]
