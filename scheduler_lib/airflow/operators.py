"""The blog's procedures as Airflow operators, and one operator for a whole plan.

``GetSchedulerOperator`` → ``ExecAsyncOperator`` (one wave) → ``SynchronizationSensor``
→ … → ``ReleaseSchedulerOperator``: each Airflow task makes one library call, and the
scheduler handle and the wave's log ids travel by XCom. :func:`ordered_waves` builds
that chain from a list of waves; :class:`OrderedWavesOperator` runs the whole plan as
one Airflow task (seconds of Airflow overhead once, not per wave).

Database outages: every call rides through one up to the broker's reconnect deadline
(``SCHEDULER_LIB_RECONNECT_TIMEOUT`` in the worker's environment, else 120 s), so a
restart or a failover only makes a task slower. A deferrable operator that is waiting in
place when the deadline passes hands the wait to its trigger, which waits for as long as
the database is away; anything else fails with one line naming the database.

Retries: a wave whose tasks did not all succeed fails the Airflow task retryably
(:class:`~scheduler_lib.airflow.sensors.WaveTasksFailed`), and with ``retry_failed_only``
(the default) a later try sends only the tasks that did not succeed in an earlier one —
found in ``execution_log`` by the Airflow ids every row carries. Errors a retry cannot
fix (a task's shape, an unknown or refused kind, a missing connection) raise
``AirflowFailException``: no retry is spent on them.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from airflow.providers.common.compat.sdk import (  # the same names on every Airflow 3 release
    AirflowException,
    AirflowFailException,
    AirflowNotFoundException,
)
from airflow.sdk import BaseOperator, Context, TriggerRule

from scheduler_lib.airflow import hooks, sensors, triggers
from scheduler_lib.broker import DatabaseUnavailable
from scheduler_lib.broker.exceptions import InvalidArgument
from scheduler_lib.scheduler import (
    Completion,
    InvalidTask,
    SchedulerEnded,
    SchedulerHandle,
    Task,
    TaskScheduler,
    WaveFailed,
    WaveProgress,
    monitor,
)
from scheduler_lib.scheduler.kinds import as_task

try:  # Airflow's metrics (StatsD, OpenTelemetry, Datadog: whichever [metrics] configures)
    from airflow.providers.common.compat.sdk import Stats
except ImportError:  # a common-compat release without it re-exported
    from airflow.stats import Stats

log = logging.getLogger(__name__)

STATS_PREFIX = "scheduler_lib.wave"  # Airflow's metrics: <prefix>.tasks_sent etc.
FAILED_STATUSES = ("FAILED", "CANCELLED")
DEFER_AFTER = 2.0  # seconds a deferrable operator waits in place before it defers a wave
FAIL_FAST_STEP = 0.25  # seconds between looks for a failed task while a wave runs
RUN_ROWS = 1_000_000  # rows of one DAG run read to find an earlier try's (indexed)
# Task fields that may hold SQL: a string of one of these that ends in .sql is read as a
# template file (beside the DAG, or on its template_searchpath)
TEMPLATE_EXT: Sequence[str] = (".sql",)


def airflow_ids(context: Context) -> dict[str, str | None]:
    """The DAG, run and task ids ``execution_log`` records with every task sent."""
    ti = context["ti"]
    return {"dag_id": ti.dag_id, "run_id": ti.run_id, "task_id": ti.task_id}


def task_instance(context: Context) -> dict[str, str | int | None]:
    """The sending task instance, as each task's message carries it to the worker: the
    ids ``execution_log`` records, its try and map index, and — where Airflow's
    OpenLineage provider is installed — its OpenLineage run (the provider's macros'
    values), the parent of each Spark task's lineage run."""
    ti = context["ti"]
    map_index = getattr(ti, "map_index", None)
    return {
        **airflow_ids(context),
        "try_number": try_number(context),
        "map_index": None if map_index is None else int(map_index),
        **lineage_run(ti),
    }


def lineage_run(ti: Any) -> dict[str, str]:
    """The task instance's OpenLineage run (namespace, job name, run id, and its DAG
    run's as root), computed by Airflow's OpenLineage provider as its listener does for
    the events it sends of that task instance; none without the provider. The run id's
    recipe changed between provider releases (it names the OpenLineage namespace, the
    logical date, the try...), so it is never computed here by a copy of it."""
    try:
        from airflow.providers.openlineage.plugins import macros
    except ImportError:
        return {}
    try:
        return {
            "lineage_job_namespace": macros.lineage_job_namespace(),
            "lineage_job_name": macros.lineage_job_name(ti),
            "lineage_run_id": macros.lineage_run_id(ti),
            "lineage_root_job_namespace": macros.lineage_root_job_namespace(ti),
            "lineage_root_job_name": macros.lineage_root_job_name(ti),
            "lineage_root_run_id": macros.lineage_root_run_id(ti),
        }
    except Exception as exc:  # lineage never fails the task that sends
        log.warning("no OpenLineage parent run for the tasks sent: %s: %s", type(exc).__name__, exc)
        return {}


