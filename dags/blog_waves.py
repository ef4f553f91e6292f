"""The blog's test (seed 002), as an Airflow DAG: waves of 4, 2, 1, 2, 1 tasks of
decreasing length on one scheduler.

Written out with the four procedures so it reads like the blog's script —
``GetScheduler``, then per wave ``ExecAsync`` and ``Synchronization``, then
``ReleaseScheduler``. :func:`scheduler_lib.airflow.ordered_waves` builds the same chain
in one line (see ``batch_etl.py``).

Needs a ``scheduler_lib_default`` connection and something serving the target queue
(``scheduler-lib serve --db URL`` or ``scheduler-lib worker --db URL``).
"""

from __future__ import annotations

import datetime
import sys

from airflow.sdk import DAG

from scheduler_lib.airflow import (
    ExecAsyncOperator,
    GetSchedulerOperator,
    ReleaseSchedulerOperator,
    SynchronizationSensor,
)

UNIT = 0.1  # seconds per unit of the blog's WAITFOR DELAY lengths
# The blog's waves: each number is a task's length in units, longest first.
WAVES = [[10.1, 9.9, 9.7, 9.5], [9.3, 9.1], [8.9], [8.7, 8.5], [6.5]]

with DAG(
    dag_id="scheduler_lib_blog_waves",
    description="The blog's test: waves of 4, 2, 1, 2, 1 tasks, in order, on one scheduler",
    schedule=None,
    start_date=datetime.datetime(2026, 1, 1),
    catchup=False,
    # One retry, soon: Airflow 3.3's scheduler can fail a deferred task whose trigger fires
    # before it has handled the end of the try that deferred (apache/airflow#67287,
    # #72716, "state changed externally"; seen on make stack). The retry finds the wave's
    # tasks succeeded in execution_log and sends none of them again.
    default_args={"retries": 1, "retry_delay": datetime.timedelta(seconds=5)},
    tags=["scheduler_lib", "example"],
) as dag:
    get = GetSchedulerOperator(task_id="get_scheduler")
    last = get
    for number, lengths in enumerate(WAVES, start=1):
        send = ExecAsyncOperator(
            task_id=f"exec_async_{number}",
            wave=number,
            tasks=[
                {
                    "kind": "python",
                    "name": f"wave {number} task {i} ({units} units)",
                    "callable": "time:sleep",
                    "args": [round(units * UNIT, 3)],
                }
                for i, units in enumerate(lengths, start=1)
            ],
        )
        sync = SynchronizationSensor(
            task_id=f"synchronization_{number}",
            exec_task_id=send.task_id,
            deferrable=True,
            poke_interval=0.5,
        )
        last >> send >> sync
        last = sync
    last >> ReleaseSchedulerOperator(task_id="release_scheduler").as_teardown(setups=get)

if __name__ == "__main__":
    # dag.test() returns the run; a failed one must fail the command too.
    sys.exit(0 if dag.test().state == "success" else 1)
