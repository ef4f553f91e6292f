"""The example DAGs, run with ``dag.test()`` against a migrated Airflow home, on a real
Spark worker process, on SQLite and PostgreSQL; then the operators' ways to end — a
failed task fails its sensor (and the DAG run) while the release still runs, and one
``OrderedWavesOperator`` runs a plan in place or deferring between waves.

Given / When / Then in each test's comments; every figure read back from the broker's
``execution_log`` (what the executors recorded), not from Airflow's own bookkeeping.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from multiproc import poll

from scheduler_lib.broker import Broker, activation
from scheduler_lib.scheduler import catalog, init
from tests.etl_lineage import ETL_LINEAGE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dags(airflow_home: Path, parse_dags: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """The DAGs of the tests' DAG folder (``dags/`` and the tests' own)."""
    return parse_dags(airflow_home / "dags")


@pytest.fixture
def broker(scheduler_lib_conn: str) -> Iterator[Broker]:
    """The test's broker, with the scheduler's catalog."""
    with Broker(scheduler_lib_conn) as b:
        init(b)
        yield b


def log_rows(broker: Broker, run_id: str) -> list[dict[str, Any]]:
    return [dict(r) for r in broker.fetch("log_recent", limit=1000) if r["run_id"] == run_id]


def states(run: Any) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in run.get_task_instances()}


def released(broker: Broker, handle: str) -> bool:
    """The scheduler's conversation is gone on both sides, once the target's reader has
    taken the release's EndDialog (a reader must still be running: waits for it)."""
    poll(
        lambda: all(str(e.conversation_handle) != handle for e in broker.conversation_endpoints()),
        30,
        f"the scheduler's conversation {handle} ended on both sides",
    )
    return True


def test_example_dags_run_on_a_spark_worker(
    dags: dict[str, Any], spark_worker: Any, scheduler_lib_conn: str, tmp_path: Path
) -> None:
    # Given a Spark worker serving the broker of the scheduler_lib_default connection
    with Broker(scheduler_lib_conn) as broker:
        catalog.prepare(broker)  # not init(): the worker made the target a Spark one
        # When the blog's DAG runs
        run = dags["scheduler_lib_blog_waves"].test()
        # Then it succeeded, and each of its waves ran after the one before
        assert run.state == "success", states(run)
        rows = sorted(log_rows(broker, run.run_id), key=lambda r: r["log_id"])
        assert [r["wave"] for r in rows] == [1, 1, 1, 1, 2, 2, 3, 4, 4, 5]
        assert {r["status"] for r in rows} == {"SUCCEEDED"}
        assert {r["dag_id"] for r in rows} == {"scheduler_lib_blog_waves"}
        assert [r["task_id"] for r in rows][:5] == ["exec_async_1"] * 4 + ["exec_async_2"]
        for wave in range(2, 6):
            ended = max(r["end_time"] for r in rows if r["wave"] == wave - 1)
            started = min(r["start_time"] for r in rows if r["wave"] == wave)
            assert started >= ended, f"wave {wave} started before wave {wave - 1} ended"
        # ... on the Spark worker (its worker id names the application)
        assert all(r["worker_id"].rsplit(":", 1)[1].startswith("local-") for r in rows)
        assert released(broker, rows[0]["scheduler_handle"])

        # When the batch-ETL DAG runs (Spark SQL, templated with the run's date)
        etl = dags["scheduler_lib_batch_etl"]
        run = etl.test(logical_date=datetime.datetime(2026, 3, 1, tzinfo=datetime.timezone.utc))
        # Then its four waves ran in order and the report adds up to the generated orders
        assert run.state == "success", states(run)
        rows = sorted(log_rows(broker, run.run_id), key=lambda r: r["log_id"])
        assert [r["task_id"] for r in rows] == ["etl.load"] * 4 + ["etl.transform"] * 2 + [
            "etl.aggregate",
            "etl.report",
        ]
        assert {r["status"] for r in rows} == {"SUCCEEDED"}, [r["error"] for r in rows]
        assert "raw_orders_20260301" in json.loads(rows[0]["task_body"])["sql"][1]
        report = json.loads(rows[-1]["result"])["rows"]
        assert [r["region"] for r in report] == ["east", "north", "south", "west"]
        assert sum(r["orders"] for r in report) == 60_000
        assert all(r["revenue"] > 0 for r in report)
        assert all(r["spark_job_group"] == f"scheduler_lib-{r['log_id']}" for r in rows)
        # ... and each Spark task's OpenLineage run went out: its tables, and as parent the
        # OpenLineage run Airflow's provider gives the task instance that sent it
        check_lineage(tmp_path / "lineage.jsonl", run, rows)  # (spark_worker's file)

        # And a run triggered without a logical date (Airflow 3's REST API and UI may leave
        # it out: `ds` and `logical_date` are then undefined) succeeds too, its tables
        # named after the instant it was triggered for
        run = etl.test(logical_date=None)
        assert run.state == "success", states(run)
        rows = sorted(log_rows(broker, run.run_id), key=lambda r: r["log_id"])
        assert {r["status"] for r in rows} == {"SUCCEEDED"}, [r["error"] for r in rows]
        instant = run.run_after.strftime("%Y%m%dT%H%M%S")
        assert f"raw_orders_{instant} " in json.loads(rows[0]["task_body"])["sql"][1]


