"""The task scheduler (seed 002) on SQLite and PostgreSQL: the blog's test, errors as
results and wave policies, in-flight limits, semaphores, fairness, dead workers."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from multiproc import collect, poll, running

from scheduler_lib.broker import Broker, SentBy, activation
from scheduler_lib.broker.broker import TIMER_POLL_INTERVAL
from scheduler_lib.broker.exceptions import InvalidArgument
from scheduler_lib.scheduler import (
    Completion,
    InvalidTask,
    KindNotAllowed,
    Names,
    SchedulerEnded,
    Semaphores,
    SemaphoreTimeout,
    SynchronizationTimeout,
    Target,
    Task,
    TaskScheduler,
    UnknownKind,
    WaveFailed,
    init,
    metrics,
    register_kind,
)

WAIT = 30.0
Executors = Any  # the ``executors`` fixture: ``with executors(n, **options): ...``


def sleep(seconds: float) -> Task:
    return Task.python("time:sleep", seconds, name=f"sleep {seconds}")


def _rows(broker: Broker, handle: Any) -> list[Mapping[str, Any]]:
    with broker.transaction() as tx:
        return tx.fetch("log_of_scheduler", handle=str(handle))


def _max_running(rows: Sequence[Mapping[str, Any]]) -> int:
    """Most tasks running at one instant, from the log's start and end times."""
    events = sorted(
        [(r["start_time"], 1) for r in rows] + [(r["end_time"], -1) for r in rows],
        key=lambda e: (e[0], e[1]),  # an end before a start at the same instant
    )
    running_now = peak = 0
    for _, delta in events:
        running_now += delta
        peak = max(peak, running_now)
    return peak


# --- the blog's test ---------------------------------------------------------------------


def test_the_blogs_waves_run_in_order_together_and_close_to_the_ideal_makespan(
    sched: Broker, scheduler: TaskScheduler, executors: Executors
) -> None:
    unit = 0.1  # seconds per "second" of the blog's test
    shape = [(4, 10.1), (2, 9.2), (1, 8.3), (2, 7.4), (1, 6.5)]
    waves = [[sleep(units * unit)] * count for count, units in shape]
    ideal = sum(units * unit for _, units in shape)
    bound = ideal * 1.02 + 0.05 * len(shape)
    makespans = []
    with executors(4):
        # Best of three: a disk stalled by other work on the machine (a PostgreSQL
        # checkpoint after the schema tests' CREATE/DROP DATABASE) slows every commit,
        # SQLite's included, and the other test worker's Spark or Airflow start can take
        # both cores for seconds (two runs of SQLite over by 0.38 s and 0.44 s in a CI
        # run of 2026-11-29). Every run must still be ordered and overlapping.
        for _ in range(3):
            started = time.monotonic()
            report = scheduler.run_waves(waves)
            makespans.append(time.monotonic() - started)
            _check_blog_run(sched, report, shape)
            if makespans[-1] <= bound:
                break
    assert min(makespans) <= bound, (makespans, ideal)


def _check_blog_run(broker: Broker, report: Any, shape: list[tuple[int, float]]) -> None:
    assert report.ok and len(report.completions) == 10
    rows = _rows(broker, report.scheduler_handle)
    assert [r["status"] for r in rows] == ["SUCCEEDED"] * 10
    by_wave = [[r for r in rows if r["wave"] == w] for w in range(1, len(shape) + 1)]
    assert [len(w) for w in by_wave] == [count for count, _ in shape]
    for earlier, later in itertools.pairwise(by_wave):
        # Each wave starts only after the previous one finished
        assert min(r["start_time"] for r in later) >= max(r["end_time"] for r in earlier)
    for wave in by_wave:
        # The tasks of a wave overlap: every one started before any finished
        assert max(r["start_time"] for r in wave) < min(r["end_time"] for r in wave)
        assert len({r["worker_id"] for r in wave}) == len(wave)  # one reader each


