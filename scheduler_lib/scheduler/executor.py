"""The executor: the target queue's activation procedure (the blog's
``ActivationAsyncTarget``).

Each task is taken under a lease in one short statement, and its ``execution_log``
start (who and when) is committed durably — on PostgreSQL in the take's round trip, or,
for a task taken ahead, in the answer of the task before it on the same reader; it
runs with no transaction open while the lease is renewed; its end, status, error and
result are written in the transaction that answers ``AsyncDone`` and completes the
lease. Errors are results: a task that raises answers ``FAILED`` with the error. A worker
that dies mid-task stops renewing its lease; the queue's poison policy (set by ``init``)
runs it again or fails it, and :func:`report_lost_task` tells the caller — nobody waits
for ever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

from scheduler_lib.broker import (
    END_DIALOG,
    ERROR,
    Broker,
    CannotConnect,
    ConnectionLost,
    ConversationNotFound,
    ConversationStateError,
    DatabaseError,
    DatabaseUnavailable,
    InvalidArgument,
    LeaseLost,
    SchemaMissing,
    SendAfter,
    SentBy,
    Transaction,
    activation,
)
from scheduler_lib.broker.leases import Lease
from scheduler_lib.broker.poison import PoisonEvent
from scheduler_lib.scheduler import catalog, logs, metrics
from scheduler_lib.scheduler.errors import InvalidTask, KindNotAllowed
from scheduler_lib.scheduler.kinds import Task, TaskContext, as_task, get_kind, job_group_of
from scheduler_lib.scheduler.prefetch import PREFETCH, Prefetched
from scheduler_lib.scheduler.semaphores import Semaphores

log = logging.getLogger(__name__)

IDLE_TIMEOUT = 10.0  # seconds; SCHEDULER_LIB_EXECUTOR_IDLE overrides it
POLL = 1.0  # seconds per RECEIVE while idle, so a stopping runtime is noticed
# The first pause after a look whose connection was refused for good or whose tables
# are gone (doubled at each one in a row, up to POLL): a database dropped or emptied, a
# role or password changed — no reconnect wait in it — once made a reader try some 300
# times a second, and log each.
FAILED_LOOK_PAUSE = 0.05
LEASE = 30.0  # seconds a task is held without a heartbeat (renewed every third)
TARGETS_REFRESH = 5.0  # seconds the allowed kinds of the targets are trusted
CANCEL_POLL = 0.5  # seconds between a worker's looks for cancel requests while tasks run
CANCEL_IDLE = 60.0  # seconds since a task last started (none running) before the watcher ends
ERROR_LIMIT = 8000  # characters of a task's error kept
RESULT_LIMIT = 64 * 1024  # characters of a task's result kept
# What a taken message runs as: this broker's log id, the task, where it came from when
# that is another broker, the Airflow task instance that sent it (the message's "airflow")
Started = tuple[int, Task, "Origin | None", "Mapping[str, Any] | None"]

SUCCEEDED, FAILED, CANCELLED = "SUCCEEDED", "FAILED", "CANCELLED"


class _Next(NamedTuple):
    """The held task a reader runs next, reserved for it at the answer of the task before
    (whose statement recorded its start, where it could: ``started``)."""

    lease: Lease
    at: float  # its start instant (time.time())
    started: bool
    renewal: contextlib.ExitStack  # its lease's, until it is started here


class _Targets(NamedTuple):
    """The targets' settings an executor trusts for ``TARGETS_REFRESH`` seconds."""

    read_at: float  # time.monotonic()
    kinds: dict[str, frozenset[str]]  # service -> the task kinds it runs
    lazy_queues: frozenset[str]  # queues whose tasks start without the flush


def serve(broker: Broker, queue: str) -> None:
    """The activation procedure: run tasks from ``queue`` until it has been idle for
    ``SCHEDULER_LIB_EXECUTOR_IDLE`` seconds (10 by default) or the runtime stops."""
    Executor(broker, queue).serve()


