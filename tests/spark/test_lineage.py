"""OpenLineage events of Spark tasks, through the client's file transport, on the tests'
Spark worker: the batch-ETL DAG's Spark SQL waves (START and COMPLETE, the tables each
task read and wrote, the parent run of the Airflow task instance that sent it), a
failing task's FAIL, a pyspark callable's run, and nothing at all without settings."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from multiproc import poll

from scheduler_lib.scheduler import TaskScheduler
from scheduler_lib.spark import lineage
from tests.etl_lineage import ETL_LINEAGE

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEADLINE = 60.0
DAGS = Path(__file__).resolve().parents[2] / "dags"
DAY = "20260301"
# The Airflow task instance that sends the tasks, as the operators carry it (the values
# of Airflow's OpenLineage macros for it)
SENDER = {
    "dag_id": "scheduler_lib_batch_etl",
    "run_id": "scheduled__2026-03-01T00:00:00+00:00",
    "task_id": "etl.load",
    "try_number": 1,
    "map_index": -1,
    "lineage_job_namespace": "airflow-prod",
    "lineage_job_name": "scheduler_lib_batch_etl.etl.load",
    "lineage_run_id": "019ca74e-1a00-7c1e-9d3c-1b5ad9a4b6f0",
    "lineage_root_job_namespace": "airflow-prod",
    "lineage_root_job_name": "scheduler_lib_batch_etl",
    "lineage_root_run_id": "019ca74e-1a00-7f00-8a6b-0c5d2e7f9a11",
}


@pytest.fixture
def events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """OpenLineage on, with the file transport (one event a line) into the test's file."""
    path = tmp_path / "lineage.jsonl"
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__TYPE", "file")
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__LOG_FILE_PATH", str(path))
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__APPEND", "true")
    monkeypatch.setenv("OPENLINEAGE_NAMESPACE", "spark-prod")
    lineage.reset()
    yield path
    monkeypatch.undo()
    lineage.reset()


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def runs(path: Path, count: int) -> dict[str, list[dict[str, Any]]]:
    """The events of each job (by name), once ``count`` runs have ended."""

    def ended() -> list[dict[str, Any]] | None:
        got = read(path)
        return got if sum(e["eventType"] != "START" for e in got) >= count else None

    by_job: dict[str, list[dict[str, Any]]] = {}
    for event in poll(ended, DEADLINE, f"{count} runs ended"):
        by_job.setdefault(event["job"]["name"], []).append(event)
    return by_job


def etl_waves() -> list[list[dict[str, Any]]]:
    """The batch-ETL DAG's waves, rendered for one day (its templates name the day)."""
    pytest.importorskip("airflow", reason="the DAG file imports Airflow")
    sys.path.insert(0, str(DAGS))
    try:
        import batch_etl
    finally:
        sys.path.remove(str(DAGS))

    def render(task: dict[str, Any]) -> dict[str, Any]:
        sql = [
            s.replace(batch_etl.DAY, DAY).replace(batch_etl.DATE, "2026-03-01") for s in task["sql"]
        ]
        return {**task, "sql": sql}

    return [
        [render(t) for t in wave]
        for wave in (batch_etl.LOAD, batch_etl.TRANSFORM, batch_etl.AGGREGATE, batch_etl.REPORT)
    ]


def tables(datasets: list[dict[str, Any]]) -> list[str]:
    """The catalog names of datasets (their symlinks), sorted."""
    return sorted(
        i["name"]
        for d in datasets
        for i in d.get("facets", {}).get("symlinks", {}).get("identifiers", [])
    )


