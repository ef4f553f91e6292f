"""More bad input (issue 21, section 4): out-of-range integers, JSON nested without
bound, and tasks that leave by ``sys.exit()`` or ``KeyboardInterrupt``. Each bad call
raises one exception naming the field and writes nothing; on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from scheduler_lib.broker import Broker, InvalidArgument, InvalidMessageBody
from scheduler_lib.broker.validation import MAX_JSON_DEPTH
from scheduler_lib.scheduler import (
    Executor,
    InvalidTask,
    Semaphores,
    Target,
    Task,
    TaskScheduler,
    init,
)
from scheduler_lib.scheduler.kinds import MAX_TASK_DEPTH

TABLES = ("execution_log", "queue_messages", "queues", "semaphores")


@pytest.fixture
def scheduler(broker: Broker) -> Iterator[TaskScheduler]:
    init(broker, targets=[Target(activation=False)])
    yield TaskScheduler(broker)


def counts(db_url: str) -> dict[str, int]:
    engine = sa.create_engine(db_url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            return {
                t: int(conn.exec_driver_sql(f"SELECT count(*) FROM {t}").scalar_one())
                for t in TABLES
            }
    finally:
        engine.dispose()


def refused(db_url: str, call: Callable[[], Any], error: type[Exception], says: str) -> None:
    """``call`` raises exactly ``error``, its message says ``says``, nothing is written."""
    before = counts(db_url)
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error
    assert says in str(info.value)
    assert counts(db_url) == before


def nested(depth: int) -> list[Any]:
    """A list nesting ``depth`` lists (itself included)."""
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize("wave", ["abc", 1.5, -5, 0, 2**31, 2**40, True])
def test_a_wave_out_of_range_is_refused(scheduler: TaskScheduler, db_url: str, wave: Any) -> None:
    # Given a scheduler
    handle = scheduler.get_scheduler()
    task = Task.python("builtins:abs", -1)
    # When tasks are sent with a wave that is not an integer from 1 to 2**31 - 1
    # Then InvalidArgument naming 'wave', and nothing is logged nor sent
    refused(db_url, lambda: scheduler.exec_async(handle, task, wave=wave), InvalidArgument, "wave")
    refused(db_url, lambda: scheduler.exec_many(handle, [task], wave=wave), InvalidArgument, "wave")


def test_the_bounds_of_a_wave_are_accepted(scheduler: TaskScheduler, broker: Broker) -> None:
    handle = scheduler.get_scheduler()
    task = Task.python("builtins:abs", -1)
    # Given waves at both ends of the range (and none)
    ids = [scheduler.exec_async(handle, task, wave=w) for w in (1, 2**31 - 1, None)]
    ids += scheduler.exec_many(handle, [task], wave=1)
    ids += scheduler.exec_many(handle, [task], wave=2**31 - 1)
    # Then each is logged with its wave, as given
    waves = [broker.fetch("log_get", log_id=i)[0]["wave"] for i in ids]
    assert waves == [1, 2**31 - 1, None, 1, 2**31 - 1]


@pytest.mark.parametrize("send", ["exec_async", "exec_many"])
def test_wave_zero_is_refused_waves_count_from_one(
    scheduler: TaskScheduler, db_url: str, send: str
) -> None:
    # Given a scheduler, and a caller who still counts waves from 0
    handle = scheduler.get_scheduler()
    task = Task.python("builtins:abs", -1)
    call = {
        "exec_async": lambda: scheduler.exec_async(handle, task, wave=0),
        "exec_many": lambda: scheduler.exec_many(handle, [task], wave=0),
    }[send]
    # When it sends a task with wave=0
    # Then InvalidArgument names the field and the range from 1, and nothing is written
    refused(db_url, call, InvalidArgument, "wave must be an integer from 1 to 2147483647, got 0")


def test_counts_too_large_for_a_column_are_refused(broker: Broker, db_url: str) -> None:
    init(broker, targets=[Target(activation=False)])
    huge = 2**70
    # Given counts no column holds, When a queue or a semaphore is made with one
    # Then InvalidArgument naming the field, not an OverflowError; nothing written
    refused(
        db_url,
        lambda: broker.create_queue("Big", max_queue_readers=huge),
        InvalidArgument,
        "max_queue_readers",
    )
    refused(
        db_url,
        lambda: broker.alter_queue("QueueAsyncTarget", max_queue_readers=2**31),
        InvalidArgument,
        "max_queue_readers",
    )
    semaphores = Semaphores(broker)
    refused(db_url, lambda: semaphores.create("s", huge), InvalidArgument, "permits")
    # And the largest is accepted
    semaphores.create("s", 2**31 - 1)
    assert [s["permits"] for s in semaphores.status()] == [2**31 - 1]


def test_a_json_body_nested_too_deep_is_refused(broker: Broker, db_url: str) -> None:
    # Given a dialog whose message type requires JSON
    init(broker, targets=[Target(activation=False)])
    broker.create_message_type("Json", "JSON")
    broker.create_contract("Typed", {"Json": "ANY"})
    broker.create_queue("Q")
    broker.create_service("From", "Q")
    broker.create_service("To", "Q", ["Typed"])
    handle = broker.begin_dialog("From", "To", "Typed")
    # When a body nests 100,000 levels deep (or one more than the limit)
    # Then InvalidMessageBody naming the depth, not a RecursionError; nothing sent
    for depth in (100_000, MAX_JSON_DEPTH + 1):
        body = "[" * depth + "]" * depth
        refused(db_url, lambda b=body: broker.send(handle, "Json", b), InvalidMessageBody, "deep")
    # And the limit itself, and brackets inside strings, are accepted
    broker.send(handle, "Json", "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH)
    broker.send(handle, "Json", '{"a": "' + "[" * 1000 + '"}')
    assert len(broker.peek("Q")) == 2


@pytest.mark.parametrize("field", ["args", "kwargs"])
def test_task_arguments_nested_too_deep_are_refused(
    scheduler: TaskScheduler, db_url: str, field: str
) -> None:
    handle = scheduler.get_scheduler()
    for depth in (100_000, MAX_TASK_DEPTH + 1):
        value = nested(depth) if field == "args" else {"x": nested(depth - 1)}
        task = {"kind": "python", "callable": "builtins:len", field: value}
        # When a task's arguments nest too deep
        # Then InvalidTask naming the field, not a RecursionError; nothing sent
        refused(db_url, lambda t=task: scheduler.exec_async(handle, t), InvalidTask, repr(field))
        refused(db_url, lambda t=task: scheduler.exec_many(handle, [t]), InvalidTask, repr(field))


def test_task_arguments_at_the_limit_are_sent(scheduler: TaskScheduler, broker: Broker) -> None:
    # Given arguments nested as deep as a task may (they travel in a JSON message)
    handle = scheduler.get_scheduler()
    task = {"kind": "python", "callable": "builtins:len", "args": nested(MAX_TASK_DEPTH)}
    log_id = scheduler.exec_async(handle, task)
    # Then the task is logged and sent
    assert broker.fetch("log_get", log_id=log_id)[0]["status"] is not None


def _run_one_as_a_reader(executor: Executor) -> None:
    reader = threading.Thread(target=executor.run_one, kwargs={"timeout": 5}, daemon=True)
    reader.start()
    reader.join(30)
    assert not reader.is_alive()


@pytest.mark.parametrize(
    ("task", "error"),
    [
        (Task.python("sys:exit", "bye"), "SystemExit: bye"),
        (Task.python("builtins:exec", "raise KeyboardInterrupt('stop')"), "KeyboardInterrupt"),
    ],
)
def test_a_task_that_exits_fails_at_once_and_the_reader_goes_on(
    scheduler: TaskScheduler, broker: Broker, task: Task, error: str
) -> None:
    # Given a task that calls sys.exit() (or raises KeyboardInterrupt) and one after it
    handle = scheduler.get_scheduler()
    failing = scheduler.exec_async(handle, task)
    after = scheduler.exec_async(handle, Task.python("builtins:abs", -3))
    executor = Executor(broker, "QueueAsyncTarget", idle_timeout=1)
    # When a reader thread runs it
    started = time.monotonic()
    _run_one_as_a_reader(executor)
    # Then the caller learns at once (not after the 30 s lease) that it failed, and why
    done = scheduler.synchronization(handle, timeout=10)
    assert time.monotonic() - started < 10
    assert (done.log_id, done.status) == (failing, "FAILED")
    assert done.error is not None and error in done.error
    (row,) = broker.fetch("log_get", log_id=failing)
    assert row["status"] == "FAILED" and error in row["error"]
    # And the same executor runs the next task
    _run_one_as_a_reader(executor)
    done = scheduler.synchronization(handle, timeout=10)
    assert (done.log_id, done.status, done.result) == (after, "SUCCEEDED", 3)