class Executor:
    """Runs the tasks of one target queue, one at a time per calling thread.

    :param sql_url: where ``sql`` tasks run (default: ``SCHEDULER_LIB_SQL_URL``, else the
        broker's own database, as the blog's ``exec(@SQL)`` does)
    :param worker: who runs a task, for ``execution_log.worker_id`` (default: host,
        process and reader; the Spark worker adds its application id)
    :param spark_application: (application id, UI URL) of the Spark application this
        executor's tasks run in, recorded with each task's start
    :param prefetch: most tasks one take gets while the queue's tasks run short, the
        others held for this process's next free reader, each started when it runs
        (:mod:`~scheduler_lib.scheduler.prefetch`; default ``SCHEDULER_LIB_EXECUTOR_PREFETCH``,
        else 4; 1 turns it off). PostgreSQL, without a Spark application.
    """

    def __init__(
        self,
        broker: Broker,
        queue: str,
        *,
        lease: float = LEASE,
        sql_url: str | None = None,
        idle_timeout: float | None = None,
        worker: Callable[[], str] | None = None,
        spark_application: tuple[str, str | None] | None = None,
        prefetch: int | None = None,
    ) -> None:
        catalog.prepare(broker)
        self.broker = broker
        self.queue = queue
        self.lease = lease
        self.idle_timeout = (
            idle_timeout
            if idle_timeout is not None
            else float(os.environ.get("SCHEDULER_LIB_EXECUTOR_IDLE", IDLE_TIMEOUT))
        )
        self.sql_url = (
            sql_url
            or os.environ.get("SCHEDULER_LIB_SQL_URL")
            or broker.url.render_as_string(hide_password=False)
        )
        self.semaphores = Semaphores(broker)
        self.worker = worker or worker_id
        self.spark_application = spark_application
        self.prefetch = prefetch if prefetch is not None else prefetch_setting()
        if self.prefetch < 1:
            raise InvalidArgument(f"prefetch must be at least 1, not {self.prefetch}")
        self._prefetched = Prefetched.of(broker, queue)
        self._cancels = CancelWatcher.of(broker)
        self._targets: _Targets | None = None
        self._remote: dict[str, bool] = {}  # conversation handle -> from another broker
        self._next: _Next | None = None  # what this reader runs next (_next_start)
        self._stop: threading.Event | None = None  # serve()'s

    def serve(self, stop: threading.Event | None = None) -> int:
        """Run tasks until idle for ``idle_timeout``, the activation runtime stops, or
        ``stop`` is set (for executors run as plain threads).

        :return: how many messages were handled
        """
        self._stop = stop
        try:
            return self._serve(stop)
        finally:
            nxt, self._next = self._next, None
            if nxt is not None:  # reserved and not run (the reader ends on an error)
                nxt.renewal.close()
                try:  # back to its queue
                    if not self.broker.closed:
                        self.broker.release(nxt.lease)
                except Exception:  # what went wrong is said; its lease expires anyway
                    log.exception("giving back the next task of %s failed", self.queue)
            stopping = activation.stopping() or (stop is not None and stop.is_set())
            if stopping and not self.broker.closed:
                # What this process took ahead goes back for others (its readers stop).
                try:
                    self._prefetched.give_back()
                except Exception:  # what went wrong is said; the reader stops anyway
                    log.exception("giving back the prefetched tasks of %s failed", self.queue)

    def _serve(self, stop: threading.Event | None) -> int:
        handled = 0
        idle_since = time.monotonic()
        refused = 0  # looks in a row refused for good (or without the broker's tables)
        # A task reserved for this reader (started, maybe) runs before it stops
        while self._next is not None or not (
            activation.stopping() or (stop is not None and stop.is_set())
        ):
            if self.broker.closed:  # nothing can be done any more
                return handled
            left = self.idle_timeout - (time.monotonic() - idle_since)
            if left <= 0 and self._next is None:
                return handled
            try:
                took = self.run_one(timeout=min(POLL, max(left, 0)))
            except (DatabaseError, LeaseLost) as exc:
                # The database went away (past the reconnect deadline, or mid-commit):
                # this reader stays and keeps trying (its calls back off through an
                # outage; a connection refused for good or a database without its
                # tables, after a pause growing to POLL: the database may be restored),
                # and those two are said once for the process, not at each look of each
                # reader; an outage is not idleness. What it held went back to the queue
                # or expires. (Other errors, e.g. SQLite's busy database, are tried again
                # at once, as before.)
                if isinstance(exc, CannotConnect | SchemaMissing):
                    self.broker.availability.report(log, f"executor on {self.queue}", exc)
                    pause = min(POLL, FAILED_LOOK_PAUSE * 2 ** min(refused, 10))
                    refused += 1
                    if stop is not None:
                        stop.wait(pause)
                    else:
                        time.sleep(pause)
                else:
                    log.warning("executor on %s: %s", self.queue, exc)
                idle_since = time.monotonic()
                continue
            refused = 0
            if took:
                handled += 1
                idle_since = time.monotonic()
        return handled

    def run_one(self, timeout: float | None = 0) -> bool:
        """Take one message and deal with it; ``False`` when none came within
        ``timeout``."""
        # The take holds the scheduler's conversation group only while it commits, and
        # commits without waiting for the WAL flush, so the group is free for the next
        # reader at once; the durable commit of the task's start flushes it before the
        # task runs (a crash before that puts the message back: nothing ran).
        recorded: frozenset[str] = frozenset()  # leases whose start the take recorded
        started_at: float | None = None  # a held task's start instant
        nxt, self._next = self._next, None
        held = None if nxt is not None else self._prefetched.pop()
        if nxt is not None:  # reserved at the last answer, which may have started it
            nxt.renewal.close()  # as a held one's: the reader renews it while it runs
            leases, started_at = [nxt.lease], nxt.at
            if nxt.started:
                recorded = frozenset({nxt.lease.lease_id})
        elif held is not None:  # taken ahead by this process: started now
            leases, started_at = [held], time.time()
        elif self.spark_application is None and self.broker.features.one_statement_take:
            # PostgreSQL: that start is a second transaction in the take's round trip,
            # saving one per task (a task it did not start is started below). With a
            # Spark application the start also names the job group: recorded below.
            worker = self.worker()
            leases, rows = self.broker.take_recorded(
                self.queue,
                "log_start_taken",
                {
                    "worker": worker,
                    "activated_task_id": activation.current_reader(),
                    "end_dialog": END_DIALOG,
                    "error": ERROR,
                },
                timeout=timeout,
                lease=self.lease,
                durable=self._durable_start(),
                top=self._prefetched.top(self.prefetch),
            )
            if leases:
                self._prefetched.took(leases[0].message.conversation_group_id)
            if rows is None and len(leases) > 1:
                rows = self._started_by_take(leases, worker)
            recorded = frozenset(str(row[0]) for row in rows or ())
            if len(leases) > 1:
                leases = [self._hold_rest(leases, recorded)]
        else:
            leases = self.broker.take(self.queue, timeout=timeout, lease=self.lease, durable=False)
        if not leases:
            return False
        lease = leases[0]
        try:
            started = self._start_riding_through(lease, lease.lease_id in recorded, started_at)
        except DatabaseError:
            # Its start could not be recorded: it goes back to its queue untouched (not
            # a failure), or, with the database still away, its lease expires later.
            with contextlib.suppress(DatabaseError):
                self.broker.release(lease)
            raise
        if started is not None:
            log_id, task, _, airflow = started
            sender = airflow or {}
            with logs.about_task(
                log_id=log_id,
                conversation_handle=str(lease.message.conversation_handle),
                task_name=task.label,
                task_kind=task.kind,
                dag_id=sender.get("dag_id"),
                run_id=sender.get("run_id"),
                task_id=sender.get("task_id"),
                try_number=sender.get("try_number"),
            ):
                self._run(lease, *started)
        return True

    def _started_by_take(self, leases: list[Lease], worker: str) -> list[tuple[str]]:
        """The leases whose start the take's statement recorded, read back when its
        reply was lost: of several, the one it started must run first, not wait held
        while its row says RUNNING."""
        by_log_id: dict[int, str] = {}
        for lease in leases:
            with contextlib.suppress(Exception):  # not a task (EndDialog, a bad body)
                by_log_id[int(lease.message.json()["log_id"])] = lease.lease_id
        if not by_log_id or leases[0].taken_at is None:
            return []
        try:
            found = self.broker.fetch(
                "log_started_in_take",
                log_ids=list(by_log_id),
                worker=worker,
                taken_at=leases[0].taken_at,
            )
        except DatabaseError as exc:
            log.warning("which task a take started is unknown: %s", exc)
            return []
        return [(by_log_id[int(row["log_id"])],) for row in found]

    def _hold_rest(self, leases: list[Lease], recorded: frozenset[str]) -> Lease:
        """Of a take of several, the lease to run now — the one whose start the take
        recorded, else the first — with the rest held for this process's next free
        reader; those below its level go back to the queue at once (a take holds no
        task that a higher one would wait behind)."""
        first = next((lease for lease in leases if lease.lease_id in recorded), leases[0])
        rest = [lease for lease in leases if lease is not first]
        lower = [lease for lease in rest if lease.message.priority < first.message.priority]
        kept = [lease for lease in rest if lease not in lower]
        try:
            for lease in lower:
                try:
                    self.broker.release(lease)
                except LeaseLost:
                    pass  # it expired meanwhile: its queue's poison policy has it
                except Exception:
                    kept.append(lease)  # held (renewed) until it goes back or runs
        finally:
            self._prefetched.hold(kept)
        return first

    def _start_riding_through(
        self, lease: Lease, recorded: bool, at: float | None = None
    ) -> Started | None:
        """:meth:`_start`, again while the database is away past the reconnect deadline
        (each call rides through up to it), unless this reader is asked to stop."""
        while True:
            try:
                return self.broker.retrying(
                    lambda: self._start(lease, recorded, at), what="a task's start"
                )
            except (DatabaseUnavailable, ConnectionLost) as exc:
                if activation.stopping():
                    raise
                handle = lease.message.conversation_handle
                log.warning("a task of %s not started yet: %s", handle, exc)

    def _is_remote(self, handle: Any) -> bool:
        """Whether the scheduler's conversation comes from another broker (its
        ``execution_log`` row is there, not here). Fixed for a conversation's life."""
        key = str(handle)
        remote = self._remote.get(key)
        if remote is None:
            try:
                remote = self.broker.conversation_endpoint(key).is_remote
            except ConversationNotFound:
                remote = False
            if len(self._remote) > 10_000:
                self._remote.clear()
            self._remote[key] = remote
        return remote

    def _copy_row(
        self,
        message: Any,
        payload: Mapping[str, Any],
        task: Task,
        origin: int,
        airflow: Mapping[str, Any] | None,
    ) -> int:
        """This broker's row for a task sent from another broker (made once); it names the
        sender's Airflow task instance, as the sender's row does."""
        sender = airflow or {}
        with self.broker.transaction() as tx:
            params = {"handle": str(message.conversation_handle), "origin_log_id": origin}
            tx.run(
                "log_insert_copy",
                caller_id=f"broker {message.service_name}",
                dag_id=sender.get("dag_id"),
                run_id=sender.get("run_id"),
                task_id=sender.get("task_id"),
                target=message.service_name,
                wave=payload.get("wave"),
                name=task.label[:256],
                kind=task.kind,
                body=json.dumps(task.to_dict()),
                now=time.time(),
                **params,
            )
            row = tx.fetch_one("log_of_origin", **params)
        assert row is not None
        return int(row["log_id"])

    # --- starting --------------------------------------------------------------------

    def _start(self, lease: Lease, recorded: bool, at: float | None = None) -> Started | None:
        """End dialogs, refuse what cannot run, record the start (durably) unless the
        take ``recorded`` it already; ``at``: its instant (a held task's), fixed across
        tries. Returns what to run — this broker's log id, the
        task, where it came from when that is another broker, and the Airflow task
        instance that sent it — or ``None`` when it was dealt with here."""
        message = lease.message
        handle = message.conversation_handle
        if message.message_type_name in (END_DIALOG, ERROR):
            # The scheduler was released (or failed): end our side, as the blog does
            # (after the lease: ending the conversation removes its leases).
            with self.broker.transaction() as tx:
                tx.complete(lease)
                with contextlib.suppress(ConversationNotFound, ConversationStateError):
                    tx.end_conversation(handle)
            return None
        log_id: int | None = None
        origin: Origin | None = None
        try:
            payload = message.json()
            log_id = int(payload["log_id"])
            airflow = payload.get("airflow")
            if not isinstance(airflow, dict):
                airflow = None  # a sender without Airflow (or not understood): none
            if self._is_remote(handle):
                origin = Origin(log_id)
            task = as_task(payload["task"], f"task {log_id}")
            get_kind(task.kind)
            allowed = self._allowed(message.service_name)
            if task.kind not in allowed:
                raise KindNotAllowed(
                    f"task {log_id}: target service {message.service_name!r} does not run "
                    f"{task.kind!r} tasks (it runs {sorted(allowed)})"
                )
        except DatabaseError:
            raise  # not the task's fault: its lease expires and it is tried again
        except Exception as exc:  # a task that cannot run is a failed result
            error = _error(exc)
            log.warning("refusing a task from %s: %s", handle, error)
            with self.broker.transaction() as tx:
                if log_id is not None and origin is None:
                    tx.run("log_fail", log_id=log_id, error=error, now=time.time())
                self._answer(tx, message, log_id, FAILED, error, None, origin)
                tx.complete(lease)
            return None
        if origin is not None:
            log_id = self._copy_row(message, payload, task, origin.log_id, airflow)
        if recorded:
            return log_id, task, origin, airflow
        application, job_group, ui_url = self._spark_at_start(task, log_id)
        if origin is not None:
            origin = Origin(origin.log_id, time.time(), application, job_group)
        started = self.broker.run(
            "log_start",
            lease_id=lease.lease_id,
            log_id=log_id,
            worker=self.worker(),
            activated_task_id=activation.current_reader(),
            application_id=application,
            job_group=job_group,
            ui_url=ui_url,
            # The take's instant where it is known: a start the take's round trip may
            # have recorded already (its reply lost) is then not counted twice. A task
            # held after its take starts when it runs.
            now=at if at is not None else lease.taken_at or time.time(),
        )
        if not started and not self.broker.holds(lease):
            # A server crash undid our take (it committed without the WAL flush): the
            # message is back on its queue for a reader to take again. Nothing ran here.
            log.warning("task %s: its take was undone by a database crash; not run here", log_id)
            return None
        if not started:
            # Cancelled (fail fast, release) before it started: say so, run nothing.
            with self.broker.transaction() as tx:
                row = tx.fetch_one("log_get", log_id=log_id)
                status = row["status"] if row is not None else CANCELLED
                error = row["error"] if row is not None else "the task's log row is gone"
                self._answer(tx, message, log_id, status, error, None, origin)
                tx.complete(lease)
            return None
        return log_id, task, origin, airflow

    def _spark_at_start(self, task: Task, log_id: int) -> tuple[str | None, str | None, str | None]:
        """(application, job group, UI) recorded with the start: known up front when the
        task runs in this executor's Spark application, in a group its kind names."""
        group = job_group_of(get_kind(task.kind), log_id)
        if self.spark_application is None or group is None:
            return None, None, None
        application, ui_url = self.spark_application
        return application, group, ui_url

    def _target_settings(self) -> _Targets:
        now = time.monotonic()
        if self._targets is None or now - self._targets.read_at > TARGETS_REFRESH:

            def read() -> list[Any]:
                with self.broker.transaction() as tx:
                    return tx.fetch("target_list")

            # Read before a take too: through a lost connection, as the take itself
            rows = self.broker.retrying(read, what="the targets' settings")
            durable = {r["queue_name"] for r in rows if r["durable_start"]}
            self._targets = _Targets(
                now,
                {r["service_name"]: frozenset(r["allowed_kinds"].split(",")) for r in rows},
                # A queue shared by targets starts lazily only if every one of them says so.
                frozenset({r["queue_name"] for r in rows} - durable),
            )
        return self._targets

    def _durable_start(self) -> bool:
        """Whether this queue's tasks wait for their start to reach the disk
        (``Target.durable_start``). Read once, then refreshed with the allowed kinds
        when tasks come (:meth:`_allowed`): an idle reader's takes cost no extra read."""
        return self.queue not in (self._targets or self._target_settings()).lazy_queues

    def _allowed(self, service: str) -> frozenset[str]:
        allowed = self._target_settings().kinds.get(service)
        if allowed is None:
            raise InvalidTask(
                f"service {service!r} is not a scheduler target",
                hint="scheduler_lib.scheduler.init(broker, targets=[Target(service=...)])",
            )
        return allowed

    # --- running ---------------------------------------------------------------------

    def _run(
        self,
        lease: Lease,
        log_id: int,
        task: Task,
        origin: Origin | None,
        airflow: Mapping[str, Any] | None,
    ) -> None:
        began = time.time()
        recorded = self._spark_at_start(task, log_id)

        def record_spark(
            application_id: str | None, job_group: str | None, ui_url: str | None
        ) -> None:
            if recorded == (application_id, job_group, ui_url):
                return  # written with the start
            self.broker.run(
                "log_spark",
                log_id=log_id,
                application_id=application_id,
                job_group=job_group,
                ui_url=ui_url,
            )

        context = TaskContext(
            log_id,
            task,
            self.sql_url,
            record_spark,
            priority=lease.message.priority,
            service=lease.message.service_name,
            airflow=airflow,
        )
        result: Any = None
        error: str | None = None
        interrupted: KeyboardInterrupt | None = None
        with self.broker.keep_alive([lease]) as lost, self._cancels.watching(context):
            try:
                with self._permit(task):
                    result = get_kind(task.kind).run(task.spec, context)
                status = SUCCEEDED
            # errors are results, sys.exit() and KeyboardInterrupt too: the task failed,
            # its caller is told at once, and the reader goes on
            except (Exception, SystemExit, KeyboardInterrupt) as exc:
                if isinstance(exc, KeyboardInterrupt) and _in_main_thread():
                    interrupted = exc  # Ctrl-C: answered, then it stops the process
                status, error = FAILED, _error(exc, with_traceback=True)
                if context.cancelled.is_set():  # it stopped because it was told to
                    status = CANCELLED
                    error = f"{context.cancel_reason} (it was running: {_error(exc)})"[:ERROR_LIMIT]
        self._prefetched.ran(time.time() - began)
        encoded = _result(result)
        finish = {
            "log_id": log_id,
            "status": status,
            "error": error,
            "result": encoded,
            "worker": self.worker(),
        }
        ended_at = time.time()

        def commit_outcome() -> None:
            def answer_on(
                on: Transaction | Broker,
                *,
                released_raises: bool = False,
                after: SendAfter | None = None,
                durable: bool = True,
            ) -> None:
                self._answer(
                    on,
                    lease.message,
                    log_id,
                    status,
                    error,
                    encoded,
                    origin,
                    completing=lease,
                    before=("log_finish", {"now": ended_at, **finish}),
                    released_raises=released_raises,
                    after=after,
                    durable=durable,
                )

            if self.broker.features.one_statement_send:
                # PostgreSQL: the answer, the lease's end and the row's end in one
                # statement, in autocommit: one round trip and one commit, and the
                # scheduler's endpoint, which every reader answers on, locked for no
                # longer (a lost lease writes nothing: LeaseLost). A scheduler released
                # meanwhile: the transaction below ends the row and the lease, no answer.
                # The start of the task this reader runs next rides at its end.
                # (Not after a Ctrl-C: the process stops, it would only go back.) A
                # target of lazy start (its tasks' effects idempotent) ends its tasks
                # lazily too: the statement commits without waiting for the WAL flush,
                # so the endpoint is unlocked at once and the wave's answers stop
                # queueing behind each other's flushes (docs/scheduler.md, "Durable or
                # lazy start").
                after = self._next_start() if interrupted is None else None
                durable = self._durable_start() or self.spark_application is not None
                try:
                    answer_on(self.broker, released_raises=True, after=after, durable=durable)
                    if after is not None and after.rows and self._next is not None:
                        self._next = self._next._replace(started=True)
                    return
                except (ConversationNotFound, ConversationStateError):
                    pass
            with self.broker.transaction() as tx:
                # The row's end goes first, in the answer's round trip; the answer ends the
                # lease (a lost one rolls it all back) and goes last: its SEND locks the
                # scheduler's endpoint, which every reader answers on, until the commit.
                answer_on(tx)

        try:
            if lost:
                raise next(iter(lost.values()))
            # The lease lives while the answer waits for the database: a storm of lost
            # connections once kept an answer retrying past the lease (31.8 s, lease
            # 30 s), and the poison policy failed a task that had run and succeeded.
            with self.broker.keep_alive([lease]):
                self._commit_outcome(log_id, commit_outcome)
            waited = began - lease.message.enqueued_at
            with contextlib.suppress(Exception):  # a count never costs a task its answer
                metrics.task_finished(self.queue, task.kind, status, ended_at - began, waited)
        except LeaseLost:
            # Unless our own commit went through before its connection was lost, it
            # expired meanwhile (the poison policy retried or failed it and told the
            # caller), or its scheduler was released and ended: no second answer. The row
            # still says how this run ended, unless another worker has it by now.
            if not self._outcome_recorded(log_id, status):
                log.warning("task %s finished after it lost its lease; no answer sent", log_id)
                self.broker.run("log_finish", now=ended_at, **finish)
        if interrupted is not None:
            raise interrupted

    def _next_start(self) -> SendAfter | None:
        """The start of the task this reader runs next, to ride in the answer of the one
        it ran (one round trip and one durable commit fewer per held task): the oldest
        task this process holds, reserved for this reader now (it runs it next, started or
        not). ``None`` — its start is recorded when it runs, as without — when one is
        reserved already (an answer tried again), nothing is held, the reader is stopping
        (what is held goes back), on Spark (the start names the job group), or when it is
        no task of this broker's (an end of dialog, a copy from another broker, a bad
        body: its start says what it is)."""
        stopping = activation.stopping() or (self._stop is not None and self._stop.is_set())
        if self._next is not None or self.spark_application is not None or stopping:
            return None
        popped = self._prefetched.pop_renewed()
        if popped is None:
            return None
        lease, renewal = popped  # renewed until it is started here: the answer may wait
        self._next = _Next(lease, time.time(), False, renewal)
        message = lease.message
        if message.message_type_name in (END_DIALOG, ERROR):
            return None
        try:
            if self._is_remote(message.conversation_handle):
                return None
            log_id = int(message.json()["log_id"])
        except Exception:  # (a read the start makes again, a body it refuses)
            return None
        return SendAfter(
            "log_start",
            {
                "lease_id": lease.lease_id,
                "log_id": log_id,
                "worker": self.worker(),
                "activated_task_id": activation.current_reader(),
                "application_id": None,
                "job_group": None,
                "ui_url": None,
                "now": self._next.at,
            },
        )

    def _commit_outcome(self, log_id: int, commit: Callable[[], None]) -> None:
        """Commit a finished task's outcome (its row's end, its answer, its lease's end:
        one transaction) — until it commits. The outcome is known and must not be lost,
        whatever the database does meanwhile: a task that ran is never run again because
        its answer could not be written. A commit whose connection was lost may have gone
        through; trying it again then finds the lease ended (LeaseLost), and the row says
        whether it was ours."""
        while True:
            try:
                self.broker.retrying(commit, what=f"task {log_id}'s answer")
                return
            except ConnectionLost as exc:  # lost while committing: see above
                log.warning("task %s: %s; trying again", log_id, exc)
            except DatabaseUnavailable as exc:
                if self.broker.closed:
                    # Nothing can be committed any more: the lease expires, and the poison
                    # policy retries or fails the task (its caller is told either way).
                    raise
                log.warning("task %s: its answer waits for the database: %s", log_id, exc)

    def _outcome_recorded(self, log_id: int, status: str) -> bool:
        """Whether the task's row already holds this run's end (written by a commit whose
        acknowledgement was lost)."""
        with contextlib.suppress(DatabaseError):
            (row,) = self.broker.fetch("log_get", log_id=log_id) or (None,)
            return (
                row is not None
                and row["end_time"] is not None
                and row["status"] == status
                and row["worker_id"] == self.worker()
            )
        return False

    @contextlib.contextmanager
    def _permit(self, task: Task) -> Iterator[None]:
        if task.semaphore is None:
            yield
            return
        with self.semaphores.hold(task.semaphore, lease=self.lease):
            yield

    # --- answering -------------------------------------------------------------------

    def _answer(
        self,
        on: Transaction | Broker,
        message: Any,
        log_id: int | None,
        status: str,
        error: str | None,
        result: str | None,
        origin: Origin | None = None,
        *,
        completing: Lease | None = None,
        before: tuple[str, Mapping[str, Any]] | None = None,
        released_raises: bool = False,
        after: SendAfter | None = None,
        durable: bool = True,
    ) -> None:
        extra = None
        if origin is not None:  # the initiator completes its own row from the answer
            log_id = origin.log_id
            extra = origin.answer(self.worker())
        answer(
            on,
            message.conversation_handle,
            message.service_contract_name,
            log_id,
            status,
            error,
            result,
            extra,
            completing=completing,
            before=before,
            released_raises=released_raises,
            after=after,
            durable=durable,
        )


