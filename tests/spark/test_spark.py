"""The Spark layer end to end: a worker whose readers are threads on a ``local[2]``
session runs each task kind sent through the scheduler; failures come back as results
with Spark's message; a running job is cancelled through its job group; jobs run in the
pool of their conversation's priority; ``spark_submit`` submits and tracks a real
application."""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
from multiproc import poll as _poll

from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import InvalidTask, TaskScheduler, WaveFailed
from scheduler_lib.spark import Worker, job_group, pool_for
from scheduler_lib.spark import session as sessions

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

T = TypeVar("T")
DEADLINE = 60.0
# Long enough that only a cancel ends it within the test's deadline on two cores.
ENDLESS = "SELECT sum(hash(id)) AS h FROM range(0, 400000000000)"


def poll(condition: Callable[[], T], what: str, timeout: float = DEADLINE) -> T:
    return _poll(condition, timeout, what)


def log_row(broker: Broker, log_id: int) -> Any:
    with broker.transaction() as tx:
        return tx.fetch_one("log_get", log_id=log_id)


# --- spark_sql -----------------------------------------------------------------------


def test_a_task_reads_a_table_as_another_application_last_wrote_it(
    scheduler: TaskScheduler, spark: SparkSession
) -> None:
    def count() -> int:
        report = scheduler.run_waves(
            [[{"kind": "spark_sql", "name": "count", "sql": "SELECT count(*) AS n FROM rewritten"}]]
        )
        [done] = report.completions
        assert done.ok, done.error
        return int(done.result["rows"][0]["n"])

    # Given a table a task has read (its session caches the table's files)
    spark.sql("DROP TABLE IF EXISTS rewritten")
    spark.sql("CREATE TABLE rewritten USING parquet AS SELECT id FROM range(10)")
    assert count() == 10
    # When another session sharing the catalog rewrites it, as another worker application
    # on the same metastore does in the wave before
    other = spark.newSession()
    other.sql("DROP TABLE rewritten")
    other.sql("CREATE TABLE rewritten USING parquet AS SELECT id FROM range(25)")

    # Then the next task reads the new files, not the cached list of the old ones
    try:
        assert count() == 25
    finally:
        spark.sql("DROP TABLE IF EXISTS rewritten")


def test_spark_sql_runs_statements_in_order_and_returns_the_last_ones_rows(
    scheduler: TaskScheduler, spark: SparkSession
) -> None:
    report = scheduler.run_waves(
        [
            [
                {
                    "kind": "spark_sql",
                    "name": "numbers",
                    "sql": [
                        "CREATE OR REPLACE TEMP VIEW numbers AS SELECT id FROM range(100)",
                        "SELECT count(*) AS n, sum(id) AS total FROM numbers WHERE id >= :low",
                    ],
                    "args": {"low": 50},
                }
            ]
        ]
    )
    [done] = report.completions
    assert done.ok, done.error
    assert done.result == {
        "statements": 2,
        "columns": ["n", "total"],
        "rows": [{"n": 50, "total": 3725}],
    }
    row = log_row(scheduler.broker, done.log_id)
    application = spark.sparkContext.applicationId
    assert row["status"] == "SUCCEEDED"
    assert row["spark_application_id"] == application
    assert row["spark_job_group"] == job_group(done.log_id) == f"scheduler_lib-{done.log_id}"
    assert row["spark_ui_url"] == spark.sparkContext.uiWebUrl
    # The blog's SPID, for Spark: host, process, reader, application.
    _host, pid, reader, app = row["worker_id"].split(":", 3)
    assert (int(pid), app) == (os.getpid(), application)
    assert reader.startswith("reader-QueueAsyncTarget-")
    # The job ran in the task's group (the status tracker knows the group's jobs).
    assert spark.sparkContext.statusTracker().getJobIdsForGroup(row["spark_job_group"])
    # The Execution Status page's Spark link (the UI's Jobs page) resolves on the live
    # application, and that page labels the task's jobs with its group
    link = row["spark_ui_url"].rstrip("/") + "/jobs/"
    with urllib.request.urlopen(link, timeout=30) as response:
        assert response.status == 200
        assert f"({row['spark_job_group']})" in response.read().decode()