def makespans(target: str) -> tuple[float, float]:
    """This process's wave makespan histogram for ``target``: (count, sum)."""
    name, labels = "scheduler_lib_wave_makespan_seconds", {"target": target}
    count = metrics.LOCAL.get_sample_value(f"{name}_count", labels) or 0.0
    return count, metrics.LOCAL.get_sample_value(f"{name}_sum", labels) or 0.0


def test_activated_executors_run_the_waves(broker: Broker) -> None:
    init(broker, targets=[Target(max_readers=3)])
    scheduler = TaskScheduler(broker)
    waves = makespans(Target.service)
    with activation.running(broker, empty_grace=0.1, check_interval=0.2):
        report = scheduler.run_waves([[sleep(0.3)] * 3, [sleep(0.1)]])
        assert report.ok
        # /metrics has each wave's makespan, at least its longest task
        count, total = makespans(Target.service)
        assert count - waves[0] == 2 and total - waves[1] >= 0.3 + 0.1
        rows = _rows(broker, report.scheduler_handle)
        assert all(r["activated_task_id"] for r in rows)  # run by activated readers
        wave1 = [r for r in rows if r["wave"] == 1]
        assert min(r["start_time"] for r in rows if r["wave"] == 2) >= max(
            r["end_time"] for r in wave1
        )


# --- errors are results ----------------------------------------------------------------


def test_a_failing_task_comes_back_as_a_failed_completion(
    sched: Broker, scheduler: TaskScheduler, executors: Executors
) -> None:
    with executors(1), scheduler.scheduler() as handle:
        log_id = scheduler.exec_async(handle, Task.python("builtins:int", "not a number"))
        done = scheduler.synchronization(handle, timeout=WAIT)
    assert done.log_id == log_id and done.status == "FAILED" and not done.ok
    assert done.error is not None and "ValueError" in done.error
    (row,) = _rows(sched, handle.conversation_handle)
    assert row["status"] == "FAILED" and "invalid literal" in row["error"]
    assert row["end_time"] >= row["start_time"] >= row["sent_at"]


def test_results_come_back_with_the_completion(
    scheduler: TaskScheduler, executors: Executors
) -> None:
    with executors(1), scheduler.scheduler() as handle:
        scheduler.exec_async(handle, Task.python("builtins:sorted", [3, 1, 2]))
        done = scheduler.synchronization(handle, timeout=WAIT)
    assert done.ok and done.result == [1, 2, 3]


def test_fail_fast_stops_cancels_what_is_queued_and_lists_every_failure(
    sched: Broker, scheduler: TaskScheduler, executors: Executors
) -> None:
    waves = [
        [Task.python("builtins:int", "x", name="bad"), *[sleep(0.5) for _ in range(5)]],
        [sleep(0.1)],
    ]
    with executors(2), pytest.raises(WaveFailed) as raised:
        scheduler.run_waves(waves, policy="fail_fast")
    failure = raised.value
    statuses = sorted(c.status for c in failure.completions)
    # The bad task failed; one sleep was running with it and finished; the rest of the
    # wave had not started and was cancelled; the second wave was never sent
    assert statuses.count("FAILED") == 1
    assert statuses.count("CANCELLED") >= 3
    assert statuses.count("SUCCEEDED") + statuses.count("CANCELLED") == 5
    assert {c.status for c in failure.failures} <= {"FAILED", "CANCELLED"}
    assert "bad: FAILED" in str(failure) and "1 not sent" in str(failure)
    rows = _rows(sched, _handle_of(sched, failure.completions))
    assert all(r["wave"] == 1 for r in rows)  # nothing of wave 2 was logged or sent
    cancelled = [r for r in rows if r["status"] == "CANCELLED"]
    assert cancelled and all(r["attempts"] == 0 for r in cancelled)  # never ran


def _handle_of(broker: Broker, completions: Sequence[Completion]) -> str:
    log_id = next(c.log_id for c in completions if c.log_id is not None)
    with broker.transaction() as tx:
        return str(tx.fetch_one("log_get", log_id=log_id)["scheduler_handle"])  # type: ignore[index]