def load_kinds() -> None:
    """Let this process check Spark tasks before sending them (the import registers the
    kinds; pyspark itself is imported only by a task that runs)."""
    with contextlib.suppress(ImportError):
        import scheduler_lib.spark  # noqa: F401


def plain_tasks(tasks: Any, where: str) -> list[dict[str, Any]]:
    """Tasks as JSON objects (what Airflow serializes and templates), checked for shape;
    each kind checks its fields when the wave is sent."""
    if isinstance(tasks, str | bytes | Mapping) or not isinstance(tasks, Sequence):
        raise InvalidTask(f"{where}: tasks must be a list of tasks, got {tasks!r}")
    plain = []
    for i, task in enumerate(tasks, start=1):
        if isinstance(task, Task):
            task = task.to_dict()
        if not isinstance(task, Mapping) or not isinstance(task.get("kind"), str):
            raise InvalidTask(
                f"{where}, task {i}: a task is an object with a 'kind' "
                f"(e.g. {{'kind': 'spark_sql', 'sql': 'SELECT 1'}}), got {task!r}"
            )
        plain.append(dict(task))
    return plain


@contextlib.contextmanager
def no_retry(where: str) -> Iterator[None]:
    """Errors a retry cannot fix fail the Airflow task for good (``AirflowFailException``):
    a task's shape, an unknown kind, a kind the target refuses, a bad or missing
    connection. Anything else (a database outage, a failed wave) stays retryable."""
    try:
        yield
    except (InvalidArgument, AirflowNotFoundException) as exc:
        raise AirflowFailException(f"{where}: {exc}") from exc


def try_number(context: Context) -> int:
    return int(getattr(context["ti"], "try_number", 1) or 1)


def task_key(task: Mapping[str, Any] | Task) -> str:
    """A task as its ``execution_log`` row's ``task_body`` holds it (checked and
    normalized by its kind), as comparable text."""
    return json.dumps(as_task(task).to_dict(), sort_keys=True)


def earlier_successes(
    scheduler: TaskScheduler, context: Context, handles: Sequence[str] | None = None
) -> list[Mapping[str, Any]]:
    """The ``execution_log`` rows this Airflow task instance (its DAG, run and task ids)
    sent in earlier tries and that ``SUCCEEDED``, in the order they were sent: on the
    schedulers ``handles``, or on any scheduler of the DAG run."""
    ids = airflow_ids(context)
    if handles is None:
        rows = scheduler.broker.fetch(
            "monitor_log_of_run",
            dag_id=ids["dag_id"],
            run_id=ids["run_id"],
            limit=RUN_ROWS,
            # the whole run: no page, no narrowing (the Execution Status page's filters)
            before=monitor.LAST_LOG_ID,
            target=None,
            kind=None,
            since=None,
            until=None,
        )
        handles = sorted({r["scheduler_handle"] for r in rows if r["task_id"] == ids["task_id"]})
    found = [
        row
        for handle in handles
        for row in scheduler.log(handle)
        if row["status"] == "SUCCEEDED"
        and (row["dag_id"], row["run_id"], row["task_id"])
        == (ids["dag_id"], ids["run_id"], ids["task_id"])
    ]
    return sorted(found, key=lambda r: int(r["log_id"]))


def skip_succeeded(
    tasks: Sequence[Mapping[str, Any]], succeeded: Sequence[Mapping[str, Any]]
) -> tuple[list[dict[str, Any]], list[Mapping[str, Any]]]:
    """(the tasks still to send, the rows of those that succeeded before): a task is
    matched to a row by its body, each row matching one task (a wave may hold the same
    task twice)."""
    rows: dict[str, collections.deque[Mapping[str, Any]]] = collections.defaultdict(
        collections.deque
    )
    for row in succeeded:
        rows[json.dumps(json.loads(row["task_body"]), sort_keys=True)].append(row)
    send: list[dict[str, Any]] = []
    done: list[Mapping[str, Any]] = []
    for task in tasks:
        matching = rows.get(task_key(task))
        if matching:
            done.append(matching.popleft())
        else:
            send.append(dict(task))
    return send, done


def row_summary(row: Mapping[str, Any]) -> dict[str, Any]:
    """An ``execution_log`` row as :func:`triggers.task_summary` makes a task's outcome."""
    return {
        "log_id": int(row["log_id"]),
        "task_name": row["task_name"],
        "status": row["status"],
        "error": row["error"],
        "result": None if row["result"] is None else json.loads(row["result"]),
    }


