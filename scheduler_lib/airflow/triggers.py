"""The deferrable half of ``Synchronization``: a trigger that waits for a wave's tasks in
Airflow's triggerer, without holding a worker slot.

It polls ``execution_log`` (one indexed, read-only query per poll, in a thread: the
triggerer's event loop never blocks on the database) until every task of the wave has
ended, the target ended the conversation, or the deadline passed. Nothing is consumed
while it waits, so a trigger that is restarted on another triggerer starts where it was.

A database outage (a restart, a failover) does not end it: the tasks run on (their
executors ride through it too), so the trigger logs that the database is unavailable,
keeps looking, and fires once the wave is done after the database is back — or at its
deadline.
"""

from __future__ import annotations

import asyncio
import datetime
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, NoReturn

from airflow.triggers.base import BaseTrigger, TriggerEvent

from scheduler_lib.airflow import hooks
from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import (
    Completion,
    SchedulerHandle,
    TaskScheduler,
    TaskState,
    WaveProgress,
)

POLL_INTERVAL = 0.5  # seconds between looks at the wave's rows
# Seconds one look rides through a database outage before it gives up and the trigger's
# own loop takes over (which waits for ever, or until the deadline). Short: a look holds
# a thread of the triggerer's pool, which every trigger of the process shares, and at
# most one look per broker waits for the database at a time (see hooks.turn).
LOOK_RECONNECT_TIMEOUT = 5.0
OUTAGE_LOG_INTERVAL = 60.0  # seconds between "still unavailable" lines of one trigger

DONE, ENDED, TIMEOUT, ERROR = "done", "ended", "timeout", "error"


class SynchronizationTrigger(BaseTrigger):
    """Fires once the tasks ``log_ids`` of ``scheduler_handle`` have all ended.

    The event's payload: ``{"status": "done", "tasks": [...]}`` (each task as
    :func:`task_summary` makes it, failed ones included — the operator decides),
    ``{"status": "ended", "message": ...}`` when the target ended the conversation first,
    ``{"status": "timeout", "message": ...}`` past ``deadline``, or ``{"status":
    "error", "message": ...}`` when the broker could not be asked.

    :param scheduler_handle: the scheduler's conversation handle
    :param log_ids: the tasks to wait for
    :param scheduler_lib_conn_id: the broker's connection
    :param poll_interval: seconds between looks
    :param deadline: epoch seconds after which it gives up (``None``: never)
    :param carry: JSON state handed back in every event as ``"carry"`` (what the
        deferring task needs to go on: ``dag.test()`` drops a deferral's kwargs)
    :param fail_fast: once a task ended without succeeding, cancel the scheduler's
        queued tasks and ask its running ones to stop (right here in the triggerer, not
        once the deferred task has resumed); the event still comes when every task ended
    """

    def __init__(
        self,
        scheduler_handle: str,
        log_ids: Sequence[int],
        scheduler_lib_conn_id: str = hooks.DEFAULT_CONN_ID,
        poll_interval: float = POLL_INTERVAL,
        deadline: float | None = None,
        carry: dict[str, Any] | None = None,
        fail_fast: bool = False,
    ) -> None:
        super().__init__()
        self.carry = carry
        self.fail_fast = bool(fail_fast)
        self.scheduler_handle = str(scheduler_handle)
        self.log_ids = [int(i) for i in log_ids]
        self.scheduler_lib_conn_id = scheduler_lib_conn_id
        self.poll_interval = float(poll_interval)
        self.deadline = deadline

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "scheduler_handle": self.scheduler_handle,
                "log_ids": self.log_ids,
                "scheduler_lib_conn_id": self.scheduler_lib_conn_id,
                "poll_interval": self.poll_interval,
                "deadline": self.deadline,
                "carry": self.carry,
                "fail_fast": self.fail_fast,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            conn = await hooks.SchedulerLibHook.aget_connection(self.scheduler_lib_conn_id)
            url, options = hooks.broker_url(conn), hooks.connection_options(conn)
            broker = await asyncio.to_thread(_broker, url)
        except Exception as exc:  # a bad connection is the operator's error, not a hang
            yield self._event({"status": ERROR, "message": f"{type(exc).__name__}: {exc}"})
            return
        opened: list[TaskScheduler] = []
        stopped: list[bool] = []

        def look() -> WaveProgress:
            if not opened:  # the schema check rides through an outage too
                opened.append(hooks.open_scheduler(broker, migrate=options["migrate"]))
            scheduler = opened[0]
            progress = scheduler.wave_progress(self.scheduler_handle, self.log_ids)
            if (
                self.fail_fast
                and not stopped
                and stop_the_rest(scheduler, self.scheduler_handle, progress, self.log)
            ):
                stopped.append(True)
                progress = scheduler.wave_progress(self.scheduler_handle, self.log_ids)
            if progress.done:
                # The answers were read from the log; their messages go now.
                scheduler.drain(self.scheduler_handle)
            return progress

        away: float | None = None  # monotonic time of the first look that met the outage
        said = 0.0  # monotonic time of the last line saying so
        while True:
            progress: WaveProgress | None = None
            failed: Exception | None = None
            began = time.monotonic()
            with hooks.turn(broker) as mine:
                if mine:  # else another look of this process is finding out
                    try:
                        progress = await asyncio.to_thread(look)
                    except Exception as exc:
                        failed = exc
            if failed is not None and not hooks.is_outage(failed):
                yield self._event(
                    {"status": ERROR, "message": f"{type(failed).__name__}: {failed}"}
                )
                return
            if progress is None:  # the database is unavailable: the tasks run on
                now = time.monotonic()
                if away is None or now - said >= OUTAGE_LOG_INTERVAL:
                    away = began if away is None else away
                    said = now
                    self.log.warning(
                        "scheduler %s: %s; waiting for the database to be back (the "
                        "wave's %d task(s) run on)",
                        self.scheduler_handle,
                        hooks.outage_line(broker, failed),
                        len(self.log_ids),
                    )
                if self.deadline is not None and time.time() >= self.deadline:
                    yield self._event(
                        {
                            "status": TIMEOUT,
                            "message": f"scheduler {self.scheduler_handle}: the deadline "
                            f"passed; {hooks.outage_line(broker, failed)}",
                        }
                    )
                    return
                await asyncio.sleep(self.poll_interval)
                continue
            if away is not None:
                self.log.warning(
                    "scheduler %s: the database is back after %.0f s; watching the wave",
                    self.scheduler_handle,
                    time.monotonic() - away,
                )
                away = None
            if progress.done:
                yield self._event({"status": DONE, "tasks": summaries(progress)})
                return
            if progress.ended_by_target is not None:
                yield self._event(
                    {"status": ENDED, "message": ended_message(self.scheduler_handle, progress)}
                )
                return
            if self.deadline is not None and time.time() >= self.deadline:
                yield self._event(
                    {
                        "status": TIMEOUT,
                        "message": f"scheduler {self.scheduler_handle}: "
                        f"{len(progress.pending)} of {len(progress.tasks)} task(s) not "
                        "completed by the deadline",
                    }
                )
                return
            await asyncio.sleep(self.poll_interval)

    def _event(self, payload: dict[str, Any]) -> TriggerEvent:
        if self.carry is not None:
            payload["carry"] = self.carry
        return TriggerEvent(payload)


