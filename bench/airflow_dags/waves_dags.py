"""The DAGs of ``bench.airflow_waves``: the same 50 Spark SQL statements in 5 waves of 10,
three ways, in one ``airflow standalone``.

- ``bench_waves_ours``: one :class:`~scheduler_lib.airflow.OrderedWavesOperator`
  (``deferrable=False``) sends the waves to a scheduler_lib Spark worker (connection
  ``scheduler_lib_default``);
- ``bench_waves_ours_group``: :func:`~scheduler_lib.airflow.ordered_waves`, the task
  group form: get_scheduler, per wave one ExecAsync that sends and waits (deferrable),
  release (7 Airflow tasks);
- ``bench_waves_native``: plain Airflow, one task per statement with the Spark
  provider's ``@task.pyspark`` on a Spark Connect server (connection
  ``bench_spark_connect``), consecutive waves joined by ``cross_downstream``.
"""

from __future__ import annotations

import datetime
import itertools
from typing import Any

from airflow.sdk import DAG, cross_downstream, task
from waves_workload import (  # the DAGs folder is on sys.path
    GROUP_DAG_ID,
    NATIVE_DAG_ID,
    OURS_DAG_ID,
    SPARK_CONNECT_CONN_ID,
    spark_sql_waves,
    statements,
)

from scheduler_lib.airflow import OrderedWavesOperator, ordered_waves

COMMON: dict[str, Any] = {
    "schedule": None,
    "start_date": datetime.datetime(2026, 1, 1),
    "catchup": False,
    "max_active_runs": 1,
    "tags": ["scheduler_lib", "bench"],
}

with DAG(dag_id=OURS_DAG_ID, description="50 Spark SQL statements, 5 waves: one task", **COMMON):
    OrderedWavesOperator(task_id="waves", waves=spark_sql_waves(), deferrable=False)

with DAG(
    dag_id=GROUP_DAG_ID, description="50 Spark SQL statements, 5 waves: a task group", **COMMON
):
    ordered_waves(spark_sql_waves(), group_id="waves", deferrable=True)


@task.pyspark(conn_id=SPARK_CONNECT_CONN_ID)
def statement(sql: str, spark: Any = None) -> list[list[Any]]:
    """One statement on the Spark Connect session the provider opens for the task."""
    return [list(row) for row in spark.sql(sql).collect()]


with DAG(
    dag_id=NATIVE_DAG_ID,
    description="50 Spark SQL statements, 5 waves: one Airflow task each",
    **COMMON,
):
    waves = [
        [
            statement.override(task_id=f"wave_{w}_statement_{i}")(sql)
            for i, sql in enumerate(wave, start=1)
        ]
        for w, wave in enumerate(statements(), start=1)
    ]
    for before, after in itertools.pairwise(waves):
        cross_downstream(before, after)