def answer(
    on: Transaction | Broker,
    handle: Any,
    contract: str,
    log_id: int | None,
    status: str,
    error: str | None,
    result: str | None,
    extra: Mapping[str, Any] | None = None,
    *,
    completing: Lease | None = None,
    before: tuple[str, Mapping[str, Any]] | None = None,
    released_raises: bool = False,
    after: SendAfter | None = None,
    durable: bool = True,
) -> None:
    """Send ``AsyncDone`` (the contract's target-sent type) on the scheduler's
    conversation, in the transaction ``on`` (or, given the broker, in one of its own);
    a scheduler that was released meanwhile is not an error (``released_raises``: it
    raises, for a caller on the broker, whose SEND then did nothing). ``extra`` goes
    with it for an initiator on another broker (who ran it, when); ``completing`` is
    the task's lease, which ends with the answer; ``before`` (a named statement and its
    binds) is written with it, in the same round trip on PostgreSQL — and, in a
    transaction, stays done when the scheduler was released; ``after`` rides at the end
    of the SEND's statement where it can; not ``durable``, that statement commits
    without waiting for the WAL flush (``Broker.send``).

    :raises LeaseLost: when ``completing`` was gone (roll back: no answer)
    """
    done = _done_type(on, contract)
    body = json.dumps(
        {"log_id": log_id, "status": status, "error": error, "result": result, **(extra or {})}
    )
    try:  # these are raised by the broker's own checks: the transaction stays usable
        on.send(
            handle,
            done,
            body,
            completing=completing,
            before=before,
            after=after,
            durable=durable,
        )
    except (ConversationNotFound, ConversationStateError):
        if released_raises:
            raise
        # (a lease it completes was ended before the checked SEND raised this)
        log.info("task %s ended after its scheduler was released", log_id)


