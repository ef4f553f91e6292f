"""On PostgreSQL an executor records a task's start in its take's round trip
(``Broker.take_recorded``: the take, then ``log_start_taken`` in a durable transaction of
its own). A task the statement did not start, or a statement that failed, is started the
usual way (``log_start``): the task runs once, its row counts one attempt."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import sqlalchemy as sa

from scheduler_lib.broker import Broker, QueueDisabled
from scheduler_lib.broker.db.store import Store
from scheduler_lib.broker.ops import endpoints
from scheduler_lib.broker.ops import leases as leases_ops
from scheduler_lib.scheduler import Executor, Target, Task, TaskScheduler, init

pytestmark = pytest.mark.postgres

QUEUE = "QueueAsyncTarget"


@pytest.fixture
def broker(pg_scheduler_broker: Broker) -> Broker:
    return pg_scheduler_broker


def _statements(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The named statements the broker runs one by one (``broker.run``) from now on."""
    ran: list[str] = []
    run = broker.run

    def counting(query: str, /, **params: Any) -> int:
        ran.append(query)
        return run(query, **params)

    monkeypatch.setattr(broker, "run", counting)
    return ran


def test_the_start_is_recorded_in_the_take(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = TaskScheduler(broker)
    handle = scheduler.get_scheduler()
    log_id = scheduler.exec_async(handle, Task.python("builtins:abs", -3))
    executor = Executor(broker, QUEUE, idle_timeout=1)
    ran = _statements(broker, monkeypatch)
    taken: list[Any] = []
    take = broker.take_recorded

    def watching(*args: Any, **kwargs: Any) -> Any:
        leases, rows = take(*args, **kwargs)
        taken.append((leases, rows))
        return leases, rows

    monkeypatch.setattr(broker, "take_recorded", watching)
    # When the executor takes the task
    assert executor.run_one(timeout=5)
    # Then the take's statement started it (its lease is in the rows), no log_start ran
    [(leases, rows)] = taken
    assert [str(r[0]) for r in rows] == [leases[0].lease_id]
    assert "log_start" not in ran
    # And its row says it ran once, started at the take's instant
    (row,) = broker.fetch("log_get", log_id=log_id)
    assert (row["status"], row["attempts"], row["result"]) == ("SUCCEEDED", 1, "3")
    assert row["start_time"] == leases[0].taken_at
    assert row["worker_id"] == executor.worker()
    assert scheduler.synchronization(handle, timeout=5).status == "SUCCEEDED"


def test_a_queue_that_keeps_what_it_delivers_is_taken_the_checked_way_at_once(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a target queue with retention on (the one-statement take leaves it alone)
    broker.alter_queue(QUEUE, retention=True)
    scheduler = TaskScheduler(broker)
    handle = scheduler.get_scheduler()
    log_id = scheduler.exec_async(handle, Task.python("builtins:abs", -3))
    executor = Executor(broker, QUEUE, idle_timeout=1)
    looks: list[str] = []
    take_fast = leases_ops.take_fast

    def counting(*args: Any, **kwargs: Any) -> Any:
        looks.append(args[1])
        return take_fast(*args, **kwargs)

    monkeypatch.setattr(leases_ops, "take_fast", counting)
    # When the executor takes the task
    assert executor.run_one(timeout=5)
    # Then the one-statement take looked once, and the checked take took it (no second
    # look before it), and the task ran once
    assert looks == [QUEUE]
    (row,) = broker.fetch("log_get", log_id=log_id)
    assert (row["status"], row["attempts"], row["result"]) == ("SUCCEEDED", 1, "3")
    assert scheduler.synchronization(handle, timeout=5).status == "SUCCEEDED"


def test_a_failed_start_statement_falls_back_to_log_start(
    broker: Broker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler = TaskScheduler(broker)
    handle = scheduler.get_scheduler()
    log_id = scheduler.exec_async(handle, Task.python("builtins:abs", -4))
    executor = Executor(broker, QUEUE, idle_timeout=1)
    ran = _statements(broker, monkeypatch)
    # Given the start's statement fails on the server (after the take committed)
    text = Store._driver_text

    def failing(self: Store, query: str) -> str:
        return "SELECT 1 / 0" if query == "log_start_taken" else text(self, query)

    monkeypatch.setattr(Store, "_driver_text", failing)
    # When the executor takes the task
    with caplog.at_level(logging.WARNING, logger="scheduler_lib.broker.broker"):
        assert executor.run_one(timeout=5)
    # Then the failure was logged, the take stood, and log_start started the task
    assert any("division by zero" in r.getMessage() for r in caplog.records)
    assert ran.count("log_start") == 1
    (row,) = broker.fetch("log_get", log_id=log_id)
    assert (row["status"], row["attempts"], row["result"]) == ("SUCCEEDED", 1, "4")
    assert scheduler.synchronization(handle, timeout=5).status == "SUCCEEDED"
    assert broker.leases() == []


def _commands(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The statements run from now on by ``execute`` on any psycopg connection (how
    ``take_then`` sends its transaction control in the pipeline)."""
    import psycopg

    sent: list[str] = []
    execute = psycopg.Connection.execute

    def recording(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(str(query))
        return execute(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "execute", recording)
    return sent


@pytest.mark.parametrize("durable", [True, False], ids=["durable-start", "lazy-start"])
def test_a_target_says_whether_its_tasks_start_and_end_wait_for_the_flush(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch, durable: bool
) -> None:
    # Given a target whose tasks' effects are idempotent (durable_start=False), or not
    with Broker(postgres_url, timers=False) as broker:
        init(broker, targets=[Target(activation=False, durable_start=durable)])
        scheduler = TaskScheduler(broker)
        handle = scheduler.get_scheduler()
        log_id = scheduler.exec_async(handle, Task.python("builtins:abs", -5))
        executor = Executor(broker, QUEUE, idle_timeout=1)
        sent = _commands(monkeypatch)
        # (what the answer's one statement commits with: the setting on its connection)
        commits: list[str] = []
        on_driver = Store._on_driver

        def spied(self: Store, conn: Any, query: str, params: Any) -> Any:
            if query.startswith("send_fast+log_finish"):
                driver = conn.connection.driver_connection
                commits.append(driver.execute("SHOW synchronous_commit").fetchone()[0])
            return on_driver(self, conn, query, params)

        monkeypatch.setattr(Store, "_on_driver", spied)
        # When the executor takes the task and it ends
        assert executor.run_one(timeout=5)
        # Then the start's transaction waited for the flush only on the durable target
        assert ("SET LOCAL synchronous_commit TO on" in sent) is durable
        # And so did the answer's statement (the lazy one unlocks the scheduler's
        # endpoint at once)
        assert commits == ["on" if durable else "off"]
        # And either way the take's statement started it, once, it ran, and its answer,
        # its row's end and its lease's end are all there
        monkeypatch.undo()
        (row,) = broker.fetch("log_get", log_id=log_id)
        assert (row["status"], row["attempts"], row["result"]) == ("SUCCEEDED", 1, "5")
        assert scheduler.synchronization(handle, timeout=5).status == "SUCCEEDED"
        assert broker.leases() == []


def test_durable_start_must_be_a_bool(broker: Broker) -> None:
    from scheduler_lib.broker import InvalidArgument

    with pytest.raises(InvalidArgument, match="durable_start must be True or False, got 'no'"):
        init(broker, targets=[Target(activation=False, durable_start="no")])  # type: ignore[arg-type]


def test_empty_takes_read_the_queue_settings_once_a_recheck_and_see_a_change_here_at_once(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[str] = []
    queue = endpoints.queue

    def counting(session: Any, name: str) -> Any:
        reads.append(name)
        return queue(session, name)

    monkeypatch.setattr(endpoints, "queue", counting)
    # When one-statement takes (an executor's) on an empty queue look once and find nothing
    for _ in range(3):
        assert broker.take(QUEUE, timeout=0, durable=False) == []
    # Then the queue's settings were read once, not once per take (RECEIVE's cache)
    assert reads == [QUEUE]
    # And a queue turned off by this process is seen by the next take at once
    broker.alter_queue(QUEUE, status=False)
    with pytest.raises(QueueDisabled):
        broker.take(QUEUE, timeout=0, durable=False)


def test_the_start_finds_its_row_by_key_on_a_fresh_database(broker: Broker) -> None:
    """The driver prepares a statement it runs often, and the server then keeps one plan
    for it, made from what the tables looked like then. On a fresh database the log is
    empty; a plan that scans it would scan the whole log at every start for good."""
    # Given log_start_taken as the server plans it once for all calls (a generic plan),
    # on a fresh database
    text = broker._store._driver_text("log_start_taken")  # its SQL as the driver sends it
    names: list[str] = []

    def positional(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    prepared = re.sub(r"%\((\w+)\)s", positional, text)
    values = {"holder": "h", "taken_at": 1.0, "worker": "w", "activated_task_id": None}
    values |= {"end_dialog": "EndDialog", "error": "Error"}
    engine = sa.create_engine(broker.url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL plan_cache_mode TO force_generic_plan")
            conn.exec_driver_sql(f"PREPARE started AS {prepared}")
            arguments = ", ".join(_literal(values[name]) for name in names)
            plan = [row[0] for row in conn.exec_driver_sql(f"EXPLAIN EXECUTE started({arguments})")]
            conn.exec_driver_sql("DEALLOCATE started")
    finally:
        engine.dispose()
    # Then it reads execution_log through an index, never by scanning it
    reads = [line.strip() for line in plan if "Scan" in line and " on execution_log" in line]
    assert reads and all(line.startswith("->  Index") for line in reads), "\n".join(plan)


def _literal(value: Any) -> str:
    if value is None:
        return "NULL"
    return f"'{value}'" if isinstance(value, str) else repr(value)


def test_takes_leave_no_warning_in_the_servers_log(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every WARNING the server writes to its log reaches the client too: gather them on
    # every connection opened from now on (a COMMIT outside a transaction block, say,
    # logs "there is no transaction in progress" — once per take, it filled the log)
    import psycopg

    warned: list[str] = []
    connect = psycopg.connect

    def connecting(*args: Any, **kwargs: Any) -> Any:
        conn = connect(*args, **kwargs)
        conn.add_notice_handler(lambda d: warned.append(f"{d.severity}: {d.message_primary}"))
        return conn

    monkeypatch.setattr(psycopg, "connect", connecting)
    with Broker(postgres_url, timers=False) as broker:
        init(broker, targets=[Target(activation=False)])
        scheduler = TaskScheduler(broker)
        handle = scheduler.get_scheduler()
        tasks = [Task.python("builtins:abs", -n) for n in range(3)]
        log_ids = scheduler.exec_many(handle, tasks)
        executor = Executor(broker, QUEUE, idle_timeout=1)
        # When the executor takes and runs them, each start recorded in its take
        for _ in log_ids:
            assert executor.run_one(timeout=5)
        for _ in log_ids:
            assert scheduler.synchronization(handle, timeout=5).status == "SUCCEEDED"
        rows = [broker.fetch("log_get", log_id=i)[0] for i in log_ids]
        assert [(r["status"], r["attempts"]) for r in rows] == [("SUCCEEDED", 1)] * 3
    # Then the server warned of nothing
    assert [w for w in warned if not w.startswith(("NOTICE", "DEBUG", "LOG", "INFO"))] == []


def test_a_take_that_fails_is_said_and_the_next_one_runs_the_task(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    from scheduler_lib.broker import DatabaseError

    scheduler = TaskScheduler(broker)
    handle = scheduler.get_scheduler()
    log_id = scheduler.exec_async(handle, Task.python("builtins:abs", -6))
    executor = Executor(broker, QUEUE, idle_timeout=1)
    # Given the take's statement fails on the server (inside its own transaction block)
    text = Store._driver_text

    def failing(self: Store, query: str) -> str:
        if query == "take_fast":
            return "SELECT CAST(%(queue)s AS integer)"
        return text(self, query)

    monkeypatch.setattr(Store, "_driver_text", failing)
    with pytest.raises(DatabaseError, match="take_fast"):
        executor.run_one(timeout=0)
    # Then nothing was taken, and once it works the next take runs the task, once
    monkeypatch.setattr(Store, "_driver_text", text)
    assert broker.leases() == []
    assert executor.run_one(timeout=5)
    (row,) = broker.fetch("log_get", log_id=log_id)
    assert (row["status"], row["attempts"], row["result"]) == ("SUCCEEDED", 1, "6")
    assert scheduler.synchronization(handle, timeout=5).status == "SUCCEEDED"


@pytest.mark.parametrize(
    ("durable", "retries", "warned"),
    [(False, 0, True), (False, 1, False), (True, 0, False)],
    ids=["lazy-no-retries", "lazy-retries", "durable-no-retries"],
)
def test_init_warns_of_a_lazy_target_without_retries(
    postgres_url: str, caplog: pytest.LogCaptureFixture, durable: bool, retries: int, warned: bool
) -> None:
    # Given a target of lazy start and no retries (a crash that loses its end reports a
    # task that ran as FAILED), or one with retries, or a durable one
    target = Target(activation=False, durable_start=durable, retries=retries)
    with Broker(postgres_url, timers=False) as broker, caplog.at_level(logging.WARNING):
        # When the catalog is made
        init(broker, targets=[target])
    # Then only the first is warned about, in one line naming the target and the fix
    said = [r.getMessage() for r in caplog.records if "durable_start=False" in r.getMessage()]
    assert bool(said) == warned
    if warned:
        assert len(said) == 1 and "\n" not in said[0]
        assert "'ServiceAsyncTarget'" in said[0] and "retries=1 or more" in said[0]