def test_spark_sql_writes_its_output_and_a_later_wave_reads_it(
    scheduler: TaskScheduler, spark: SparkSession, tmp_path: Path
) -> None:
    table, path = f"sales_{os.getpid()}", tmp_path / "by_region"
    report = scheduler.run_waves(
        [
            [
                {
                    "kind": "spark_sql",
                    "sql": "SELECT id, id % 3 AS region, id * 10 AS amount FROM range(30)",
                    "output": {"table": table, "mode": "overwrite"},
                }
            ],
            [
                {
                    "kind": "spark_sql",
                    "sql": f"SELECT region, sum(amount) AS amount FROM {table} GROUP BY region",
                    "output": {"path": str(path), "format": "parquet", "mode": "overwrite"},
                }
            ],
        ]
    )
    assert report.ok, [c.error for c in report.completions]
    assert report.completions[0].result == {
        "statements": 1,
        "output": {"table": table, "mode": "overwrite"},
    }
    written = {r["region"]: r["amount"] for r in spark.read.parquet(str(path)).collect()}
    assert written == {0: 1350, 1: 1450, 2: 1550}


def test_a_failing_statement_is_a_failed_result_with_sparks_message(
    scheduler: TaskScheduler,
) -> None:
    report = scheduler.run_waves(
        [
            [
                {
                    "kind": "spark_sql",
                    "name": "broken",
                    "sql": ["SELECT 1", "SELECT * FROM no_such_table_anywhere"],
                },
                {"kind": "spark_sql", "name": "syntax", "sql": "SELEC oops"},
            ]
        ],
        policy="continue",
    )
    by_name = {c.task_name: c for c in report.completions}
    broken, syntax = by_name["broken"], by_name["syntax"]
    assert broken.status == syntax.status == "FAILED"
    assert broken.error is not None and syntax.error is not None
    first_line = broken.error.splitlines()[0]
    assert first_line.startswith("SparkSqlError: statement 2 of 2 failed: AnalysisException")
    assert "TABLE_OR_VIEW_NOT_FOUND" in first_line and "no_such_table_anywhere" in first_line
    assert "PARSE_SYNTAX_ERROR" in syntax.error.splitlines()[0]
    row = log_row(scheduler.broker, broken.log_id)
    assert row["status"] == "FAILED" and "TABLE_OR_VIEW_NOT_FOUND" in row["error"]


@pytest.mark.parametrize(
    ("task", "complaint"),
    [
        ({"kind": "spark_sql", "sql": []}, "field 'sql' must be a statement"),
        ({"kind": "spark_sql", "sql": "SELECT 1", "collect": -1}, "field 'collect'"),
        (
            {"kind": "spark_sql", "sql": "SELECT 1", "output": {"table": "t", "path": "p"}},
            "exactly one",
        ),
        ({"kind": "spark_sql", "sql": "SELECT 1", "output": {"table": "t", "mode": "x"}}, "mode"),
        (
            {"kind": "spark_sql", "sql": "SELECT 1", "statement": "x"},
            "unknown field(s) ['statement']",
        ),
        ({"kind": "pyspark", "callable": "nodots"}, "field 'callable'"),
        ({"kind": "pyspark", "callable": "a.b", "kwargs": []}, "field 'kwargs'"),
        ({"kind": "spark_submit"}, "field 'application'"),
        (
            {"kind": "spark_submit", "application": "a.py", "num_executors": "2"},
            "'num_executors' must be int",
        ),
    ],
)
def test_malformed_spark_tasks_are_refused_before_anything_is_sent(
    spark_broker: Broker, task: dict[str, Any], complaint: str
) -> None:
    from scheduler_lib.scheduler import Target, init
    from scheduler_lib.spark.worker import KINDS

    init(spark_broker, targets=[Target(kinds=KINDS, activation=False)])
    scheduler = TaskScheduler(spark_broker)
    with pytest.raises(InvalidTask, match=re.escape(complaint)):
        scheduler.run_waves([[task]])
    assert spark_broker.peek("QueueAsyncTarget") == []


# --- pyspark -------------------------------------------------------------------------