_done_types: dict[str, str] = {}


def _done_type(on: Transaction | Broker, contract: str) -> str:
    done = _done_types.get(contract)
    if done is None:
        targets = [t for t, by in on.contract(contract).items() if by is SentBy.TARGET]
        if len(targets) != 1:
            raise InvalidTask(
                f"contract {contract!r} must have exactly one message type sent by the "
                f"target (the scheduler's AsyncDone), has {targets}"
            )
        done = _done_types[contract] = targets[0]
    return done


class CancelWatcher:
    """Tells the running tasks of one process (on one broker) that they were cancelled.

    One thread per broker wakes every ``CANCEL_POLL`` seconds and, when tasks run, looks
    for cancel requests; the query reads a partial index of the rows asked to stop, so it
    stays cheap however long the log is. A request can only be for a task that runs (one
    still queued is cancelled in its row) and is told within ``CANCEL_POLL`` plus a
    query. The thread is never woken by a task, whose start and end only change the set
    of running tasks (waking it at each task that found it idle, to look at once as it
    once did, cost a thread switch per short task and a query per isolated one). After
    ``CANCEL_IDLE`` seconds with no task started the thread ends; the next task starts
    another.
    """

    _lock = threading.Lock()

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._running: dict[int, TaskContext] = {}
        self._guard = threading.Lock()
        self._thread: threading.Thread | None = None
        self._busy_at = 0.0  # when a task last started (monotonic)

    @classmethod
    def of(cls, broker: Broker) -> CancelWatcher:
        with cls._lock:
            watcher = getattr(broker, "_cancel_watcher", None)
            if watcher is None:
                watcher = cls(broker)
                broker._cancel_watcher = watcher  # type: ignore[attr-defined]
            return watcher

    @contextlib.contextmanager
    def watching(self, context: TaskContext) -> Iterator[None]:
        with self._guard:
            self._running[context.log_id] = context
            self._busy_at = time.monotonic()
            # (not alive: it ended, or this is a child forked with the parent's state)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._watch, name="task-cancel-watcher", daemon=True
                )
                self._thread.start()
        try:
            yield
        finally:
            with self._guard:
                self._running.pop(context.log_id, None)

    def _watch(self) -> None:
        while True:
            time.sleep(CANCEL_POLL)
            with self._guard:
                if not self._running:
                    if time.monotonic() - self._busy_at >= CANCEL_IDLE:
                        self._thread = None  # the next task starts another
                        return
                    continue
            try:
                requests = self.broker.fetch("log_cancel_requests")
            except Exception as exc:
                self.broker.availability.report(log, "looking for cancel requests failed", exc)
                requests = []
            with self._guard:
                # A request stays until its task answers: told once is enough (the
                # cancel is idempotent, but each look logged it again, every half second).
                targets = [
                    (self._running[r["log_id"]], r["cancel_reason"])
                    for r in requests
                    if r["log_id"] in self._running
                    and not self._running[r["log_id"]].cancelled.is_set()
                ]
            for context, reason in targets:
                log.info("task %s: %s", context.log_id, reason)
                context.cancel(reason or "cancelled")


