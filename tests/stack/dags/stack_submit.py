"""The DAGs of tests/stack's ``spark_submit`` and ``pyspark`` scenario (issue 23,
scenario 5), parsed by the stack's Airflow.

- ``stack_submit``: a wave of a short ``spark_submit`` task (``sleepy_count.py``,
  submitted to the stack's Spark cluster through the Spark provider's hook and the
  ``spark_default`` connection) and a ``pyspark`` callable task, then a second wave.
- ``stack_submit_cancel``: a wave of a long ``spark_submit`` task, a long ``pyspark``
  task and a ``python`` task that fails (when the test creates ``params.fail_file``, or
  after ``params.fail_after`` seconds): ``fail_fast`` stops the other two (the submitted
  application is killed, the job group cancelled). No retries: the run fails.

The application's path is absolute at run time: this file is copied to the stack's DAGs
folder, so the folder of ``tests/stack/apps`` comes in the run's conf (``params.apps``).
Submitted applications ask for one core and a 512 MiB executor: the stack's Spark
workers offer two cores each, one of which each worker application holds.
"""

from __future__ import annotations

import datetime
from typing import Any

from airflow.sdk import DAG

from scheduler_lib.airflow import ordered_waves

DEFAULTS = {"retries": 1, "retry_delay": datetime.timedelta(seconds=5)}
APPLICATION = "{{ params.apps }}/sleepy_count.py"


def submit(name: str) -> dict[str, Any]:
    """A ``spark_submit`` task of ``sleepy_count.py`` (``params.rows`` x ``params.ms``)."""
    return {
        "kind": "spark_submit",
        "name": name,
        "application": APPLICATION,
        "application_args": ["{{ params.rows }}", "{{ params.ms }}"],
        "conn_id": "spark_default",
        "total_executor_cores": 1,
        "executor_memory": "512m",
        "driver_memory": "512m",
        "conf": {"spark.ui.showConsoleProgress": "false"},
    }


def slow_count(name: str) -> dict[str, Any]:
    """A ``pyspark`` task counting ``params.rows`` rows of ``params.ms`` each."""
    return {
        "kind": "pyspark",
        "name": name,
        "callable": "tests.stack.submit_tasks:slow_count",
        "args": ["{{ params.rows }}", "{{ params.ms }}"],
    }


with DAG(
    dag_id="stack_submit",
    schedule=None,
    start_date=datetime.datetime(2026, 1, 1),
    catchup=False,
    default_args=DEFAULTS,
    params={"apps": "", "rows": 20, "ms": 200},
    tags=["scheduler_lib", "stack-test"],
) as submit_dag:
    ordered_waves(
        [
            [submit("sleepy count"), slow_count("pyspark count")],
            [{"kind": "spark_sql", "name": "after", "sql": "SELECT 1 AS one"}],
        ],
        group_id="waves",
        deferrable=True,
    )

with DAG(
    dag_id="stack_submit_cancel",
    schedule=None,
    start_date=datetime.datetime(2026, 1, 1),
    catchup=False,
    default_args={**DEFAULTS, "retries": 0},
    params={"apps": "", "rows": 600, "ms": 500, "fail_file": "", "fail_after": 15},
    tags=["scheduler_lib", "stack-test"],
) as cancel_dag:
    ordered_waves(
        [
            [
                submit("long submit"),
                slow_count("long pyspark"),
                {
                    "kind": "python",
                    "name": "fail",
                    "callable": "tests.stack.submit_tasks:fail_when",
                    "args": ["{{ params.fail_file }}", "{{ params.fail_after }}"],
                },
            ],
            [{"kind": "spark_sql", "name": "never", "sql": "SELECT 1 AS one"}],
        ],
        group_id="waves",
        policy="fail_fast",
        deferrable=True,
    )