def test_pyspark_calls_the_function_with_the_session_and_arguments(
    scheduler: TaskScheduler,
) -> None:
    report = scheduler.run_waves(
        [
            [
                {
                    "kind": "pyspark",
                    "callable": "spark_tasks:squares",
                    "args": [3],
                    "kwargs": {"offset": 2},
                },
                {
                    "kind": "pyspark",
                    "name": "boom",
                    "callable": "spark_tasks:fail",
                    "args": ["no luck"],
                },
            ]
        ],
        policy="continue",
    )
    squares, boom = report.completions if report.completions[0].ok else report.completions[::-1]
    assert squares.result == {
        "columns": ["x", "sq"],
        "rows": [{"x": 2, "sq": 4}, {"x": 3, "sq": 9}, {"x": 4, "sq": 16}],
    }
    assert boom.status == "FAILED" and boom.error.startswith("RuntimeError: no luck")


# --- pools from priorities --------------------------------------------------------------


def _rest(spark: SparkSession, path: str) -> Any:
    sc = spark.sparkContext
    url = f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}{path}"
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.mark.parametrize("level", [9, 2])
def test_jobs_run_in_the_fair_pool_of_their_conversation_priority(
    scheduler: TaskScheduler, spark: SparkSession, level: int
) -> None:
    scheduler.broker.create_priority("urgent", contract="AsyncContract", level=level)
    # Each test's database numbers its tasks from 1: only this test's jobs count.
    before = max((j["jobId"] for j in _rest(spark, "/jobs")), default=-1)
    report = scheduler.run_waves(
        [[{"kind": "pyspark", "callable": "spark_tasks:local_properties"}]]
    )
    [done] = report.completions
    group = job_group(done.log_id)
    assert done.result == {"pool": f"priority_{level}", "job_group": group, "count": 10}
    assert pool_for(level) == f"priority_{level}"
    # What Spark recorded for the job: its group, and its stages' scheduling pool.
    jobs = poll(
        lambda: [
            j for j in _rest(spark, "/jobs") if j.get("jobGroup") == group and j["jobId"] > before
        ],
        "the task's job in the Spark UI's REST API",
    )
    stage_ids = {s for j in jobs for s in j["stageIds"]}
    attempts = [a for stage in stage_ids for a in _rest(spark, f"/stages/{stage}")]
    # (A stage skipped because its shuffle output existed never ran, in no pool.)
    pools = {a["schedulingPool"] for a in attempts if a["status"] != "SKIPPED"}
    assert pools == {f"priority_{level}"}, [
        (a["stageId"], a["status"], a["schedulingPool"]) for a in attempts
    ]


def test_the_worker_session_has_one_weighted_fair_pool_per_priority_level(
    spark: SparkSession,
) -> None:
    assert spark.conf.get("spark.scheduler.mode") == "FAIR"
    allocation = Path(spark.conf.get("spark.scheduler.allocation.file")).read_text()
    for level in range(1, 11):
        assert (
            f'<pool name="priority_{level}"><schedulingMode>FAIR</schedulingMode>'
            f"<weight>{level}</weight>" in allocation
        )


# --- cancel ----------------------------------------------------------------------------


def _active_jobs(spark: SparkSession, group: str) -> list[int]:
    tracker = spark.sparkContext.statusTracker()
    active = set(tracker.getActiveJobsIds())
    return [j for j in tracker.getJobIdsForGroup(group) if j in active]


def test_fail_fast_cancels_a_running_spark_job_through_its_job_group(
    scheduler: TaskScheduler, spark: SparkSession
) -> None:
    # The long job must be running on Spark before the failure: the failing task is sent
    # once it is.
    started = time.monotonic()
    handle = scheduler.get_scheduler()
    [long_id] = scheduler.exec_many(
        handle, [{"kind": "spark_sql", "name": "endless", "sql": ENDLESS}], wave=1
    )
    group = job_group(long_id)
    poll(lambda: _active_jobs(spark, group), "the endless job to run on Spark")
    scheduler.exec_many(
        handle,
        [{"kind": "pyspark", "name": "boom", "callable": "spark_tasks:fail", "args": ["x"]}],
        wave=1,
    )
    first = scheduler.synchronization(handle, timeout=DEADLINE)
    assert (first.task_name, first.status) == ("boom", "FAILED")
    assert scheduler.cancel(handle, "cancelled: task boom failed") == (0, 1)
    second = scheduler.synchronization(handle, timeout=DEADLINE)
    assert second.log_id == long_id and second.status == "CANCELLED"
    assert second.error.startswith("cancelled: task boom failed (it was running: SparkSqlError")
    assert not _active_jobs(spark, group)
    row = log_row(scheduler.broker, long_id)
    assert row["status"] == "CANCELLED" and row["cancel_requested_at"] is not None
    scheduler.release_scheduler(handle)
    assert time.monotonic() - started < DEADLINE