def report_lost_task(event: PoisonEvent) -> None:
    """The target queue's poison callback: a task whose worker went silent (its lease
    expired ``retries + 1`` times) failed — its row says so and its caller is told."""
    tx: Transaction = event.tx  # the routing transaction
    tx.broker.use_queries(catalog.QUERIES)
    message = event.message
    try:
        log_id: int | None = int(message.json()["log_id"])
    except (ValueError, KeyError, TypeError):
        log_id = None
    error = (
        f"the task's worker stopped without an answer "
        f"({event.failures} time(s)): {event.last_error or 'unknown'}"
    )
    extra = None
    if log_id is not None and tx.conversation_endpoint(message.conversation_handle).is_remote:
        # Sent from another broker: this broker's row is its copy; the answer says it all.
        copy = tx.fetch_one(
            "log_of_origin", handle=str(message.conversation_handle), origin_log_id=log_id
        )
        if copy is not None:
            tx.run("log_fail", log_id=copy["log_id"], error=error, now=time.time())
        extra = {"remote": True, "ended_at": time.time()}
    elif log_id is not None:
        tx.run("log_fail", log_id=log_id, error=error, now=time.time())
    answer(
        tx,
        message.conversation_handle,
        message.service_contract_name,
        log_id,
        FAILED,
        error,
        None,
        extra,
    )


