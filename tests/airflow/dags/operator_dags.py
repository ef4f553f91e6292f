"""DAGs the provider's tests run with ``dag.test()`` (Airflow 3.3 runs only DAGs that a
DAG bundle holds: the tests' DAG folder links these beside ``dags/``)."""

from __future__ import annotations

from airflow.sdk import DAG

from scheduler_lib.airflow import (
    ExecAsyncOperator,
    GetSchedulerOperator,
    OrderedWavesOperator,
    ReleaseSchedulerOperator,
    ordered_waves,
)


def python(name: str, target: str, *args: object) -> dict[str, object]:
    return {"kind": "python", "name": name, "callable": target, "args": list(args)}


# A wave with a task that raises, then a wave that must never be sent: with the wait in
# a sensor of its own, and in the wave's own task.
FAILING = [
    [python("fine", "time:sleep", 0.2), python("broken", "math:sqrt", -1)],
    [python("never", "time:sleep", 0)],
]
with DAG("test_sensor_fails", schedule=None):
    ordered_waves(
        FAILING, group_id="plan", separate_sensors=True, sensor_kwargs={"poke_interval": 0.2}
    )
with DAG("test_wave_fails", schedule=None):
    ordered_waves(FAILING, group_id="plan")

# One wave of tasks that take a second, waited for in each of the sensor's modes, and by
# the wave's own task in place and in the triggerer.
SLOW_WAVE = [python(f"slow {i}", "time:sleep", 1.0) for i in range(2)]
with DAG("test_sensor_reschedule", schedule=None):
    ordered_waves(
        [SLOW_WAVE],
        separate_sensors=True,
        sensor_kwargs={"mode": "reschedule", "poke_interval": 0.3},
    )
with DAG("test_sensor_deferrable", schedule=None):
    ordered_waves([SLOW_WAVE], separate_sensors=True, deferrable=True)
with DAG("test_wave_in_place", schedule=None):
    ordered_waves([SLOW_WAVE])
with DAG("test_wave_deferrable", schedule=None):
    get = GetSchedulerOperator(task_id="get_scheduler")
    wave = ExecAsyncOperator(
        task_id="wave_1", tasks=SLOW_WAVE, wait=True, deferrable=True, defer_after=0.1
    )
    get >> wave >> ReleaseSchedulerOperator(task_id="release").as_teardown(setups=get)

# Three waves as one Airflow task; the first is long enough to be deferred.
PLAN = [
    [python(f"sleep {i}", "time:sleep", 1.0) for i in range(3)],
    [python("add", "operator:add", 2, 3)],
    [{"kind": "sql", "name": "select", "sql": "SELECT 1"}],
]
with DAG("test_plan_in_place", schedule=None):
    OrderedWavesOperator(task_id="plan", waves=PLAN, defer_after=0.2)
with DAG("test_plan_deferring", schedule=None):
    OrderedWavesOperator(task_id="plan", waves=PLAN, deferrable=True, defer_after=0.2)

# The first task fails at once; six others follow it in the same wave.
with DAG("test_plan_fail_fast", schedule=None):
    OrderedWavesOperator(
        task_id="plan",
        waves=[
            [
                python("broken", "math:sqrt", -1),
                *[python(f"slow {i}", "time:sleep", 2) for i in range(6)],
            ],
            [{"kind": "sql", "name": "after", "sql": "SELECT 1"}],
        ],
    )