def row_line(row: Mapping[str, Any], note: str = "") -> str:
    """One task for the Airflow task's log: name, log id, status, duration, worker."""
    start, end = row.get("start_time"), row.get("end_time")
    took = f"{end - start:.2f} s" if start is not None and end is not None else "-"
    wave = f"wave {row['wave']}: " if row.get("wave") is not None else ""
    return (
        f"  {wave}{row['task_name']} (log id {row['log_id']}): {row['status']} in {took} "
        f"on {row.get('worker_id') or '-'}{note}"
    )


def log_tasks(
    task: BaseOperator,
    rows: Sequence[Mapping[str, Any]],
    earlier: Sequence[Mapping[str, Any]] = (),
) -> None:
    """Each task of the wave(s) in the task's log, with its status, duration and worker
    (those an earlier try ran marked so); and each wave this try sent in Airflow's
    metrics (:func:`wave_stats`)."""
    lines = [row_line(r, " (an earlier try)") for r in earlier] + [row_line(r) for r in rows]
    ordered = sorted(zip([*earlier, *rows], lines, strict=True), key=lambda x: x[0]["log_id"])
    task.log.info("%d task(s):\n%s", len(ordered), "\n".join(line for _, line in ordered))
    try:
        wave_stats(task, rows)
    except Exception:  # a metric never fails the task it describes
        task.log.warning("could not emit the waves' metrics", exc_info=True)


def wave_stats(task: BaseOperator, rows: Sequence[Mapping[str, Any]]) -> None:
    """Airflow's own metrics for each wave of ``rows`` (the tasks one try sent), through
    ``Stats`` to whatever ``[metrics]`` configures (StatsD, OpenTelemetry):
    ``scheduler_lib.wave.tasks_sent`` / ``tasks_failed`` (counters) and
    ``scheduler_lib.wave.duration`` (a timer: the first task sent to the last one ended),
    tagged with the DAG, the Airflow task and the scheduler's target."""
    waves: dict[Any, list[Mapping[str, Any]]] = collections.defaultdict(list)
    for row in rows:
        waves[row.get("wave")].append(row)
    for wave in waves.values():
        tags = {
            "dag_id": task.dag_id,
            "task_id": task.task_id,
            "target": str(wave[0].get("target_service") or ""),
        }
        failed = sum(1 for r in wave if r["status"] in FAILED_STATUSES)
        Stats.incr(f"{STATS_PREFIX}.tasks_sent", len(wave), tags=tags)
        Stats.incr(f"{STATS_PREFIX}.tasks_failed", failed, tags=tags)
        sent = [r["sent_at"] for r in wave if r.get("sent_at") is not None]
        ended = [r["end_time"] for r in wave if r.get("end_time") is not None]
        if sent and len(ended) == len(wave):
            took = datetime.timedelta(seconds=max(0.0, max(ended) - min(sent)))
            Stats.timing(f"{STATS_PREFIX}.duration", took, tags=tags)


def pull_handle(context: Context, handle: str | None, scheduler_task_id: str, where: str) -> str:
    """The scheduler handle given, or the one ``scheduler_task_id`` pushed to XCom."""
    if handle:
        return str(handle)
    got = context["ti"].xcom_pull(task_ids=scheduler_task_id)
    if isinstance(got, Mapping) and got.get("scheduler_handle"):
        return str(got["scheduler_handle"])
    raise AirflowFailException(
        f"{where}: task {scheduler_task_id!r} pushed no scheduler handle to XCom (got "
        f"{got!r}); is it a GetSchedulerOperator upstream of this task?"
    )


