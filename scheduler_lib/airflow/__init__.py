"""The Airflow 3 provider: hook, operators, the Synchronization sensor and its trigger,
and :func:`ordered_waves` (DESIGN.md section 11).

    from scheduler_lib.airflow import ordered_waves

    with DAG("etl", schedule="@daily"):
        ordered_waves([[load_a, load_b], [transform], [aggregate]])

Importing this package imports Airflow; nothing else of ours depends on it.
"""

from scheduler_lib.airflow import hooks, provider, triggers
from scheduler_lib.airflow.hooks import DEFAULT_CONN_ID, SchedulerLibHook
from scheduler_lib.airflow.operators import (
    ExecAsyncOperator,
    GetSchedulerOperator,
    OrderedWavesOperator,
    ReleaseSchedulerOperator,
)
from scheduler_lib.airflow.sensors import SynchronizationSensor, WaveTasksFailed
from scheduler_lib.airflow.task_group import ordered_waves
from scheduler_lib.airflow.triggers import SynchronizationTrigger

__all__ = [
    "DEFAULT_CONN_ID",
    "ExecAsyncOperator",
    "GetSchedulerOperator",
    "OrderedWavesOperator",
    "ReleaseSchedulerOperator",
    "SchedulerLibHook",
    "SynchronizationSensor",
    "SynchronizationTrigger",
    "WaveTasksFailed",
    "hooks",
    "ordered_waves",
    "provider",
    "triggers",
]