def test_continue_runs_every_wave_and_reports(
    scheduler: TaskScheduler, executors: Executors
) -> None:
    waves = [
        [Task.python("builtins:int", "x", name="bad"), sleep(0.05)],
        [sleep(0.05), sleep(0.05)],
    ]
    with executors(2):
        report = scheduler.run_waves(waves, policy="continue")
    assert not report.ok
    assert [c.task_name for c in report.failures] == ["bad"]
    assert [len(w.completions) for w in report.waves] == [2, 2]
    assert all(c.ok for c in report.waves[1].completions)


# --- limits: in flight, semaphores ------------------------------------------------------


def test_a_thousand_tasks_never_run_more_than_three_at_a_time(
    sched: Broker, scheduler: TaskScheduler, executors: Executors
) -> None:
    tasks = [Task.python("time:sleep", 0.001, name=f"t{i}") for i in range(1000)]
    with executors(5):
        report = scheduler.run_waves([tasks], max_in_flight=3)
    assert report.ok and len(report.completions) == 1000
    rows = _rows(sched, report.scheduler_handle)
    assert len(rows) == 1000 and all(r["status"] == "SUCCEEDED" for r in rows)
    assert _max_running(rows) <= 3
    assert _max_running(rows) >= 2  # the limit is a limit, not serial execution


def test_exec_async_waits_at_the_in_flight_limit(
    scheduler: TaskScheduler, executors: Executors
) -> None:
    with executors(3), scheduler.scheduler(max_in_flight=2) as handle:
        for _ in range(5):
            scheduler.exec_async(handle, sleep(0.05))
            assert handle.in_flight <= 2
        done = [scheduler.synchronization(handle, timeout=WAIT) for _ in range(5)]
    assert len({c.log_id for c in done}) == 5 and all(c.ok for c in done)


def test_a_named_semaphore_of_two_shared_by_three_processes_never_exceeds_two(
    sched: Broker, db_url: str
) -> None:
    Semaphores(sched).create("warehouse", 2)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    from scheduler_workers import use_semaphore

    workers = [
        ctx.Process(target=use_semaphore, args=(db_url, "warehouse", 5, 0.1, results))
        for _ in range(3)
    ]
    with running(workers):
        reports = collect(results, 3, timeout=120)
    holds = [hold for _, held in reports for hold in held]
    assert len(holds) == 15
    events = sorted([(s, 1) for s, _ in holds] + [(e, -1) for _, e in holds])
    now = peak = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    assert peak == 2  # never more than two, and the two were used


def test_a_killed_holders_permit_comes_back(sched: Broker, db_url: str) -> None:
    semaphores = Semaphores(sched)
    semaphores.create("warehouse", 1)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    from scheduler_workers import hold_semaphore_forever

    lease = 3.0  # renewed every second: long enough for a loaded machine
    holder = ctx.Process(target=hold_semaphore_forever, args=(db_url, "warehouse", lease, results))
    with running([holder]):
        ((pid, _holder_id),) = collect(results, 1)
        with pytest.raises(SemaphoreTimeout):  # held, and kept alive past its lease
            semaphores.acquire("warehouse", timeout=lease * 2)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        permit = semaphores.acquire("warehouse", timeout=WAIT)
        waited = time.monotonic() - killed
    assert waited <= lease + 1.0
    semaphores.release(permit)
    assert semaphores.status()[0]["held"] == 0


def test_tasks_naming_a_semaphore_respect_it(
    sched: Broker, scheduler: TaskScheduler, executors: Executors
) -> None:
    Semaphores(sched).create("warehouse", 2)
    tasks = [Task.python("time:sleep", 0.2, name=f"w{i}", semaphore="warehouse") for i in range(6)]
    with executors(4):
        report = scheduler.run_waves([tasks])
    assert report.ok
    # The log's start is taken before the permit; the permit bounds the sleeps: with 2
    # permits six 0.2 s tasks need at least three rounds
    rows = _rows(sched, report.scheduler_handle)
    assert max(r["end_time"] for r in rows) - min(r["start_time"] for r in rows) >= 0.6


# --- fairness ---------------------------------------------------------------------------