def check_lineage(path: Path, run: Any, rows: list[dict[str, Any]]) -> None:
    """The Spark worker's OpenLineage events of the ETL DAG's run ``run``: one START and
    one COMPLETE per task, its tables, and its parent: the OpenLineage run of the Airflow
    task instance that sent it, as the provider's listener names it."""
    from airflow.providers.openlineage import conf as ol_conf
    from airflow.providers.openlineage.utils.utils import (
        build_dag_run_ol_run_id,
        build_task_instance_ol_run_id,
    )

    def tags(event: dict[str, Any]) -> dict[str, str]:
        return {t["key"]: t["value"] for t in event["run"]["facets"]["tags"]["tags"]}

    def ended() -> list[dict[str, Any]] | None:
        events = [json.loads(line) for line in path.read_text().splitlines()]
        mine = [e for e in events if tags(e).get("airflow.run_id") == run.run_id]
        return mine if sum(e["eventType"] != "START" for e in mine) >= len(rows) else None

    events = poll(ended, 60, "the ETL run's lineage events")
    by_log_id: dict[int, list[dict[str, Any]]] = {}
    for event in events:
        by_log_id.setdefault(int(tags(event)["scheduler_lib.log_id"]), []).append(event)
    assert set(by_log_id) == {r["log_id"] for r in rows}
    instances = {ti.task_id: ti for ti in run.get_task_instances()}
    day = run.logical_date.strftime("%Y%m%d")
    for row in rows:
        start, end = by_log_id[row["log_id"]]
        assert (start["eventType"], end["eventType"]) == ("START", "COMPLETE"), row
        assert start["run"]["runId"] == end["run"]["runId"]
        assert end["job"]["name"].endswith(f".{row['task_name']}")
        read, written = ETL_LINEAGE[row["task_name"]]
        for datasets, names in ((end["inputs"], read), (end["outputs"], written)):
            got = [i["name"] for d in datasets for i in d["facets"]["symlinks"]["identifiers"]]
            assert sorted(got) == [f"default.{t}_{day}" for t in names], row["task_name"]
        # The sender's try (a retry of a wave sends nothing again: its earlier try sent)
        ti = instances[row["task_id"]]
        sent_by = int(tags(end)["airflow.try_number"])
        assert 1 <= sent_by <= ti.try_number
        parent = end["run"]["facets"]["parent"]
        assert parent["job"]["namespace"] == ol_conf.namespace()
        assert parent["job"]["name"] == f"{run.dag_id}.{row['task_id']}"
        assert parent["run"]["runId"] == build_task_instance_ol_run_id(
            dag_id=run.dag_id,
            task_id=row["task_id"],
            try_number=sent_by,
            logical_date=run.logical_date,
            map_index=ti.map_index,
        )
        assert parent["root"]["job"]["name"] == run.dag_id
        assert parent["root"]["run"]["runId"] == build_dag_run_ol_run_id(
            dag_id=run.dag_id, logical_date=run.logical_date, clear_number=run.clear_number
        )