def test_the_etl_dags_spark_sql_tasks_emit_their_tables_and_airflow_parent(
    events: Path, scheduler: TaskScheduler, spark: SparkSession
) -> None:
    # Given OpenLineage's file transport, and the Airflow task instance that sends
    sender = TaskScheduler(scheduler.broker, context=SENDER)
    # When the batch-ETL DAG's waves of Spark SQL run on the worker
    report = sender.run_waves(etl_waves())
    assert report.ok, [c.error for c in report.failures]
    by_job = runs(events, 8)
    # Then each task's run has a START and a COMPLETE, one run id, in the spark-prod
    # namespace, its job named by the target service and the task's name
    service = scheduler.target
    names = {
        "load orders", "load customers", "load products", "load returns",
        "enrich orders", "net returns", "daily sales", "sales report",
    }  # fmt: skip
    assert set(by_job) == {f"{service}.{n}" for n in names}
    for job, got in by_job.items():
        assert [e["eventType"] for e in got] == ["START", "COMPLETE"], job
        assert {e["job"]["namespace"] for e in got} == {"spark-prod"}
        assert len({e["run"]["runId"] for e in got}) == 1, job
        # ... the parent facet naming the Airflow task instance's run, and its DAG run
        for event in got:
            parent = event["run"]["facets"]["parent"]
            assert parent["run"]["runId"] == SENDER["lineage_run_id"], job
            assert (parent["job"]["namespace"], parent["job"]["name"]) == (
                "airflow-prod",
                "scheduler_lib_batch_etl.etl.load",
            )
            assert parent["root"]["run"]["runId"] == SENDER["lineage_root_run_id"]
            assert parent["root"]["job"]["name"] == "scheduler_lib_batch_etl"
    # ... and on COMPLETE the tables each task read and wrote, where the warehouse holds
    # them (named by location, the catalog's name as a symlink)
    completed = {job.split(".", 1)[1]: got[-1] for job, got in by_job.items()}
    # (Spark says its warehouse as a URI: file:/...)
    warehouse = Path((spark.conf.get("spark.sql.warehouse.dir") or "").removeprefix("file:"))
    for name, (read_tables, written) in ETL_LINEAGE.items():
        event = completed[name]
        assert tables(event["inputs"]) == [f"default.{t}_{DAY}" for t in read_tables], name
        assert tables(event["outputs"]) == [f"default.{t}_{DAY}" for t in written], name
        for dataset in event["inputs"] + event["outputs"]:
            assert dataset["namespace"] == "file"
            assert Path(dataset["name"]).parent == warehouse, dataset
            [symlink] = dataset["facets"]["symlinks"]["identifiers"]
            assert symlink["namespace"] == f"file:{warehouse}" and symlink["type"] == "TABLE"
    # ... with the statements as the job's SQL
    assert f"raw_orders_{DAY}" in completed["enrich orders"]["job"]["facets"]["sql"]["query"]


def test_a_failing_task_emits_fail_with_its_error(
    events: Path, scheduler: TaskScheduler, spark: SparkSession
) -> None:
    # Given a table, and a task that writes one from it and then fails
    spark.sql("CREATE OR REPLACE TEMP VIEW unused AS SELECT 1")
    task = {
        "kind": "spark_sql",
        "name": "broken",
        "sql": [
            "DROP TABLE IF EXISTS lineage_src",
            "CREATE TABLE lineage_src USING parquet AS SELECT id FROM range(3)",
            "SELECT * FROM no_such_table",
        ],
    }
    # When it runs
    report = TaskScheduler(scheduler.broker, context=SENDER).run_waves([[task]], policy="continue")
    [done] = report.completions
    assert done.status == "FAILED"
    # Then its run ends with FAIL, Spark's error as its errorMessage, the table it wrote
    [got] = runs(events, 1).values()
    assert [e["eventType"] for e in got] == ["START", "FAIL"]
    message = got[-1]["run"]["facets"]["errorMessage"]["message"]
    assert "no_such_table" in message and "SparkSqlError" in message
    assert tables(got[-1]["outputs"]) == ["default.lineage_src"]
    assert got[-1]["run"]["facets"]["parent"]["run"]["runId"] == SENDER["lineage_run_id"]


def test_a_cancelled_task_emits_abort(events: Path, scheduler: TaskScheduler) -> None:
    # Given a task that runs until it is cancelled, and has begun (its START is out)
    endless = "SELECT sum(hash(id)) AS h FROM range(0, 400000000000)"
    handle = scheduler.get_scheduler()
    scheduler.exec_many(handle, [{"kind": "spark_sql", "name": "endless", "sql": endless}])
    poll(lambda: read(events), DEADLINE, "the task's START")
    # When its scheduler cancels it
    scheduler.cancel(handle, "cancelled: by the test")
    done = scheduler.synchronization(handle, timeout=DEADLINE)
    scheduler.release_scheduler(handle)
    assert done.status == "CANCELLED", done
    # Then its run ends with ABORT, not FAIL
    [got] = runs(events, 1).values()
    assert [e["eventType"] for e in got] == ["START", "ABORT"]
    assert "errorMessage" in got[-1]["run"]["facets"]