def test_run_waves_fail_fast_stops_the_running_tasks_of_the_wave(
    scheduler: TaskScheduler, spark: SparkSession
) -> None:
    started = time.monotonic()
    with pytest.raises(WaveFailed) as failed:
        scheduler.run_waves(
            [
                [
                    {"kind": "spark_sql", "name": "endless", "sql": ENDLESS},
                    {"kind": "spark_sql", "name": "broken", "sql": "SELECT * FROM missing_table_x"},
                ],
                [{"kind": "spark_sql", "name": "never", "sql": "SELECT 1"}],
            ]
        )
    report = failed.value.report
    assert report is not None
    by_name = {c.task_name: c for c in report.completions}
    assert {n: c.status for n, c in by_name.items()} == {
        "broken": "FAILED",
        "endless": "CANCELLED",
    }
    assert [t.name for t in report.waves[1].not_sent] == ["never"]
    assert time.monotonic() - started < DEADLINE
    endless = by_name["endless"].log_id
    assert endless is not None
    poll(lambda: not _active_jobs(spark, job_group(endless)), "the endless job to stop")


def test_release_cancels_a_running_job(scheduler: TaskScheduler, spark: SparkSession) -> None:
    handle = scheduler.get_scheduler()
    [log_id] = scheduler.exec_many(handle, [{"kind": "spark_sql", "sql": ENDLESS}])
    group = job_group(log_id)
    poll(lambda: _active_jobs(spark, group), "the endless job to run on Spark")
    scheduler.release_scheduler(handle)
    poll(lambda: not _active_jobs(spark, group), "the released scheduler's job to be cancelled")
    row = poll(
        lambda: (r := log_row(scheduler.broker, log_id))["end_time"] is not None and r,
        "the task's row to end",
    )
    assert row["status"] == "CANCELLED"
    assert row["error"].startswith("cancelled: the scheduler was released")


# --- spark_submit ------------------------------------------------------------------------

APPLICATION = textwrap.dedent(
    """
    import sys
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.getOrCreate()
    total = spark.range(int(sys.argv[2])).groupBy().sum("id").collect()[0][0]
    with open(sys.argv[1], "w") as out:
        out.write(f"{total} {spark.sparkContext.master}")
    spark.stop()
    sys.exit(int(sys.argv[3]))
    """
)


def test_spark_submit_runs_an_application_to_completion(
    scheduler: TaskScheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflow"))
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_LOCAL_ONE", json.dumps({"conn_type": "spark", "host": "local[1]"})
    )
    # spark-submit comes with pyspark, next to this interpreter.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    app = tmp_path / "tiny_app.py"
    app.write_text(APPLICATION)
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    report = scheduler.run_waves(
        [
            [
                {
                    "kind": "spark_submit",
                    "name": "tiny",
                    "application": str(app),
                    "application_args": [str(good), 100, 0],
                    "conn_id": "spark_local_one",
                    "conf": {"spark.ui.enabled": "false"},
                },
                {
                    "kind": "spark_submit",
                    "name": "exits 3",
                    "application": str(app),
                    "application_args": [str(bad), 10, 3],
                    "conn_id": "spark_local_one",
                    "conf": {"spark.ui.enabled": "false"},
                },
                {
                    "kind": "spark_submit",
                    "name": "no connection",
                    "application": str(app),
                    "conn_id": "no_such_spark_connection",
                },
            ]
        ],
        policy="continue",
    )
    by_name = {c.task_name: c for c in report.completions}
    assert by_name["tiny"].ok, by_name["tiny"].error
    assert good.read_text() == "4950 local[1]"  # it ran, on the connection's master
    assert by_name["exits 3"].status == "FAILED"
    assert "Error code is: 3" in by_name["exits 3"].error
    assert bad.read_text() == "45 local[1]"  # it ran, and its failure was tracked
    missing = by_name["no connection"]
    assert missing.status == "FAILED"
    assert "no_such_spark_connection" in missing.error and "YARN" in missing.error
    row = log_row(scheduler.broker, by_name["tiny"].log_id)
    assert row["spark_job_group"] == f"spark_submit-{by_name['tiny'].log_id}"


