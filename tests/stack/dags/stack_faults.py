"""The DAGs of tests/stack's fault scenarios (issue 23), parsed by the stack's Airflow.

- ``stack_fault_python``: a wave of four ``python`` tasks that leave a mark and sleep
  (``tests.stack.marks``), then a wave of one: long enough to kill a worker, or restart
  the triggerer and the scheduler, while the first wave runs and its wait is deferred.
- ``stack_fault_spark``: one slow ``spark_sql`` task (its executor sleeps per row), then
  a quick one: long enough to kill the Spark worker its executor runs on.

``policy="continue"``: the tasks of a wave that lost one run to their end (the default,
``fail_fast``, would stop them), so each body runs once unless a retry asks for it.
"""

from __future__ import annotations

import datetime

from airflow.sdk import DAG

from scheduler_lib.airflow import ordered_waves

DEFAULTS = {"retries": 1, "retry_delay": datetime.timedelta(seconds=5)}


def marked(name: str, seconds: str) -> dict[str, object]:
    return {
        "kind": "python",
        "name": name,
        "callable": "tests.stack.marks:mark_and_sleep",
        "args": ["{{ params.marks }}", "{{ run_id }}", name, seconds],
    }


with DAG(
    dag_id="stack_fault_python",
    schedule=None,
    start_date=datetime.datetime(2026, 1, 1),
    catchup=False,
    default_args=DEFAULTS,
    params={"marks": "/tmp/stack-marks", "seconds": 20},
    tags=["scheduler_lib", "stack-test"],
) as python_dag:
    ordered_waves(
        [
            [marked(f"long{i}", "{{ params.seconds }}") for i in range(1, 5)],
            [marked("after", "0")],
        ],
        group_id="waves",
        policy="continue",
        deferrable=True,
    )

# Each row sleeps in the executor (a static Java method through reflect): rows x ms
# milliseconds on the application's one core, in partitions (Spark's tasks) of a stage.
SLOW = (
    "SELECT count(*) AS n FROM range(0, {{ params.rows }}, 1, {{ params.partitions }}) "
    "WHERE coalesce(reflect('java.lang.Thread', 'sleep', CAST({{ params.ms }} AS BIGINT)), "
    "'x') <> 'never'"
)

with DAG(
    dag_id="stack_fault_spark",
    schedule=None,
    start_date=datetime.datetime(2026, 1, 1),
    catchup=False,
    default_args=DEFAULTS,
    params={"rows": 120, "partitions": 6, "ms": 250},
    tags=["scheduler_lib", "stack-test"],
) as spark_dag:
    ordered_waves(
        [
            [{"kind": "spark_sql", "name": "slow count", "sql": SLOW, "collect": 1}],
            [{"kind": "spark_sql", "name": "after", "sql": "SELECT 1 AS one"}],
        ],
        group_id="waves",
        deferrable=True,
    )
