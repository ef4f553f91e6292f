"""The DAG of tests/stack's external activation scenario (issue 23, scenario 6): a wave of
two marked ``python`` tasks sent to a target of its own (``ServiceBurst``), which a test
serves with one worker of one reader that launches another when it is full."""

from __future__ import annotations

import datetime

from airflow.sdk import DAG

from scheduler_lib.airflow import ordered_waves

with DAG(
    dag_id="stack_burst",
    schedule=None,
    start_date=datetime.datetime(2026, 1, 1),
    catchup=False,
    default_args={"retries": 1, "retry_delay": datetime.timedelta(seconds=5)},
    params={"marks": "/tmp/stack-marks", "seconds": 20},
    tags=["scheduler_lib", "stack-test"],
) as dag:
    ordered_waves(
        [
            [
                {
                    "kind": "python",
                    "name": name,
                    "callable": "tests.stack.marks:mark_and_sleep",
                    "args": ["{{ params.marks }}", "{{ run_id }}", name, "{{ params.seconds }}"],
                }
                for name in ("burst1", "burst2")
            ]
        ],
        group_id="burst",
        target_service="ServiceBurst",
        deferrable=True,
    )