def test_a_pyspark_task_and_an_output_field_have_their_runs(
    events: Path, scheduler: TaskScheduler, tmp_path: Path
) -> None:
    # Given a sender without Airflow
    out = tmp_path / "squares"
    waves = [
        [
            {"kind": "pyspark", "name": "squares", "callable": "spark_tasks:squares", "args": [3]},
            {
                "kind": "spark_sql",
                "name": "export",
                "sql": "SELECT id FROM range(5)",
                "output": {"path": str(out), "format": "parquet", "mode": "overwrite"},
            },
        ],
        [
            {
                "kind": "spark_sql",
                "name": "import",
                "sql": f"SELECT count(*) AS n FROM parquet.`{out}`",
            }
        ],
    ]
    # When its tasks run
    report = scheduler.run_waves(waves)
    assert report.ok, [c.error for c in report.failures]
    by_job = {job.split(".", 1)[1]: got for job, got in runs(events, 3).items()}
    # Then each has its run, without a parent (no Airflow sent it)
    for got in by_job.values():
        assert [e["eventType"] for e in got] == ["START", "COMPLETE"]
        assert "parent" not in got[-1]["run"]["facets"]
    # ... the pyspark callable's without datasets (Python sees no plans), the output path
    # written, then read by path
    assert by_job["squares"][-1]["inputs"] == by_job["squares"][-1]["outputs"] == []
    written = [(d["namespace"], d["name"]) for d in by_job["export"][-1]["outputs"]]
    assert written == [("file", str(out))]
    read_back = [(d["namespace"], d["name"]) for d in by_job["import"][-1]["inputs"]]
    assert read_back == [("file", str(out))]


def test_without_settings_no_client_and_no_events(
    scheduler: TaskScheduler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given no OpenLineage settings at all (none in the environment, no openlineage.yml)
    for name in list(os.environ):
        if name.startswith("OPENLINEAGE"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    lineage.reset()
    # When a Spark task runs
    report = scheduler.run_waves([[{"kind": "spark_sql", "sql": "SELECT 1 AS one"}]])
    # Then it ran, and no client was made (nothing printed to the console instead)
    assert report.ok
    assert lineage.emitter() is None


def test_a_transport_that_fails_costs_the_task_nothing_and_warns_once(
    scheduler: TaskScheduler,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given the file transport writing under a path that is a file, not a folder
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__TYPE", "file")
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__LOG_FILE_PATH", str(tmp_path / "a_file" / "x"))
    monkeypatch.setenv("OPENLINEAGE__TRANSPORT__APPEND", "true")
    lineage.reset()
    try:
        # When two tasks run (four events that cannot be written)
        with caplog.at_level(logging.DEBUG, logger=lineage.__name__):
            report = scheduler.run_waves([[{"kind": "spark_sql", "sql": "SELECT 1 AS one"}] * 2])
            lineage.reset()  # sends (tries to) what waits
        # Then the tasks succeeded, and one WARNING says it, the others are DEBUG
        assert report.ok, [c.error for c in report.failures]
        said = [r for r in caplog.records if r.name == lineage.__name__]
        assert [r.levelno for r in said].count(logging.WARNING) == 1, said
        assert len(said) >= 2, said
    finally:
        lineage.reset()


def test_datasets_are_named_as_openlineage_names_files() -> None:
    assert lineage.dataset_id("file:/wh/t") == ("file", "/wh/t")
    assert lineage.dataset_id("/wh/t/") == ("file", "/wh/t")
    assert lineage.dataset_id("hdfs://nn:8020/wh/t") == ("hdfs://nn:8020", "/wh/t")
    assert lineage.dataset_id("s3a://bucket/wh/t") == ("s3://bucket", "wh/t")
    assert lineage.dataset_id("gs://bucket/wh/t") == ("gs://bucket", "wh/t")


def test_the_parent_needs_the_senders_run_and_takes_its_root() -> None:
    pytest.importorskip("openlineage.client")
    assert lineage.parent_facet({"dag_id": "etl", "task_id": "t"}) is None  # no provider
    parent = lineage.parent_facet(SENDER)
    assert (parent.job.namespace, parent.job.name) == ("airflow-prod", SENDER["lineage_job_name"])
    assert parent.run.runId == SENDER["lineage_run_id"]
    assert parent.root.run.runId == SENDER["lineage_root_run_id"]
    without_root = {k: v for k, v in SENDER.items() if not k.startswith("lineage_root")}
    assert lineage.parent_facet(without_root).root is None