class GetSchedulerOperator(BaseOperator):
    """GetScheduler: begin a scheduler (a conversation to the target service).

    :param target_service: where its tasks go (default: the connection's)
    :param scheduler_lib_conn_id: the broker's connection
    :return: (XCom) ``{"scheduler_handle": ..., "target_service": ...}``
    """

    template_fields: Sequence[str] = ("target_service",)
    ui_color = "#e8f0d8"

    def __init__(
        self,
        *,
        target_service: str | None = None,
        scheduler_lib_conn_id: str = hooks.DEFAULT_CONN_ID,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.target_service = target_service
        self.scheduler_lib_conn_id = scheduler_lib_conn_id

    def execute(self, context: Context) -> dict[str, str]:
        with no_retry(self.task_id):
            hook = hooks.SchedulerLibHook(self.scheduler_lib_conn_id)
            handle = hook.get_scheduler(task_instance(context)).get_scheduler(
                target=self.target_service or None
            )
        self.log.info("scheduler %s to %s", handle, handle.target_service)
        return {"scheduler_handle": str(handle), "target_service": handle.target_service}


class ExecAsyncOperator(BaseOperator):
    """ExecAsync for one wave: log and send its tasks in one transaction (all or none) —
    and, with ``wait=True``, Synchronization for them too: one Airflow task per wave.

    Each task is a JSON object with a ``kind`` and the kind's fields, e.g.
    ``{"kind": "spark_sql", "sql": "INSERT INTO t SELECT ... WHERE day = '{{ ds }}'"}``
    (templated, also nested; a value ending in ``.sql`` is read from that file, beside
    the DAG or on its ``template_searchpath``). The Airflow DAG, run and task ids go into
    each task's ``execution_log`` row.

    :param tasks: the wave's tasks
    :param scheduler_task_id: the ``GetSchedulerOperator`` whose handle to use
    :param scheduler_handle: a handle given directly instead (templated)
    :param wave: the wave's number (the first is 1), kept as it is in
        ``execution_log.wave``
    :param wait: wait until the wave has completed, and fail (retryably, with the tasks'
        errors) when a task did not succeed
    :param policy: with ``wait``: ``fail_fast`` (default) — at the first task that did
        not succeed, cancel the wave's queued tasks and stop its running ones;
        ``continue`` — let them run
    :param retry_failed_only: a later try (``retries``) sends only the tasks that did not
        succeed in an earlier try on the same scheduler; ``False`` sends them all
    :param deferrable: with ``wait``, wait in the triggerer once ``defer_after`` seconds
        have passed (default: ``[operators] default_deferrable``, with ``wait``)
    :param defer_after: seconds to wait in place before deferring
    :param trigger_poll_interval: seconds between the trigger's looks
    :param scheduler_lib_conn_id: the broker's connection
    :return: (XCom) ``{"scheduler_handle": ..., "log_ids": [...], "wave": n}`` (the log
        ids this try sent), plus ``"tasks"`` (each task's outcome, earlier tries' included)
        with ``wait``
    """

    template_fields: Sequence[str] = ("tasks", "scheduler_handle")
    template_fields_renderers = {"tasks": "json"}
    template_ext: Sequence[str] = TEMPLATE_EXT
    ui_color = "#fdf1d8"

    def __init__(
        self,
        *,
        tasks: Sequence[Mapping[str, Any] | Task],
        scheduler_task_id: str = "get_scheduler",
        scheduler_handle: str | None = None,
        wave: int | None = None,
        wait: bool = False,
        policy: str = "fail_fast",
        retry_failed_only: bool = True,
        deferrable: bool | None = None,
        defer_after: float = DEFER_AFTER,
        trigger_poll_interval: float = triggers.POLL_INTERVAL,
        scheduler_lib_conn_id: str = hooks.DEFAULT_CONN_ID,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # A template or an upstream task's XCom is checked once rendered, in execute().
        self.tasks = tasks if _rendered_later(tasks) else plain_tasks(tasks, self.task_id)
        if wave is not None and (not isinstance(wave, int) or wave < 1):
            raise ValueError(f"{self.task_id}: wave is numbered from 1, got {wave!r}")
        if deferrable is None:
            deferrable = wait and sensors.default_deferrable()
        if deferrable and not wait:
            raise ValueError(f"{self.task_id}: deferrable=True waits, so it needs wait=True")
        self.scheduler_task_id = scheduler_task_id
        self.scheduler_handle = scheduler_handle
        self.wave = wave
        self.wait = wait
        self.policy = sensors.check_policy(policy, self.task_id)
        self.retry_failed_only = retry_failed_only
        self.deferrable = deferrable
        self.defer_after = defer_after
        self.trigger_poll_interval = trigger_poll_interval
        self.scheduler_lib_conn_id = scheduler_lib_conn_id
        self._sent: tuple[TaskScheduler, SchedulerHandle] | None = None

    def _earlier(
        self, scheduler: TaskScheduler, context: Context, key: str
    ) -> list[Mapping[str, Any]]:
        """This wave's tasks that succeeded in an earlier try, on this scheduler."""
        if not self.retry_failed_only or try_number(context) <= 1:
            return []
        rows = earlier_successes(scheduler, context, [key])
        return [r for r in rows if r["wave"] == self.wave]

    def execute(self, context: Context) -> dict[str, Any]:
        with no_retry(self.task_id):
            return self._execute(context)

    def _execute(self, context: Context) -> dict[str, Any]:
        load_kinds()
        key = pull_handle(context, self.scheduler_handle, self.scheduler_task_id, self.task_id)
        scheduler = hooks.SchedulerLibHook(self.scheduler_lib_conn_id).get_scheduler(
            task_instance(context)
        )
        try:
            handle = scheduler.attach(key)
        except SchedulerEnded as exc:
            raise AirflowFailException(f"{self.task_id}: {exc}") from None
        tasks = plain_tasks(sensors.native(self.tasks), self.task_id)
        tasks, done = skip_succeeded(tasks, self._earlier(scheduler, context, key))
        if done:
            self.log.info(
                "try %d: %d task(s) succeeded in an earlier try and are not sent again: %s",
                try_number(context),
                len(done),
                ", ".join(f"{r['task_name']} (log id {r['log_id']})" for r in done),
            )
        log_ids = scheduler.exec_many(handle, tasks, wave=self.wave)
        self.log.info("sent %d task(s) on scheduler %s: log ids %s", len(log_ids), key, log_ids)
        sent = {"scheduler_handle": key, "log_ids": log_ids, "wave": self.wave}
        if not self.wait:
            return sent
        self._sent = (scheduler, handle)
        try:
            progress = _wait_in_place(
                self,
                scheduler,
                handle,
                log_ids,
                timeout=self.defer_after if self.deferrable else None,
                fail_fast=self.policy == "fail_fast",
            )
        finally:
            self._sent = None
        if progress is None or (not progress.done and progress.ended_by_target is None):
            triggers.defer(
                self,
                key,
                log_ids,
                "execute_complete",
                self.execution_timeout,
                carry=sent,
                fail_fast=self.policy == "fail_fast",
            )
        event = _event(progress)
        event["carry"] = sent
        return self._complete(context, event, scheduler)

    def execute_complete(self, context: Context, event: dict[str, Any], **_: Any) -> Any:
        """The wave has completed (or cannot): its outcome, or the Airflow task fails."""
        with no_retry(self.task_id):
            return self._complete(context, event, None)

    def _complete(
        self, context: Context, event: dict[str, Any], scheduler: TaskScheduler | None
    ) -> Any:
        carry = event["carry"]
        if event.get("status") == triggers.DONE:
            if scheduler is None:
                hook = hooks.SchedulerLibHook(self.scheduler_lib_conn_id)
                scheduler = hook.get_scheduler(task_instance(context))
            key = str(carry["scheduler_handle"])
            sent = set(carry["log_ids"])
            before = [r for r in self._earlier(scheduler, context, key) if r["log_id"] not in sent]
            tasks = plain_tasks(sensors.native(self.tasks), self.task_id)
            earlier = skip_succeeded(tasks, before)[1]  # the rows this try did not send again
            rows = [r for r in scheduler.log(key) if r["log_id"] in sent]
            log_tasks(self, rows, earlier)
            tasks = sensors.event_outcome(event, self.task_id, retryable=True)
            return {**carry, "tasks": [*map(row_summary, earlier), *tasks]}
        return {**carry, "tasks": sensors.event_outcome(event, self.task_id, retryable=True)}

    def on_kill(self) -> None:
        """Killed while it waits: cancel the wave's tasks that have not started and stop
        the running ones."""
        sent = self._sent
        if sent is not None:
            scheduler, handle = sent
            scheduler.cancel(handle, "cancelled: the Airflow task was killed")


class ReleaseSchedulerOperator(BaseOperator):
    """ReleaseScheduler: cancel what has not run, stop what runs, end the conversation.

    Runs whatever happened upstream (``trigger_rule="all_done"``), and never fails
    because the scheduler is already gone.

    :param scheduler_task_id: the ``GetSchedulerOperator`` whose handle to release
    :param scheduler_handle: a handle given directly instead (templated)
    :param scheduler_lib_conn_id: the broker's connection
    """

    template_fields: Sequence[str] = ("scheduler_handle",)
    ui_color = "#f0e0e0"

    def __init__(
        self,
        *,
        scheduler_task_id: str = "get_scheduler",
        scheduler_handle: str | None = None,
        scheduler_lib_conn_id: str = hooks.DEFAULT_CONN_ID,
        trigger_rule: str = TriggerRule.ALL_DONE,
        **kwargs: Any,
    ) -> None:
        super().__init__(trigger_rule=trigger_rule, **kwargs)
        self.scheduler_task_id = scheduler_task_id
        self.scheduler_handle = scheduler_handle
        self.scheduler_lib_conn_id = scheduler_lib_conn_id

    def execute(self, context: Context) -> None:
        with no_retry(self.task_id):
            self._release(context)

    def _release(self, context: Context) -> None:
        got = self.scheduler_handle or context["ti"].xcom_pull(task_ids=self.scheduler_task_id)
        if isinstance(got, Mapping):
            got = got.get("scheduler_handle")
        if not got:
            self.log.info("no scheduler to release: %r pushed none", self.scheduler_task_id)
            return
        scheduler = hooks.SchedulerLibHook(self.scheduler_lib_conn_id).get_scheduler()
        try:
            handle = scheduler.attach(str(got))
        except SchedulerEnded as exc:
            self.log.info("nothing to release: %s", exc)
            return
        cancelled, stopping = scheduler.cancel(handle, "cancelled: the scheduler was released")
        scheduler.release_scheduler(handle)
        self.log.info(
            "released scheduler %s (%d queued task(s) cancelled, %d running asked to stop)",
            handle,
            cancelled,
            stopping,
        )


class OrderedWavesOperator(BaseOperator):
    """A whole plan of waves as one Airflow task: wave after wave, the tasks of a wave
    together, on one scheduler that is released at the end.

    :param waves: a list of waves, each a list of tasks (templated; a value ending in
        ``.sql`` is read from that file)
    :param policy: ``fail_fast`` (at the first failure cancel the rest and fail) or
        ``continue`` (run every wave, then fail if any task failed); either way the
        failure is retryable
    :param retry_failed_only: a later try (``retries``) runs the plan again on a new
        scheduler, sending only the tasks that did not succeed in an earlier try of this
        task instance (a wave whose tasks all succeeded is skipped); ``False`` sends all
    :param max_in_flight: at most this many tasks at once (not with ``deferrable``)
    :param target_service: where the tasks go (default: the connection's)
    :param deferrable: between waves, wait in the triggerer instead of a worker slot (a
        wave that completes within ``defer_after`` seconds is not deferred); default
        ``[operators] default_deferrable`` unless ``max_in_flight`` is given
    :param defer_after: seconds to wait in place before deferring a wave
    :param trigger_poll_interval: seconds between the trigger's looks
    :param scheduler_lib_conn_id: the broker's connection
    :return: (XCom) ``{"scheduler_handle": ..., "waves": [[task outcome, ...], ...]}``
        (earlier tries' successes included)
    """

    template_fields: Sequence[str] = ("waves", "target_service")
    template_fields_renderers = {"waves": "json"}
    template_ext: Sequence[str] = TEMPLATE_EXT
    ui_color = "#fdf1d8"

    def __init__(
        self,
        *,
        waves: Sequence[Sequence[Mapping[str, Any] | Task]],
        policy: str = "fail_fast",
        retry_failed_only: bool = True,
        max_in_flight: int | None = None,
        target_service: str | None = None,
        deferrable: bool | None = None,
        defer_after: float = DEFER_AFTER,
        trigger_poll_interval: float = triggers.POLL_INTERVAL,
        scheduler_lib_conn_id: str = hooks.DEFAULT_CONN_ID,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        sensors.check_policy(policy, self.task_id)
        if deferrable is None:
            deferrable = max_in_flight is None and sensors.default_deferrable()
        if deferrable and max_in_flight is not None:
            raise ValueError(
                f"{self.task_id}: max_in_flight needs a task that stays running; with "
                "deferrable=True cap concurrency with a named semaphore ('semaphore' field)"
            )
        if isinstance(waves, str | bytes) or not isinstance(waves, Sequence):
            raise InvalidTask(f"{self.task_id}: waves must be a list of lists of tasks")
        self.waves = [plain_tasks(w, f"{self.task_id}, wave {i}") for i, w in enumerate(waves, 1)]
        self.policy = policy
        self.retry_failed_only = retry_failed_only
        self.max_in_flight = max_in_flight
        self.target_service = target_service
        self.deferrable = deferrable
        self.defer_after = defer_after
        self.trigger_poll_interval = trigger_poll_interval
        self.scheduler_lib_conn_id = scheduler_lib_conn_id
        self._running: tuple[TaskScheduler, SchedulerHandle] | None = None
        self._killed = False

    def _scheduler(self, context: Context) -> TaskScheduler:
        load_kinds()
        hook = hooks.SchedulerLibHook(self.scheduler_lib_conn_id)
        return hook.get_scheduler(task_instance(context), target=self.target_service or None)

    def _earlier(
        self, scheduler: TaskScheduler, context: Context, number: int | None = None
    ) -> list[Mapping[str, Any]]:
        """Tasks (of wave ``number``, the first being 1, or of every wave) that succeeded
        in an earlier try of this task instance, on whichever scheduler that try had."""
        if not self.retry_failed_only or try_number(context) <= 1:
            return []
        rows = earlier_successes(scheduler, context)
        return [r for r in rows if number is None or r["wave"] == number]

    def _still_to_run(
        self, scheduler: TaskScheduler, context: Context, number: int, wave: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[Mapping[str, Any]]]:
        """Wave ``number`` (from 1): (its tasks to send, the rows of those an earlier try
        ran)."""
        send, done = skip_succeeded(wave, self._earlier(scheduler, context, number))
        if done:
            self.log.info(
                "try %d, wave %d/%d: %d task(s) succeeded in an earlier try and are not sent "
                "again: %s",
                try_number(context),
                number,
                len(self.waves),
                len(done),
                ", ".join(f"{r['task_name']} (log id {r['log_id']})" for r in done),
            )
        return send, done

    def execute(self, context: Context) -> dict[str, Any]:
        with no_retry(self.task_id):
            return self._execute(context)

    def _execute(self, context: Context) -> dict[str, Any]:
        scheduler = self._scheduler(context)
        if self.deferrable:
            handle = scheduler.get_scheduler()
            self.log.info("scheduler %s to %s", handle, handle.target_service)
            return self._from_wave(context, scheduler, str(handle), 0, [])
        plan = [
            self._still_to_run(scheduler, context, number, w)
            for number, w in enumerate(self.waves, start=1)
        ]
        waves = [send for send, _ in plan]  # a wave left empty keeps its place (and number)
        earlier = [done for _, done in plan]
        total = sum(len(w) for w in waves)
        done = 0

        def progress(wave: int, completion: Completion) -> None:
            nonlocal done
            if self._killed:
                # Out of run_waves, whose exit releases the scheduler.
                raise AirflowFailException(f"{self.task_id}: killed; the plan was cancelled")
            done += 1
            self.log.info(
                "wave %d/%d: %s %s (%d/%d)",
                wave,
                len(self.waves),
                completion.task_name or completion.log_id,
                completion.status,
                done,
                total,
            )

        def started(handle: SchedulerHandle) -> None:
            self._running = (scheduler, handle)

        try:
            report = scheduler.run_waves(
                waves,
                policy=self.policy,
                max_in_flight=self.max_in_flight,
                on_completion=progress,
                on_start=started,
            )
        except WaveFailed as exc:
            if exc.report is not None:
                self._log_rows(scheduler, str(exc.report.scheduler_handle), earlier)
            # Retryable: a retry sends again the tasks that did not succeed.
            raise sensors.WaveTasksFailed(f"{self.task_id}: {exc}") from None
        except DatabaseUnavailable as exc:
            # Past the reconnect deadline (every call rode through until then). A retry of
            # this task runs the plan again, on a new scheduler.
            running = self._running
            where = f"scheduler {running[1]}" if running is not None else "no scheduler yet"
            raise AirflowException(
                f"{self.task_id}: {hooks.outage_line(None, exc)}; the plan stopped waiting "
                f"({where}; tasks already sent may still run — release it once the "
                "database is back: ReleaseSchedulerOperator(scheduler_handle=...))"
            ) from None
        finally:
            self._running = None
        self._log_rows(scheduler, str(report.scheduler_handle), earlier)
        outcomes = [
            [*map(row_summary, before), *(triggers.task_summary(c) for c in w.completions)]
            for before, w in zip(earlier, report.waves, strict=True)
        ]
        if not report.ok:
            sensors.check([s for w in outcomes for s in w], self.task_id, retryable=True)
        return {"scheduler_handle": str(report.scheduler_handle), "waves": outcomes}

    def _log_rows(
        self, scheduler: TaskScheduler, key: str, earlier: Sequence[Sequence[Mapping[str, Any]]]
    ) -> None:
        log_tasks(self, scheduler.log(key), [r for w in earlier for r in w])

    # --- deferrable: one wave at a time, the waits in the triggerer -----------------------

    def _from_wave(
        self,
        context: Context,
        scheduler: TaskScheduler,
        key: str,
        index: int,
        outcomes: list[list[dict[str, Any]]],
    ) -> dict[str, Any]:
        handle = scheduler.attach(key)
        # ``index`` and ``i`` are positions in ``self.waves`` (what a deferral carries);
        # the log and the task's messages get the wave's number, ``i + 1``.
        for i in range(index, len(self.waves)):
            number = i + 1
            wave, done = self._still_to_run(scheduler, context, number, self.waves[i])
            before = [{k: v for k, v in row_summary(r).items() if k != "result"} for r in done]
            log_ids = scheduler.exec_many(handle, wave, wave=number)
            self.log.info("wave %d/%d sent: log ids %s", number, len(self.waves), log_ids)
            progress = _wait_in_place(
                self,
                scheduler,
                handle,
                log_ids,
                timeout=self.defer_after,
                fail_fast=self.policy == "fail_fast",
            )
            if progress is None or (not progress.done and progress.ended_by_target is None):
                carry = {
                    "scheduler_handle": key,
                    "index": i,
                    "outcomes": outcomes,
                    "earlier": before,
                }
                triggers.defer(
                    self,
                    key,
                    log_ids,
                    "resume_wave",
                    self.execution_timeout,
                    carry=carry,
                    fail_fast=self.policy == "fail_fast",
                )
            outcomes = self._after_wave(scheduler, handle, i, _event(progress), outcomes, before)
        return self._finish(context, scheduler, handle, outcomes)

    def resume_wave(self, context: Context, event: dict[str, Any], **_: Any) -> dict[str, Any]:
        """Back from the triggerer: judge the wave, then send the next one (where it
        stands comes back in the event's ``carry``)."""
        with no_retry(self.task_id):
            carry = event["carry"]
            key, index = carry["scheduler_handle"], carry["index"]
            scheduler = self._scheduler(context)
            handle = scheduler.attach(key)
            outcomes = self._after_wave(
                scheduler, handle, index, event, carry["outcomes"], carry.get("earlier", [])
            )
            return self._from_wave(context, scheduler, key, index + 1, outcomes)

    def _after_wave(
        self,
        scheduler: TaskScheduler,
        handle: SchedulerHandle,
        index: int,
        event: dict[str, Any],
        outcomes: list[list[dict[str, Any]]],
        earlier: list[dict[str, Any]],
    ) -> list[list[dict[str, Any]]]:
        try:
            tasks = event.get("tasks")
            if event.get("status") != triggers.DONE or tasks is None:
                sensors.event_outcome(event, f"{self.task_id}, wave {index + 1}")
            assert tasks is not None
            if self.policy == "fail_fast":
                sensors.check(tasks, f"{self.task_id}, wave {index + 1}", retryable=True)
        except Exception:
            with contextlib.suppress(Exception):
                log_tasks(self, scheduler.log(handle))
            scheduler.cancel(handle, f"cancelled: wave {index + 1} failed")
            scheduler.release_scheduler(handle)
            raise
        # What crosses a deferral is stored by Airflow: outcomes without results.
        wave = [{k: v for k, v in t.items() if k != "result"} for t in tasks]
        return [*outcomes, [*earlier, *wave]]

    def _finish(
        self,
        context: Context,
        scheduler: TaskScheduler,
        handle: SchedulerHandle,
        outcomes: list[list[dict[str, Any]]],
    ) -> dict[str, Any]:
        scheduler.release_scheduler(handle)
        key = str(handle)
        earlier = [r for r in self._earlier(scheduler, context) if r["scheduler_handle"] != key]
        log_tasks(self, scheduler.log(key), earlier)
        result = {"scheduler_handle": str(handle), "waves": outcomes}
        sensors.check([s for w in outcomes for s in w], self.task_id, retryable=True)
        return result

    def on_kill(self) -> None:
        """Killed while it runs: cancel the plan's queued tasks and stop the running ones.
        They answer ``CANCELLED`` at once (or when they stop), and the first answer ends
        the plan, which releases the scheduler — releasing it here instead would leave
        the waiting thread with a conversation nobody answers on."""
        self._killed = True
        running = self._running
        if running is not None:
            scheduler, handle = running
            scheduler.cancel(handle, "cancelled: the Airflow task was killed")


def _wait_in_place(
    task: BaseOperator,
    scheduler: TaskScheduler,
    handle: SchedulerHandle,
    log_ids: list[int],
    *,
    timeout: float | None,
    fail_fast: bool = False,
) -> WaveProgress | None:
    """``scheduler.wait_for_wave``; for a deferrable ``task``, ``None`` when the database
    stayed unavailable past the reconnect deadline meanwhile: the caller defers, and the
    trigger waits for the database (and the wave) without a worker slot. With
    ``fail_fast``, a task that did not succeed cancels the rest of the wave at once
    (see :func:`triggers.stop_the_rest`), and the wait goes on until they answered."""
    try:
        if not fail_fast:
            return scheduler.wait_for_wave(handle, log_ids, timeout=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        stopped = False
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            step = FAIL_FAST_STEP if left is None else min(left, FAIL_FAST_STEP)
            progress = scheduler.wait_for_wave(handle, log_ids, timeout=step)
            if progress.done or progress.ended_by_target is not None:
                return progress
            if not stopped and triggers.stop_the_rest(scheduler, handle, progress, task.log):
                stopped = True
                continue
            if left is not None and left <= step:
                return progress
    except Exception as exc:
        if not (getattr(task, "deferrable", False) and hooks.is_outage(exc)):
            raise
        task.log.warning(
            "wave of scheduler %s: %s; deferring: the trigger waits for the database",
            handle,
            hooks.outage_line(None, exc),
        )
        return None


def _event(progress: WaveProgress) -> dict[str, Any]:
    """What the trigger would have said about a wave that ended while we waited in place."""
    if progress.done:
        return {"status": triggers.DONE, "tasks": triggers.summaries(progress)}
    return {"status": triggers.ENDED, "message": progress.ended_by_target}


def _rendered_later(value: Any) -> bool:
    return isinstance(value, str) or hasattr(value, "resolve")  # Jinja text, or an XComArg
