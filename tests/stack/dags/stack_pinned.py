"""The DAG of tests/stack's pinning scenario (issue 23, scenario 7): a plan whose later
wave reads a temporary view its first wave made. Temporary views live in one Spark
application, so the plan goes to a target that one worker application serves
(``ServicePinned``), not to the stack's shared target of two. Each run names its view
(``params.view``): plans pinned to the same application share its session."""

from __future__ import annotations

import datetime

from airflow.sdk import DAG

from scheduler_lib.airflow import ordered_waves

with DAG(
    dag_id="stack_pinned",
    schedule=None,
    start_date=datetime.datetime(2026, 1, 1),
    catchup=False,
    default_args={"retries": 1, "retry_delay": datetime.timedelta(seconds=5)},
    params={"view": "numbers", "rows": 10},
    tags=["scheduler_lib", "stack-test"],
) as dag:
    ordered_waves(
        [
            [
                {
                    "kind": "spark_sql",
                    "name": "make the view",
                    "sql": "CREATE OR REPLACE TEMP VIEW {{ params.view }} AS "
                    "SELECT id FROM range({{ params.rows }})",
                }
            ],
            [
                {
                    "kind": "spark_sql",
                    "name": "count",
                    "sql": "SELECT count(*) AS n FROM {{ params.view }}",
                },
                {
                    "kind": "spark_sql",
                    "name": "sum",
                    "sql": "SELECT sum(id) AS s FROM {{ params.view }}",
                },
            ],
        ],
        group_id="plan",
        target_service="ServicePinned",
        deferrable=True,
    )
