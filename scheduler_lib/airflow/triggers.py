"""The deferrable half of ``Synchronization``: a trigger that waits for a wave's tasks in
Airflow's triggerer, without holding a worker slot.

It polls ``execution_log`` (one indexed, read-only query per poll, in a thread: the
triggerer's event loop never blocks on the database) until every task of the wave has
ended, the target ended the conversation, or the deadline passed. Nothing is consumed
while it waits, so a trigger that is restarted on another triggerer starts where it was.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from scheduler_lib.airflow import hooks
from scheduler_lib.scheduler import Completion, TaskScheduler, TaskState, WaveProgress

POLL_INTERVAL = 0.5  # seconds between looks at the wave's rows

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
    """

    def __init__(
        self,
        scheduler_handle: str,
        log_ids: Sequence[int],
        scheduler_lib_conn_id: str = hooks.DEFAULT_CONN_ID,
        poll_interval: float = POLL_INTERVAL,
        deadline: float | None = None,
        carry: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.carry = carry
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
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            conn = await hooks.SchedulerLibHook.aget_connection(self.scheduler_lib_conn_id)
            url, options = hooks.broker_url(conn), hooks.connection_options(conn)
            scheduler = await asyncio.to_thread(_scheduler, url, options["migrate"])
        except Exception as exc:  # a bad connection is the operator's error, not a hang
            yield self._event({"status": ERROR, "message": f"{type(exc).__name__}: {exc}"})
            return
        while True:
            try:
                progress = await asyncio.to_thread(
                    scheduler.wave_progress, self.scheduler_handle, self.log_ids
                )
            except Exception as exc:
                yield self._event({"status": ERROR, "message": f"{type(exc).__name__}: {exc}"})
                return
            if progress.done:
                # The answers were read from the log; their messages go now.
                await asyncio.to_thread(scheduler.drain, self.scheduler_handle)
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
) -> None:
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
        ),
        method_name=method_name,
        timeout=timeout,
    )


def ended_message(scheduler_handle: str, progress: WaveProgress) -> str:
    """Why a wave will not complete: the target ended the conversation, or it is gone."""
    return (
        f"scheduler {scheduler_handle}: {progress.ended_by_target}; "
        f"{len(progress.pending)} task(s) will not complete"
    )


def _scheduler(url: str, migrate: bool) -> TaskScheduler:
    return TaskScheduler(hooks.shared_broker(url, migrate=migrate))


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