def defer(
    task: Any,
    scheduler_handle: str,
    log_ids: Sequence[int],
    method_name: str,
    timeout: datetime.timedelta | None,
    carry: dict[str, Any] | None = None,
    *,
    fail_fast: bool = False,
) -> NoReturn:
    """Hand ``task``'s wait for a wave to the triggerer (raises Airflow's deferral):
    ``method_name`` resumes with the event, ``carry`` rides in it, ``timeout`` bounds the
    wait (``None``: no bound). ``task`` has ``scheduler_lib_conn_id`` and
    ``trigger_poll_interval``."""
    task.defer(
        trigger=SynchronizationTrigger(
            scheduler_handle,
            log_ids,
            scheduler_lib_conn_id=task.scheduler_lib_conn_id,
            poll_interval=task.trigger_poll_interval,
            deadline=time.time() + timeout.total_seconds() if timeout else None,
            carry=carry,
            fail_fast=fail_fast,
        ),
        method_name=method_name,
        timeout=timeout,
    )
    raise AssertionError(f"{task}.defer() returned instead of raising TaskDeferred")


def first_failure(progress: WaveProgress) -> str | None:
    """The name of a task of the wave that ended without succeeding, if one did."""
    for task in progress.tasks:
        if task.ended and task.status != "SUCCEEDED":
            return task.task_name or str(task.log_id)
    return None


def stop_the_rest(
    scheduler: TaskScheduler, handle: SchedulerHandle | str, progress: WaveProgress, log: Any
) -> bool:
    """``fail_fast``: once a task of the wave failed while others are pending, cancel
    the scheduler's queued tasks and ask the running ones to stop (they answer
    ``CANCELLED``); whether it did."""
    failed = first_failure(progress)
    if failed is None or progress.done:
        return False
    if not isinstance(handle, SchedulerHandle):
        handle = SchedulerHandle(uuid.UUID(str(handle)), "")
    cancelled, stopping = scheduler.cancel(
        handle, f"cancelled: task {failed} of the wave failed (fail_fast)"
    )
    log.warning(
        "wave of scheduler %s: %s did not succeed; fail_fast: %d queued task(s) cancelled, "
        "%d running asked to stop",
        handle,
        failed,
        cancelled,
        stopping,
    )
    return True


def ended_message(scheduler_handle: str, progress: WaveProgress) -> str:
    """Why a wave will not complete: the target ended the conversation, or it is gone."""
    return (
        f"scheduler {scheduler_handle}: {progress.ended_by_target}; "
        f"{len(progress.pending)} task(s) will not complete"
    )


def _broker(url: str) -> Broker:
    """The triggers' broker for ``url``: opened without a round trip (the first look
    makes its schema ready), no timer thread (the workers' brokers fire timers), and the
    short reconnect deadline of one look."""
    return hooks.shared_broker(
        url, migrate=False, timers=False, reconnect_timeout=LOOK_RECONNECT_TIMEOUT
    )


def summaries(progress: WaveProgress) -> list[dict[str, Any]]:
    """The wave's tasks as JSON values (what XCom and trigger events carry)."""
    return [task_summary(t) for t in progress.tasks]


def task_summary(task: TaskState | Completion) -> dict[str, Any]:
    """One task's outcome (a row read, or an ``AsyncDone`` received): log id, name,
    status, error, result."""
    return {
        "log_id": task.log_id,
        "task_name": task.task_name,
        "status": task.status,
        "error": task.error,
        "result": task.result,
    }