# --- the worker -------------------------------------------------------------------------


def test_a_spark_task_outside_a_worker_says_where_it_runs() -> None:
    previous = sessions._session
    sessions.use(None)
    try:
        with pytest.raises(sessions.NoSparkSession, match="scheduler-lib worker"):
            sessions.current()
    finally:
        sessions.use(previous)


def test_worker_settings_are_checked(spark_broker: Broker) -> None:
    from scheduler_lib.broker import InvalidArgument

    with pytest.raises(InvalidArgument, match="max_readers must be an integer >= 1, got 0"):
        Worker(spark_broker, max_readers=0)
    with pytest.raises(InvalidArgument, match="launch_command must be a non-empty argv list"):
        Worker(spark_broker, launch_command="spark-submit app.py")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="idle_exit must be > 0"):
        Worker(spark_broker, idle_exit=0)
    with pytest.raises(InvalidArgument, match="queue_readers must be an integer >= 1, got 0"):
        Worker(spark_broker, queue_readers=0)
    with pytest.raises(InvalidArgument, match=re.escape("--conf takes key=value, got 'spark.x'")):
        sessions.parse_conf(["spark.x"])


@pytest.mark.parametrize(("queue_readers", "expected"), [(None, 2), (6, 6)])
def test_a_worker_caps_its_queue_at_queue_readers_for_all_its_workers(
    spark_broker: Broker, spark: SparkSession, queue_readers: int | None, expected: int
) -> None:
    # Several workers on one queue: each runs max_readers, the queue takes queue_readers
    w = Worker(spark_broker, spark=spark, max_readers=2, queue_readers=queue_readers).start()
    try:
        (queue,) = [q for q in spark_broker.queues() if q.name == w.queue]
        assert queue.max_readers == expected
    finally:
        w.stop()


def test_readers_are_threads_of_the_driver_up_to_its_cap(
    worker: Worker, scheduler: TaskScheduler
) -> None:
    report = scheduler.run_waves(
        [[{"kind": "pyspark", "callable": "spark_tasks:hold", "args": [1.5]} for _ in range(4)]]
    )
    assert report.ok
    with scheduler.broker.transaction() as tx:
        log = tx.fetch("log_of_scheduler", handle=str(report.scheduler_handle))
    readers = {r["worker_id"].split(":")[2] for r in log}
    assert len(readers) == 2  # max_readers=2: two threads shared the four tasks
    spans = sorted((r["start_time"], r["end_time"]) for r in log)
    assert spans[0][1] > spans[1][0]  # the first two ran at the same time


def test_a_priority_for_one_initiator_service_raises_only_its_schedulers(
    spark_broker: Broker,
) -> None:
    # The per-initiator form docs/spark.md shows: only "urgent" schedulers get level 9,
    # so only their tasks go to the priority_9 pool.
    from scheduler_lib.scheduler import Names, Target, init

    init(spark_broker, targets=[Target(activation=False)])
    spark_broker.create_queue("UrgentInitiatorQueue")
    spark_broker.create_service("UrgentInitiator", "UrgentInitiatorQueue")
    spark_broker.create_priority(
        "urgent",
        contract="AsyncContract",
        local_service="ServiceAsyncTarget",
        remote_service="UrgentInitiator",
        level=9,
    )
    urgent = TaskScheduler(
        spark_broker,
        names=Names(initiator_queue="UrgentInitiatorQueue", initiator_service="UrgentInitiator"),
    )
    usual = TaskScheduler(spark_broker)
    urgent.exec_async(urgent.get_scheduler(), {"kind": "sql", "sql": "SELECT 1"})
    usual.exec_async(usual.get_scheduler(), {"kind": "sql", "sql": "SELECT 2"})
    levels = [m.priority for m in spark_broker.peek("QueueAsyncTarget")]
    assert [pool_for(level) for level in levels] == ["priority_9", "priority_5"]