@pytest.mark.parametrize(
    ("dag_id", "waiter"),
    [
        # the first wave's sensor waits for it (a task of its own)
        ("test_sensor_fails", "plan.wave_1_sync"),
        # each wave is one Airflow task that sends and waits
        ("test_wave_fails", "plan.wave_1"),
    ],
)
def test_a_failed_task_fails_its_wave_and_the_run_and_the_release_still_runs(
    dags: dict[str, Any], broker: Broker, dag_id: str, waiter: str
) -> None:
    # Given two waves whose first has a task that raises
    # When the DAG runs with executors serving the target queue
    with activation.running(broker):
        run = dags[dag_id].test()
        # Then the run failed where the first wave is waited for, the second wave was never
        # sent, and the release (a teardown) ran: the target's reader ends its side too
        got = states(run)
        assert run.state == "failed", got
        assert got[waiter] == "failed"
        assert got["plan.wave_2"] == "upstream_failed"
        assert got["plan.release_scheduler"] == "success"
        rows = {r["task_name"]: r for r in log_rows(broker, run.run_id)}
        assert set(rows) == {"fine", "broken"}
        assert rows["broken"]["status"] == "FAILED"
        assert "ValueError: math domain error" in rows["broken"]["error"]
        assert released(broker, rows["fine"]["scheduler_handle"])


@pytest.mark.parametrize(
    ("dag_id", "waiter"),
    [
        ("test_sensor_reschedule", "wave_1_sync"),
        ("test_sensor_deferrable", "wave_1_sync"),
        ("test_wave_in_place", "wave_1"),
        ("test_wave_deferrable", "wave_1"),
    ],
)
def test_each_way_to_wait_waits(
    dags: dict[str, Any], broker: Broker, dag_id: str, waiter: str
) -> None:
    # Given one wave of two tasks that take a second each
    # When the DAG runs
    with activation.running(broker):
        run = dags[dag_id].test()
    # Then it succeeded only after both tasks ended, and the waiting task returned them
    assert run.state == "success", states(run)
    ti = next(t for t in run.get_task_instances() if t.task_id.endswith(waiter))
    outcome = ti.xcom_pull(task_ids=ti.task_id)
    tasks = outcome if isinstance(outcome, list) else outcome["tasks"]
    assert [t["status"] for t in tasks] == ["SUCCEEDED", "SUCCEEDED"]
    rows = log_rows(broker, run.run_id)
    assert len(rows) == 2 and {r["status"] for r in rows} == {"SUCCEEDED"}
    assert ti.end_date.timestamp() >= max(r["end_time"] for r in rows)


@pytest.mark.parametrize("how", ["in_place", "deferring"])
def test_ordered_waves_operator_runs_a_plan_as_one_task(
    dags: dict[str, Any], broker: Broker, how: str
) -> None:
    # Given three waves, the first long enough to be deferred (defer_after=0.2 s)
    # When the DAG runs
    with activation.running(broker):
        run = dags[f"test_plan_{how}"].test()
        rows = sorted(log_rows(broker, run.run_id), key=lambda r: r["log_id"])
        # (the target's reader ends its side of the released scheduler)
        assert rows and released(broker, rows[0]["scheduler_handle"])
    # Then one Airflow task ran every wave in order on one scheduler, and released it
    assert run.state == "success", states(run)
    assert [r["wave"] for r in rows] == [1, 1, 1, 2, 3]
    assert {r["status"] for r in rows} == {"SUCCEEDED"}
    assert {r["task_id"] for r in rows} == {"plan"}
    assert len({r["scheduler_handle"] for r in rows}) == 1
    assert json.loads(rows[3]["result"]) == 5
    assert min(r["start_time"] for r in rows[3:]) >= max(r["end_time"] for r in rows[:3])
    ti = next(t for t in run.get_task_instances() if t.task_id == "plan")
    assert [len(w) for w in ti.xcom_pull(task_ids="plan")["waves"]] == [3, 1, 1]


def test_ordered_waves_operator_fails_fast_and_cancels_the_rest(
    dags: dict[str, Any], broker: Broker
) -> None:
    # Given a wave where the first task fails at once and six 2 s tasks follow it
    # When it runs on the target's 4 readers (a wave gets its readers at once: the
    # failing task and three others start together; the failing task's reader may take
    # one more before the cancel lands)
    with activation.running(broker):
        run = dags["test_plan_fail_fast"].test()
    # Then the Airflow task failed, the tasks not started were cancelled, and the next
    # wave was never sent
    assert run.state == "failed", states(run)
    rows = {r["task_name"]: r for r in log_rows(broker, run.run_id)}
    assert rows["broken"]["status"] == "FAILED"
    assert "after" not in rows
    others = [rows[f"slow {i}"]["status"] for i in range(6)]
    assert set(others) <= {"CANCELLED", "SUCCEEDED"}, others
    assert others.count("SUCCEEDED") <= 4 and others.count("CANCELLED") >= 2, others
