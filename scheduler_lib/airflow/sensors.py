"""``Synchronization`` as an Airflow sensor: wait for the tasks one ``ExecAsync`` sent.

Where the blog calls ``Synchronization`` once per task sent, the sensor waits for the
whole wave; it reads the tasks' rows of ``execution_log`` (durable, and answered in the
same transaction as ``AsyncDone``), so ``poke``, ``reschedule`` and ``deferrable`` modes
all survive restarts. A task that failed fails the sensor with the task's error.

A database outage does not fail it: a look rides through one up to the broker's reconnect
deadline (``SCHEDULER_LIB_RECONNECT_TIMEOUT``, else 120 s), and past that the poke says
"not yet" with a log line (the tasks run on; the sensor's ``timeout`` still bounds the
whole wait). A deferrable sensor hands such a wait to its trigger, which keeps waiting.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import json
from collections.abc import Sequence
from typing import Any

from airflow.providers.common.compat.sdk import AirflowException, AirflowFailException, conf
from airflow.sdk import BaseSensorOperator, Context, PokeReturnValue

from scheduler_lib.airflow import hooks, triggers
from scheduler_lib.scheduler import WaveProgress
from scheduler_lib.scheduler.client import POLICIES

FAILED_LINES = 20  # failed tasks listed in the sensor's error


class WaveTasksFailed(AirflowException):
    """Tasks of a wave did not succeed: a retry of the Airflow task that sent them
    (``retries=...``) sends again those that did not succeed."""


def default_deferrable() -> bool:
    """``[operators] default_deferrable`` (as Airflow's own providers read it)."""
    return conf.getboolean("operators", "default_deferrable", fallback=False)


def check_policy(policy: str, where: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"{where}: policy must be one of {POLICIES}, got {policy!r}")
    return policy


class SynchronizationSensor(BaseSensorOperator):
    """Wait until every task of a wave has completed; fail when one failed.

    The wave is the XCom of ``exec_task_id`` (an :class:`ExecAsyncOperator`), or give
    ``scheduler_handle`` and ``log_ids`` directly (both templated).

    :param exec_task_id: the task id of the ``ExecAsyncOperator`` that sent the wave
    :param scheduler_handle: the scheduler's conversation handle (instead of XCom)
    :param log_ids: the tasks' log ids (instead of XCom)
    :param scheduler_lib_conn_id: the broker's connection
    :param policy: ``fail_fast`` (default): at the first task that did not succeed,
        cancel the wave's queued tasks and stop the running ones; ``continue``: let
        them run. Either way the sensor fails once the wave is done and a task failed
    :param deferrable: wait in the triggerer (frees the worker slot); default
        ``[operators] default_deferrable``
    :param trigger_poll_interval: seconds between the trigger's looks
    :return: (XCom) each task's log id, name, status, error and result
    """

    template_fields: Sequence[str] = ("scheduler_handle", "log_ids", "exec_task_id")
    ui_color = "#d8e9f6"

    def __init__(
        self,
        *,
        exec_task_id: str | None = None,
        scheduler_handle: str | None = None,
        log_ids: Sequence[int] | str | None = None,
        scheduler_lib_conn_id: str = hooks.DEFAULT_CONN_ID,
        policy: str = "fail_fast",
        deferrable: bool | None = None,
        trigger_poll_interval: float = triggers.POLL_INTERVAL,
        poke_interval: float = 2.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(poke_interval=poke_interval, **kwargs)
        if exec_task_id is None and (scheduler_handle is None or log_ids is None):
            raise ValueError(
                f"{self.task_id}: give exec_task_id (the ExecAsyncOperator that sent the "
                "wave), or both scheduler_handle and log_ids"
            )
        self.exec_task_id = exec_task_id
        self.scheduler_handle = scheduler_handle
        self.log_ids = log_ids
        self.scheduler_lib_conn_id = scheduler_lib_conn_id
        self.policy = check_policy(policy, self.task_id)
        self.deferrable = default_deferrable() if deferrable is None else deferrable
        self.trigger_poll_interval = trigger_poll_interval
        self._stopped: set[str] = set()  # schedulers whose rest this sensor cancelled

    def wave(self, context: Context) -> tuple[str, list[int]]:
        """(scheduler handle, log ids) of the wave to wait for."""
        handle, log_ids = self.scheduler_handle, self.log_ids
        if handle is None or log_ids is None:
            sent = context["ti"].xcom_pull(task_ids=self.exec_task_id)
            if not isinstance(sent, dict) or "log_ids" not in sent:
                raise AirflowFailException(
                    f"{self.task_id}: task {self.exec_task_id!r} pushed no wave to XCom "
                    f"(got {sent!r}); is it an ExecAsyncOperator upstream of this sensor?"
                )
            handle = handle or sent["scheduler_handle"]
            log_ids = log_ids if log_ids is not None else sent["log_ids"]
        return str(handle), as_log_ids(log_ids, self.task_id)

    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        handle, log_ids = self.wave(context)
        # One look first: a wave that has already ended costs no trip to the triggerer.
        done = self._look_through_outage(handle, log_ids, "deferring: the trigger waits")
        if done.is_done:
            return done.xcom_value
        timeout = datetime.timedelta(seconds=self.timeout) if self.timeout else None
        triggers.defer(
            self, handle, log_ids, "execute_complete", timeout, fail_fast=self.policy == "fail_fast"
        )

    def poke(self, context: Context) -> PokeReturnValue:
        handle, log_ids = self.wave(context)
        return self._look_through_outage(handle, log_ids, "poking again later")

    def _look_through_outage(self, handle: str, log_ids: list[int], then: str) -> PokeReturnValue:
        """:meth:`_look`; "not yet" (with a log line) when the database stayed unavailable
        past the reconnect deadline. The tasks do not depend on this process: they run on,
        and their rows say how they ended once the database is back. Failing here would
        fail the DAG run (or spend a retry) for an outage that the wave itself rides
        through, so the sensor waits, bounded by its own ``timeout``."""
        try:
            return self._look(handle, log_ids)
        except Exception as exc:
            if not hooks.is_outage(exc):
                raise
            self.log.warning(
                "wave of scheduler %s: %s; %s (the wave's %d task(s) run on)",
                handle,
                hooks.outage_line(None, exc),
                then,
                len(log_ids),
            )
            return PokeReturnValue(is_done=False)

    def _look(self, handle: str, log_ids: list[int]) -> PokeReturnValue:
        scheduler = hooks.SchedulerLibHook(self.scheduler_lib_conn_id).get_scheduler()
        progress = scheduler.wave_progress(handle, log_ids)
        if (
            self.policy == "fail_fast"
            and handle not in self._stopped
            and triggers.stop_the_rest(scheduler, handle, progress, self.log)
        ):
            self._stopped.add(handle)
            progress = scheduler.wave_progress(handle, log_ids)  # the queued ones ended
        if not progress.done:
            if progress.ended_by_target is not None:
                raise AirflowFailException(triggers.ended_message(handle, progress))
            self.log.info(
                "wave of scheduler %s: %d of %d task(s) completed",
                handle,
                len(progress.tasks) - len(progress.pending),
                len(progress.tasks),
            )
            return PokeReturnValue(is_done=False)
        scheduler.drain(handle)
        return PokeReturnValue(is_done=True, xcom_value=outcome(progress, self.task_id))

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        """Resumed from the trigger: the wave's outcome, or the reason it has none."""
        return event_outcome(event, self.task_id)


def native(value: Any) -> Any:
    """A list rendered by a template as text (without ``render_template_as_native_obj``)
    back to a list; anything else as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            with contextlib.suppress(ValueError, SyntaxError):
                return ast.literal_eval(value)
    return value


def as_log_ids(value: Any, where: str) -> list[int]:
    """Log ids from XCom or a templated field (a rendered list may arrive as text)."""
    value = native(value)
    if isinstance(value, int):
        value = [value]
    try:
        ids = [int(i) for i in value]  # text that was no list fails here
    except (TypeError, ValueError):
        raise AirflowFailException(
            f"{where}: log_ids must be a list of ints, got {value!r}"
        ) from None
    return ids


def outcome(progress: WaveProgress, where: str) -> list[dict[str, Any]]:
    """The wave's summaries, or the failure of the Airflow task with the tasks' errors."""
    summaries = triggers.summaries(progress)
    check(summaries, where)
    return summaries


def event_outcome(
    event: dict[str, Any], where: str, *, retryable: bool = False
) -> list[dict[str, Any]]:
    """What a :class:`SynchronizationTrigger` event means for the deferred task."""
    status = event.get("status")
    if status == triggers.DONE:
        check(event["tasks"], where, retryable=retryable)
        return event["tasks"]
    if status == triggers.TIMEOUT:
        raise AirflowException(f"{where}: {event.get('message')}")
    raise AirflowFailException(f"{where}: {event.get('message')}")


def check(summaries: list[dict[str, Any]], where: str, *, retryable: bool = False) -> None:
    """Fail when a task failed: without retries for a sensor (looking again cannot
    help); ``retryable`` for an operator that sent the tasks (its retry sends again
    those that did not succeed)."""
    failed = [s for s in summaries if s["status"] != "SUCCEEDED"]
    if not failed:
        return
    lines = [
        f"  {s['task_name']} (log id {s['log_id']}): {s['status']}"
        + (f": {(s['error'] or '').strip().splitlines()[0]}" if s.get("error") else "")
        for s in failed[:FAILED_LINES]
    ]
    if len(failed) > FAILED_LINES:
        lines.append(f"  ... and {len(failed) - FAILED_LINES} more")
    message = f"{where}: {len(failed)} of {len(summaries)} task(s) did not succeed:\n" + "\n".join(
        lines
    )
    raise WaveTasksFailed(message) if retryable else AirflowFailException(message)
