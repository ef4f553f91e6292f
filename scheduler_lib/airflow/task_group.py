"""Ordered waves as an Airflow task group: the blog's loop drawn as a DAG.

    get_scheduler >> wave_1 >> wave_2 >> ... >> release_scheduler

Each ``wave_N`` is an :class:`~scheduler_lib.airflow.operators.ExecAsyncOperator` that
sends its wave and waits for it (``wait=True``): one Airflow task per wave, so Airflow's
per-task cost is paid once a wave. With ``separate_sensors=True`` the wait is a
:class:`~scheduler_lib.airflow.sensors.SynchronizationSensor` of its own, as in the blog
(``wave_N >> wave_N_sync``), for those who want poke/reschedule modes or to see the send
and the wait apart. With ``policy="fail_fast"`` (the default) the wait cancels the rest
of a wave as soon as one of its tasks fails. ``release_scheduler`` is a teardown of
``get_scheduler``: it runs whatever happened to the waves, and its own success does not
hide a failed wave from the DAG run's state. A failed wave's task is retryable
(``retries``), and a retry sends only the wave's tasks that did not succeed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import TaskGroup

from scheduler_lib.airflow import hooks, operators, sensors
from scheduler_lib.scheduler import Task


def ordered_waves(
    waves: Sequence[Sequence[Mapping[str, Any] | Task]],
    *,
    group_id: str = "ordered_waves",
    wave_names: Sequence[str] | None = None,
    target_service: str | None = None,
    scheduler_lib_conn_id: str = hooks.DEFAULT_CONN_ID,
    policy: str = "fail_fast",
    retry_failed_only: bool = True,
    deferrable: bool | None = None,
    separate_sensors: bool = False,
    sensor_kwargs: Mapping[str, Any] | None = None,
    **group_kwargs: Any,
) -> TaskGroup:
    """A task group that runs ``waves`` in order on one scheduler.

    :param waves: a list of waves, each a list of tasks (JSON objects with a ``kind``)
    :param group_id: the task group's id
    :param wave_names: task ids for the waves (``load``, ``transform``…) instead of
        ``wave_1``, ``wave_2``…
    :param target_service: where the tasks go (default: the connection's)
    :param policy: ``fail_fast`` (default): the first task of a wave that does not
        succeed cancels the wave's queued tasks and stops its running ones at once (the
        wave's wait — its own task, its sensor or the trigger — does it); ``continue``:
        the rest of the wave runs. Either way the wave fails and the next is not sent
    :param retry_failed_only: a retry of a wave's Airflow task (``retries`` in
        ``default_args``) sends only the wave's tasks that did not succeed
    :param deferrable: the waits happen in the triggerer (after a couple of seconds in
        place, so a short wave does not pay the trip); default ``[operators]
        default_deferrable``
    :param separate_sensors: draw each wait as a sensor of its own (``<name>_sync``)
    :param sensor_kwargs: more arguments for every sensor (``poke_interval``, ``mode``,
        ``timeout``…), with ``separate_sensors``
    :param group_kwargs: more arguments for the ``TaskGroup`` (``tooltip``…)
    """
    if isinstance(waves, str | bytes) or not isinstance(waves, Sequence) or not waves:
        raise ValueError(f"{group_id}: waves must be a non-empty list of lists of tasks")
    names = list(wave_names) if wave_names is not None else None
    if sensor_kwargs and not separate_sensors:
        raise ValueError(f"{group_id}: sensor_kwargs needs separate_sensors=True")
    if names is not None and (len(names) != len(waves) or len(set(names)) != len(names)):
        raise ValueError(
            f"{group_id}: wave_names must name each of the {len(waves)} waves once, got {names!r}"
        )
    sensors.check_policy(policy, group_id)
    if deferrable is None:
        deferrable = sensors.default_deferrable()
    with TaskGroup(group_id=group_id, **group_kwargs) as group:
        get = operators.GetSchedulerOperator(
            task_id="get_scheduler",
            target_service=target_service,
            scheduler_lib_conn_id=scheduler_lib_conn_id,
        )
        last: Any = get
        for number, wave in enumerate(waves, start=1):
            name = names[number - 1] if names is not None else f"wave_{number}"
            send = operators.ExecAsyncOperator(
                task_id=name,
                tasks=wave,
                wave=number,
                wait=not separate_sensors,
                policy=policy,
                retry_failed_only=retry_failed_only,
                deferrable=deferrable and not separate_sensors,
                scheduler_task_id=get.task_id,
                scheduler_lib_conn_id=scheduler_lib_conn_id,
            )
            last >> send
            last = send
            if separate_sensors:
                sync = sensors.SynchronizationSensor(
                    task_id=f"{name}_sync",
                    exec_task_id=send.task_id,
                    scheduler_lib_conn_id=scheduler_lib_conn_id,
                    policy=policy,
                    deferrable=deferrable,
                    **dict(sensor_kwargs or {}),
                )
                send >> sync
                last = sync
        release = operators.ReleaseSchedulerOperator(
            task_id="release_scheduler",
            scheduler_task_id=get.task_id,
            scheduler_lib_conn_id=scheduler_lib_conn_id,
        )
        last >> release.as_teardown(setups=get)
    return group
