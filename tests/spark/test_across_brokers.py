"""Spark on the other side: the Airflow side's broker (PostgreSQL) sends waves of Spark
SQL to a Spark worker serving a target service on its own broker (SQLite), linked by the
transport — the layout of a Spark cluster with its own broker database."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from scheduler_lib.broker import Broker
from scheduler_lib.broker.transport import TransportEndpoint
from scheduler_lib.scheduler import Target, TaskScheduler, init
from scheduler_lib.spark import Worker
from scheduler_lib.spark.worker import KINDS as SPARK_KINDS

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

KEY = "spark-side-and-airflow-side-share-this-key"


@pytest.mark.postgres
def test_waves_of_spark_sql_run_on_a_worker_behind_another_broker(
    spark_broker: Broker, postgres_url: str, spark: SparkSession
) -> None:
    options = {"key": KEY, "listen": "127.0.0.1:0", "retry_initial": 0.3, "retry_max": 2.0}
    with (
        Broker(postgres_url) as airflow_side,
        TransportEndpoint(airflow_side, **options) as ea,
        TransportEndpoint(spark_broker, **options) as eb,
        Worker(spark_broker, spark=spark, max_readers=2),
    ):
        # Given the Spark worker's target on its broker, and a route to it on the other
        spark_broker.create_route("to airflow", "ServiceAsyncInitiator", ea.address or "")
        init(airflow_side, targets=[Target(address=eb.address, kinds=list(SPARK_KINDS))])
        view = "CREATE OR REPLACE TEMP VIEW across AS SELECT id FROM range(1000)"
        count = "SELECT count(*) AS n, sum(id) AS total FROM across"
        # When the Airflow side runs two waves: make a view, then read it
        report = TaskScheduler(airflow_side).run_waves(
            [[{"kind": "spark_sql", "sql": view}], [{"kind": "spark_sql", "sql": count}]]
        )
        # Then the second wave saw the first one's work, and the answer came back
        assert report.ok, [c.error for c in report.completions]
        result = report.waves[1].completions[0].result
        assert result["rows"] == [{"n": 1000, "total": 499500}]
        # ... and the Airflow side's log names the Spark application and job group
        rows = airflow_side.fetch("log_of_scheduler", handle=str(report.scheduler_handle))
        assert [r["status"] for r in rows] == ["SUCCEEDED", "SUCCEEDED"]
        application = spark.sparkContext.applicationId
        assert {r["spark_application_id"] for r in rows} == {application}
        assert all(r["spark_job_group"] for r in rows)
        assert all(application in r["worker_id"] for r in rows)