@dataclasses.dataclass(frozen=True)
class Origin:
    """A task sent from another broker: the initiator's log id and what its row will
    need from the answer."""

    log_id: int
    started_at: float | None = None
    application_id: str | None = None
    job_group: str | None = None

    def answer(self, worker: str) -> dict[str, Any]:
        return {
            "remote": True,
            "worker": worker,
            "started_at": self.started_at,
            "ended_at": time.time(),
            "application_id": self.application_id,
            "job_group": self.job_group,
        }


_process_id: tuple[int, str] | None = None  # (pid, "host:pid"), remade after a fork


def prefetch_setting() -> int:
    """``SCHEDULER_LIB_EXECUTOR_PREFETCH``, else 4 (:mod:`~scheduler_lib.scheduler.prefetch`)."""
    text = os.environ.get("SCHEDULER_LIB_EXECUTOR_PREFETCH", "").strip()
    if not text:
        return PREFETCH
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise InvalidArgument(
            f"SCHEDULER_LIB_EXECUTOR_PREFETCH={text!r}: give a whole number of tasks, at "
            "least 1 (1: no prefetch)"
        )
    return value


def worker_id() -> str:
    """Who runs a task: host, process and reader (our SPID)."""
    global _process_id
    pid = os.getpid()
    if _process_id is None or _process_id[0] != pid:
        _process_id = (pid, f"{socket.gethostname()}:{pid}")
    return f"{_process_id[1]}:{threading.current_thread().name}"


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _error(exc: BaseException, *, with_traceback: bool = False) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if with_traceback:
        text += "\n" + "".join(traceback.format_tb(exc.__traceback__)[-5:])
    return text[:ERROR_LIMIT]


def _result(value: Any) -> str | None:
    if value is None:
        return None
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):  # not JSON, or nested past reason
        text = json.dumps(repr(value))
    if len(text) > RESULT_LIMIT:  # keep the log row small, and still valid JSON
        text = json.dumps({"truncated": True, "length": len(text), "head": text[:1000]})
    return text


def decode_result(done: Mapping[str, Any]) -> Any:
    """The task's result as the caller sees it (JSON-decoded)."""
    raw = done.get("result")
    return None if raw is None else json.loads(raw)