def test_six_schedulers_on_five_readers_all_progress_evenly(
    sched: Broker, executors: Executors
) -> None:
    schedulers = 6
    per = 100
    handles = []
    callers = [TaskScheduler(sched) for _ in range(schedulers)]
    for caller in callers:
        handles.append(caller.get_scheduler())
    # Every scheduler queues its wave first, at once as run_waves does (six callers that
    # started together; fair share stamps a later start correspondingly later)...
    for caller, handle in zip(callers, handles, strict=True):
        caller.exec_many(
            handle, [Task.python("time:sleep", 0.002, name=f"{i}") for i in range(per)]
        )
    # ...then five readers serve them
    with executors(5):
        for caller, handle in zip(callers, handles, strict=True):
            for _ in range(per):
                assert caller.synchronization(handle, timeout=WAIT).ok
    rows = []
    for handle in handles:
        rows.extend(_rows(sched, handle.conversation_handle))
    rows.sort(key=lambda r: r["end_time"])
    index = {str(h.conversation_handle): i for i, h in enumerate(handles)}
    total = schedulers * per
    for step in range(1, 11):
        done = rows[: total * step // 10]
        counts = [0] * schedulers
        for r in done:
            counts[index[r["scheduler_handle"]]] += 1
        mean = len(done) / schedulers
        assert all(abs(c - mean) <= 0.25 * mean for c in counts), (step, counts)
    for handle, caller in zip(handles, callers, strict=True):
        caller.release_scheduler(handle)


# --- silent failures --------------------------------------------------------------------


def test_a_worker_killed_mid_task_makes_synchronization_return_a_failure(
    sched: Broker, scheduler: TaskScheduler, db_url: str
) -> None:
    lease = 1.5
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    from scheduler_workers import executor

    worker = ctx.Process(target=executor, args=(db_url, lease, results))
    with running([worker]), scheduler.scheduler() as handle:
        ((pid, _),) = collect(results, 1)
        log_id = scheduler.exec_async(handle, sleep(120))
        poll(
            lambda: _rows(sched, handle.conversation_handle)[0]["status"] == "RUNNING",
            WAIT,
            "the task started",
        )
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        done = scheduler.synchronization(handle, timeout=WAIT)
        waited = time.monotonic() - killed
    assert done.log_id == log_id and done.status == "FAILED"
    assert done.error is not None and "worker stopped" in done.error
    assert waited <= lease + TIMER_POLL_INTERVAL + 3.0  # the heartbeat bound, plus slack
    (row,) = _rows(sched, handle.conversation_handle)
    assert row["status"] == "FAILED" and str(pid) in row["worker_id"]


# --- the handle's life ------------------------------------------------------------------


def test_synchronization_times_out_clearly(scheduler: TaskScheduler) -> None:
    with scheduler.scheduler() as handle:
        scheduler.exec_async(handle, sleep(0.01))  # no executor runs
        with pytest.raises(SynchronizationTimeout, match=r"no task completed within 0.2 s"):
            scheduler.synchronization(handle, timeout=0.2)


def test_synchronization_raises_when_the_conversation_is_ended(
    sched: Broker, scheduler: TaskScheduler
) -> None:
    handle = scheduler.get_scheduler()
    scheduler.exec_async(handle, sleep(0.01))
    target = next(
        e.conversation_handle for e in sched.conversation_endpoints() if not e.is_initiator
    )
    sched.end_conversation(target, error=1, description="an operator ended it")
    with pytest.raises(SchedulerEnded, match=r"an operator ended it"):
        scheduler.synchronization(handle, timeout=WAIT)
    scheduler.release_scheduler(handle)  # already gone: never raises
    scheduler.release_scheduler(handle)


def test_release_ends_both_sides(
    sched: Broker, scheduler: TaskScheduler, executors: Executors
) -> None:
    with executors(1):
        with scheduler.scheduler() as handle:
            scheduler.exec_async(handle, sleep(0.01))
            scheduler.synchronization(handle, timeout=WAIT)
        poll(lambda: not sched.conversation_endpoints(), WAIT, "both endpoints closed")


def test_execution_status_shows_what_activated_readers_run(broker: Broker) -> None:
    init(broker, targets=[Target(max_readers=2)])
    scheduler = TaskScheduler(broker, context={"dag_id": "d", "run_id": "r", "task_id": "t"})
    with (
        activation.running(broker, empty_grace=0.1, check_interval=0.2),
        scheduler.scheduler() as h,
    ):
        log_id = scheduler.exec_async(h, sleep(2.0))

        def running_row() -> Any:
            with broker.transaction() as tx:
                rows = [r for r in tx.fetch("status_list") if r["log_id"] == log_id]
            return rows

        (row,) = poll(running_row, WAIT, "the running task shows in execution_status")
        assert row["status"] == "RUNNING" and row["dag_id"] == "d" and row["task_id"] == "t"
        assert row["reader_task_id"] in {t["task_id"] for t in broker.activated_tasks()}
        assert scheduler.synchronization(h, timeout=WAIT).ok


# --- task kinds -----------------------------------------------------------------------


def test_sql_tasks_run_on_the_configured_database(
    sched: Broker, scheduler: TaskScheduler, executors: Executors, tmp_path: Any
) -> None:
    url = f"sqlite:///{tmp_path / 'work.db'}"
    work = [
        [Task.sql("CREATE TABLE t (x INTEGER)")],
        [Task.sql("INSERT INTO t VALUES (1)", "INSERT INTO t VALUES (2)"), Task.sql("SELECT 1")],
    ]
    with executors(2, sql_url=url):
        report = scheduler.run_waves(work)
    assert [
        c.result for c in report.waves[1].completions if c.task_name and "INSERT" in c.task_name
    ] == [[1, 1]]
    import sqlite3

    with sqlite3.connect(tmp_path / "work.db") as conn:
        assert conn.execute("SELECT sum(x) FROM t").fetchone() == (3,)


def test_a_failing_sql_statement_rolls_its_task_back(
    scheduler: TaskScheduler, executors: Executors, tmp_path: Any
) -> None:
    url = f"sqlite:///{tmp_path / 'work.db'}"
    with executors(1, sql_url=url):
        scheduler.run_waves([[Task.sql("CREATE TABLE t (x INTEGER)")]])
        report = scheduler.run_waves(
            [[Task.sql("INSERT INTO t VALUES (1)", "INSERT INTO nope VALUES (2)")]],
            policy="continue",
        )
    (failed,) = report.failures
    assert "no such table: nope" in (failed.error or "")

    with sqlite3.connect(tmp_path / "work.db") as conn:
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (0,)


# --- bad input: clear errors, nothing half-sent ----------------------------------------


@pytest.mark.parametrize(
    ("task", "error", "text"),
    [
        ({"kind": "teleport"}, UnknownKind, "unknown task kind 'teleport'"),
        ({"kind": "python"}, InvalidTask, "field 'callable'"),
        ({"kind": "python", "callable": "time:sleep", "args": 1}, InvalidTask, "field 'args'"),
        ({"kind": "python", "callable": "x.y", "retries": 3}, InvalidTask, "unknown field"),
        ({"kind": "sql", "sql": []}, InvalidTask, "field 'sql'"),
        ({"sql": "SELECT 1"}, InvalidTask, "field 'kind'"),
        ("SELECT 1", InvalidTask, "a task is an object"),
        ({"kind": "python", "callable": "x.y", "name": ""}, InvalidTask, "field 'name'"),
        ({"kind": "python", "callable": "x.y", "args": [object()]}, InvalidTask, "JSON"),
    ],
)
def test_bad_tasks_are_refused_before_anything_is_sent(
    sched: Broker, scheduler: TaskScheduler, task: Any, error: type, text: str
) -> None:
    waves = [[sleep(0.01)], [sleep(0.01), task]]
    with pytest.raises(error, match=text):
        scheduler.run_waves(waves)
    with sched.transaction() as tx:
        assert tx.fetch("log_recent", limit=10) == []
    assert sched.peek("QueueAsyncTarget") == []
    assert sched.conversation_endpoints() == []


def test_a_kind_the_target_does_not_run_is_refused(sched: Broker) -> None:
    init(sched, targets=[Target(activation=False), Target("SqlOnly", "SqlOnlyQueue", ["sql"])])
    scheduler = TaskScheduler(sched, target="SqlOnly")
    with scheduler.scheduler() as handle:
        with pytest.raises(KindNotAllowed, match=r"'SqlOnly' does not run 'python' tasks"):
            scheduler.exec_async(handle, sleep(0.01))
        scheduler.exec_async(handle, Task.sql("SELECT 1"))
    assert len(sched.peek("SqlOnlyQueue")) == 2  # the SQL task, then EndDialog


def test_the_executor_refuses_a_kind_its_target_does_not_run(
    sched: Broker, executors: Executors
) -> None:
    # A task sent by hand, around the caller's check
    init(sched, targets=[Target(activation=False, kinds=["sql"])])
    handle = sched.begin_dialog("ServiceAsyncInitiator", "ServiceAsyncTarget", "AsyncContract")
    sched.send(handle, "AsyncSent", json.dumps({"log_id": 999, "task": sleep(0.01).to_dict()}))
    with executors(1):
        (done,) = sched.receive("QueueAsyncInitiator", timeout=WAIT)
    body = done.json()
    assert body["status"] == "FAILED" and "does not run 'python' tasks" in body["error"]


def test_init_is_idempotent_and_keeps_several_targets(broker: Broker) -> None:
    targets = [Target(activation=False), Target("Cluster2", "Cluster2Queue", ["python"])]
    for _ in range(2):
        init(broker, targets=targets)
    assert {s["service_name"] for s in broker.services()} >= {
        "ServiceAsyncInitiator",
        "ServiceAsyncTarget",
        "Cluster2",
    }
    assert broker.queue("QueueAsyncTarget").fair_share_quantum == 1.0
    with pytest.raises(Exception, match="kinds must be a list"):
        init(broker, targets=[Target(kinds="sql")])  # type: ignore[arg-type]


def test_threads_share_a_scheduler_instance_safely(sched: Broker, executors: Executors) -> None:
    # One TaskScheduler, one handle per thread (handles are not shared between threads)
    scheduler = TaskScheduler(sched)
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            report = scheduler.run_waves([[sleep(0.01)] * 5, [sleep(0.01)]])
            assert report.ok
        except BaseException as exc:
            errors.append(exc)

    with executors(3):
        threads = [threading.Thread(target=caller) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
    assert not errors


# --- the rest of the API --------------------------------------------------------------


class Echo:
    """A task kind of the tests' own: returns its ``value``."""

    name = "echo"

    def validate(self, spec: dict[str, Any], where: str) -> dict[str, Any]:
        if set(spec) != {"value"}:
            raise InvalidTask(f"{where}: field 'value' is required, and only it")
        return spec

    def run(self, spec: Mapping[str, Any], context: Any) -> Any:
        return {"echo": spec["value"], "log_id": context.log_id}

    def describe(self, spec: Mapping[str, Any]) -> str:
        return f"echo {spec['value']}"


def test_a_registered_kind_runs_where_the_target_allows_it(
    sched: Broker, executors: Executors
) -> None:
    register_kind(Echo())
    init(sched, targets=[Target(activation=False, kinds=["echo", "python"])])
    scheduler = TaskScheduler(sched)
    with executors(1):
        report = scheduler.run_waves([[{"kind": "echo", "value": 7}]])
    (done,) = report.completions
    assert done.ok and done.result["echo"] == 7 and done.task_name == "echo 7"
    with pytest.raises(InvalidTask, match="field 'value'"):
        scheduler.run_waves([[{"kind": "echo"}]])


class Sender:
    """A task kind of the tests' own: returns the Airflow task instance that sent it."""

    name = "sender"

    def validate(self, spec: dict[str, Any], where: str) -> dict[str, Any]:
        return spec

    def run(self, spec: Mapping[str, Any], context: Any) -> Any:
        return context.airflow

    def describe(self, spec: Mapping[str, Any]) -> str:
        return "sender"


def test_the_airflow_task_instance_travels_with_each_task(
    sched: Broker, executors: Executors
) -> None:
    # Given a scheduler for an Airflow task instance, and one without Airflow
    register_kind(Sender())
    init(sched, targets=[Target(activation=False, kinds=["sender"])])
    ids = {"dag_id": "etl", "run_id": "manual__1", "task_id": "wave_1"}
    sender = {
        **ids,
        "try_number": 3,
        "map_index": -1,
        "lineage_job_namespace": "airflow",
        "lineage_job_name": "etl.wave_1",
        "lineage_run_id": "01900000-0000-7000-8000-000000000000",
    }
    airflow = TaskScheduler(sched, context={**sender, "lineage_root_run_id": None})
    plain = TaskScheduler(sched)
    # When each sends one task (exec_async) and a wave of three (exec_many)
    with executors(2):
        for scheduler, expected in ((airflow, sender), (plain, None)):
            with scheduler.scheduler() as handle:
                scheduler.exec_async(handle, {"kind": "sender"})
                scheduler.exec_many(handle, [{"kind": "sender"}] * 3, wave=1)
                done = [scheduler.synchronization(handle, timeout=WAIT) for _ in range(4)]
            # Then each task saw the sender's instance (the fields set), or None
            assert [c.result for c in done] == [expected] * 4, done
            # and the log rows name it
            assert [{k: r[k] for k in ids} for r in scheduler.log(handle)] == [
                ids if expected else dict.fromkeys(ids)
            ] * 4
    # A field it does not know, or a value of the wrong type, is refused
    with pytest.raises(InvalidArgument, match="context takes"):
        TaskScheduler(sched, context={"dag": "etl"})
    with pytest.raises(InvalidArgument, match="'try_number' must be int"):
        TaskScheduler(sched, context={"try_number": "1"})


def test_exec_many_sends_all_or_nothing(
    sched: Broker, scheduler: TaskScheduler, executors: Executors
) -> None:
    with scheduler.scheduler(max_in_flight=3) as handle:
        with pytest.raises(InvalidTask):
            scheduler.exec_many(handle, [sleep(0.01), {"kind": "python"}])
        assert sched.peek("QueueAsyncTarget") == []
        with pytest.raises(Exception, match="exceed max_in_flight=3"):
            scheduler.exec_many(handle, [sleep(0.01)] * 4)
        log_ids = scheduler.exec_many(handle, [sleep(0.01)] * 3)
        assert len(log_ids) == 3 and handle.in_flight == 3
        with executors(2):
            done = [scheduler.synchronization(handle, timeout=WAIT) for _ in range(3)]
    assert sorted(c.log_id for c in done) == sorted(log_ids)


def test_with_retries_a_task_whose_worker_vanished_runs_again(
    sched: Broker, executors: Executors
) -> None:
    init(sched, targets=[Target(activation=False, retries=1)])
    scheduler = TaskScheduler(sched)
    with scheduler.scheduler() as handle:
        log_id = scheduler.exec_async(handle, Task.python("builtins:abs", -3))
        # A worker takes it and vanishes (never renews, never answers)
        (lease,) = sched.take("QueueAsyncTarget", timeout=WAIT, lease=0.3)
        assert json.loads(lease.message.body or b"{}")["log_id"] == log_id
        poll(lambda: sched.peek("QueueAsyncTarget"), WAIT, "the task came back for a retry")
        with executors(1):
            done = scheduler.synchronization(handle, timeout=WAIT)
    assert done.ok and done.result == 3
    (incident,) = sched.poison_incidents(lease.message.conversation_handle, 0)
    assert incident["kind"] == "EXPIRED"


def test_the_catalog_names_are_configurable(broker: Broker, executors: Executors) -> None:
    names = Names(
        sent="Go",
        done="Done",
        contract="Jobs",
        initiator_queue="CallerQ",
        initiator_service="Caller",
    )
    init(broker, names, [Target("Runner", "RunnerQ", activation=False)])
    scheduler = TaskScheduler(broker, names=names, target="Runner")
    with executors(1, queue="RunnerQ"):
        report = scheduler.run_waves([[sleep(0.01), sleep(0.01)]])
    assert report.ok
    assert broker.contract("Jobs") == {"Go": SentBy.INITIATOR, "Done": SentBy.TARGET}
