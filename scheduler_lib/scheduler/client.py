"""The caller's side of the blog's pattern: ``GetScheduler``, ``ExecAsync``,
``Synchronization``, ``ReleaseScheduler`` — and waves on top of them.

A scheduler handle is one conversation from the initiator service to a target service.
Each ``exec_async`` writes the task's ``execution_log`` row and sends it, in one
transaction; each ``synchronization`` receives one ``AsyncDone`` of that conversation.
Errors are results: a failed task comes back as a :class:`Completion` with its error.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from scheduler_lib.broker import (
    END_DIALOG,
    ERROR,
    Broker,
    ConnectionLost,
    ConversationNotFound,
    ConversationStateError,
    DatabaseUnavailable,
    EndpointState,
)
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.exceptions import InvalidArgument, ServiceNotFound
from scheduler_lib.broker.poison import worker_name
from scheduler_lib.scheduler import catalog, metrics
from scheduler_lib.scheduler.errors import (
    KindNotAllowed,
    SchedulerEnded,
    SynchronizationTimeout,
    UnknownKind,
    WaveFailed,
)
from scheduler_lib.scheduler.executor import CANCELLED, FAILED, SUCCEEDED
from scheduler_lib.scheduler.kinds import KINDS, Task, as_task

log = logging.getLogger(__name__)

POLICIES = ("fail_fast", "continue")
ENDED = (SUCCEEDED, FAILED, CANCELLED)
WAVE_WAIT_STEP = 5.0  # seconds: a waiting watcher re-reads the log at least this often
# seconds: run_waves gathers the answers arriving this long after the first before it
# RECEIVEs them all at once (and waits at most this long for a first one)
GATHER_WINDOW = 0.01
LOG_ID_BLOCK = 64  # log ids a scheduler takes from the sequence at a time (PostgreSQL)
AIRFLOW_FIELDS = ("dag_id", "run_id", "task_id")  # recorded in execution_log
# The sender's Airflow task instance, carried in each task's message (the executor's
# TaskContext.airflow): its ids, and its OpenLineage run, the parent of the task's own
# lineage run (names as the OpenLineage provider's macros)
INSTANCE_FIELDS = (
    *AIRFLOW_FIELDS,
    "try_number",
    "map_index",
    "lineage_job_namespace",
    "lineage_job_name",
    "lineage_run_id",
    "lineage_root_job_namespace",
    "lineage_root_job_name",
    "lineage_root_run_id",
)


@dataclasses.dataclass(frozen=True)
class Completion:
    """One ``AsyncDone``: which task, how it ended, its error or result."""

    log_id: int | None
    status: str  # SUCCEEDED, FAILED or CANCELLED
    error: str | None = None
    result: Any = None
    task_name: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == SUCCEEDED


@dataclasses.dataclass(eq=False)
class SchedulerHandle:
    """A scheduler: its conversation, its target, and what it has in flight."""

    conversation_handle: uuid.UUID
    target_service: str
    max_in_flight: int | None = None
    in_flight: int = 0
    # completions taken but not returned yet: exec_async's at max_in_flight, run_waves'
    # batches, and those read from the log after a RECEIVE whose commit was lost
    # (synchronization takes one answer per RECEIVE: the queue keeps the others)
    ahead: collections.deque[Completion] = dataclasses.field(default_factory=collections.deque)
    ended: SchedulerEnded | None = None  # the conversation ended; raised when ahead is empty
    arrivals: int | None = None  # the initiator queue's arrivals before run_waves' last RECEIVE
    names: dict[int, str] = dataclasses.field(default_factory=dict)  # log id -> task label
    # log ids whose completion was returned: an answer taken twice (its RECEIVE's commit
    # was lost, so its completion was read from the log) is returned once
    completed: set[int] = dataclasses.field(default_factory=set)

    def __str__(self) -> str:
        return str(self.conversation_handle)


@dataclasses.dataclass(frozen=True)
class TaskState:
    """A task's row of ``execution_log`` as a watcher in another process sees it."""

    log_id: int
    task_name: str
    status: str  # QUEUED, RUNNING, SUCCEEDED, FAILED or CANCELLED
    error: str | None = None
    result: Any = None
    wave: int | None = None
    start_time: float | None = None
    end_time: float | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> TaskState:
        return cls(
            log_id=int(row["log_id"]),
            task_name=row["task_name"],
            status=row["status"],
            error=row["error"],
            result=None if row["result"] is None else json.loads(row["result"]),
            wave=row["wave"],
            start_time=row["start_time"],
            end_time=row["end_time"],
        )

    @property
    def ended(self) -> bool:
        return self.status in ENDED


@dataclasses.dataclass(frozen=True)
class WaveProgress:
    """Where a wave sent by :meth:`TaskScheduler.exec_many` stands: the durable answer
    to "has it completed?" that any process can ask again (an Airflow sensor that was
    rescheduled, a trigger that moved to another triggerer)."""

    tasks: tuple[TaskState, ...]
    ended_by_target: str | None = None  # the target ended the conversation: how

    @property
    def done(self) -> bool:
        return all(t.ended for t in self.tasks)

    @property
    def pending(self) -> list[TaskState]:
        return [t for t in self.tasks if not t.ended]


@dataclasses.dataclass
class WaveReport:
    """One wave of :meth:`TaskScheduler.run_waves`: its number (the first wave is 1, as in
    ``execution_log.wave``), the completions it received, the tasks it did not send."""

    number: int
    completions: list[Completion]
    not_sent: list[Task]


@dataclasses.dataclass
class RunReport:
    """What :meth:`TaskScheduler.run_waves` did, wave by wave."""

    scheduler_handle: uuid.UUID
    waves: list[WaveReport]
    started_at: float
    ended_at: float

    @property
    def completions(self) -> list[Completion]:
        return [c for w in self.waves for c in w.completions]

    @property
    def failures(self) -> list[Completion]:
        return [c for c in self.completions if not c.ok]

    @property
    def ok(self) -> bool:
        return not self.failures and not any(w.not_sent for w in self.waves)


class TaskScheduler:
    """The scheduler pattern for one caller.

    :param broker: the broker (its database holds the scheduler's catalog: run
        :func:`~scheduler_lib.scheduler.init` once)
    :param target: the default target service
    :param context: the sending Airflow task instance: its ``dag_id`` / ``run_id`` /
        ``task_id``, recorded in the log; those and the other :data:`INSTANCE_FIELDS` that
        are set travel in each task's message, for the worker (``TaskContext.airflow``)
    """

    def __init__(
        self,
        broker: Broker,
        *,
        names: catalog.Names | None = None,
        target: str = catalog.Target.service,
        caller_id: str | None = None,
        context: Mapping[str, str | int | None] | None = None,
    ) -> None:
        catalog.prepare(broker)
        self.broker = broker
        self.names = names or catalog.Names()
        self.target = target
        self.caller_id = caller_id or worker_name()
        self.context, self.airflow = _instance(context or {})
        # The messages' extra field, encoded once: nothing more per task than its bytes
        self._airflow_json = (
            f', "airflow": {json.dumps(self.airflow, separators=(",", ":"))}'
            if self.airflow
            else ""
        )
        self._kinds: dict[str, frozenset[str]] = {}
        self._remote: dict[str, bool] = {}  # conversation handle -> target on another broker
        self._log_ids: collections.deque[int] = collections.deque()  # taken, not yet used
        self._log_ids_lock = threading.Lock()

    # --- the blog's four procedures ---------------------------------------------------

    def get_scheduler(
        self, *, target: str | None = None, max_in_flight: int | None = None
    ) -> SchedulerHandle:
        """GetScheduler: a new scheduler (conversation) to ``target``.

        :param max_in_flight: at most this many of its tasks sent and not yet completed;
            ``exec_async`` waits (collecting completions for ``synchronization``) beyond it
        """
        if max_in_flight is not None:
            max_in_flight = checks.positive_int(max_in_flight, "max_in_flight")
        service = target or self.target
        self._allowed(service)  # an unknown target fails here, not at the first task
        handle = self.broker.begin_dialog(
            self.names.initiator_service, service, self.names.contract
        )
        return SchedulerHandle(handle, service, max_in_flight)

    def exec_async(
        self, handle: SchedulerHandle, task: Task | Mapping[str, Any], *, wave: int | None = None
    ) -> int:
        """ExecAsync: log the task and send it, in one transaction.

        :param wave: the wave's number for ``execution_log.wave``: the first wave is 1
            (1 to 2**31 - 1), ``None`` for a task outside any wave
        :return: the task's ``log_id``
        :raises InvalidArgument: for a wave that is not an integer from 1 to 2**31 - 1
        :raises InvalidTask: for a malformed task (nothing is sent)
        :raises KindNotAllowed: when the target does not run the task's kind
        """
        wave = _wave(wave)
        checked = as_task(task)
        self._check_kind(handle.target_service, checked)
        while handle.max_in_flight is not None and handle.in_flight >= handle.max_in_flight:
            handle.ahead.append(self._receive(handle, None))
        return self._send(handle, [checked], wave)[0]

    def exec_many(
        self,
        handle: SchedulerHandle,
        tasks: Sequence[Task | Mapping[str, Any]],
        *,
        wave: int | None = None,
    ) -> list[int]:
        """ExecAsync for several tasks in one transaction (one commit): all are sent or
        none. Beyond ``max_in_flight`` it raises instead of waiting.

        :param wave: the wave's number, as for :meth:`exec_async` (the first wave is 1)
        :return: the tasks' ``log_id``s, in order
        """
        wave = _wave(wave)
        checked = [as_task(t, f"task {i}") for i, t in enumerate(tasks, start=1)]
        for t in checked:
            self._check_kind(handle.target_service, t)
        limit = handle.max_in_flight
        if limit is not None and handle.in_flight + len(checked) > limit:
            raise InvalidArgument(
                f"scheduler {handle}: {len(checked)} more tasks would exceed max_in_flight="
                f"{limit} ({handle.in_flight} in flight)"
            )
        return self._send(handle, checked, wave) if checked else []

    def _send(self, handle: SchedulerHandle, tasks: Sequence[Task], wave: int | None) -> list[int]:
        # Where SEND is one statement (PostgreSQL) the rows ride in its round trip, with
        # their ids taken ahead from the log's sequence (the PostgreSQL queries).
        if self.broker.features.one_statement_send:
            return self._send_batch(handle, tasks, wave)
        log_ids = []
        with self.broker.transaction() as tx:
            for task in tasks:
                body = task.to_dict()
                log_id = int(
                    tx.fetch_value(
                        "log_insert",
                        caller_id=self.caller_id,
                        handle=str(handle.conversation_handle),
                        target=handle.target_service,
                        wave=wave,
                        name=task.label[:256],
                        kind=task.kind,
                        body=json.dumps(body),
                        now=time.time(),
                        **self.context,
                    )
                )
                message = {"log_id": log_id, "task": body, "wave": wave}
                if self.airflow:
                    message["airflow"] = self.airflow
                tx.send(handle.conversation_handle, self.names.sent, json.dumps(message))
                log_ids.append(log_id)
        handle.in_flight += len(log_ids)
        for log_id, task in zip(log_ids, tasks, strict=True):
            handle.names[log_id] = task.label
        return log_ids

    def synchronization(self, handle: SchedulerHandle, timeout: float | None = None) -> Completion:
        """Synchronization: wait for one of the scheduler's tasks to complete.

        :param timeout: seconds; ``None`` waits for ever (as the blog's ``TIMEOUT -1``)
        :raises SynchronizationTimeout: when nothing completed within ``timeout``
        :raises SchedulerEnded: when the conversation was ended (``EndDialog``/``Error``)
        """
        if handle.ahead:
            return handle.ahead.popleft()
        return self._receive(handle, timeout)

    def release_scheduler(self, handle: SchedulerHandle) -> None:
        """ReleaseScheduler: end the conversation. Its tasks that have not started are
        cancelled (they will not run) and its running tasks are asked to stop (a Spark
        task's job group is cancelled; their rows say how they ended). Never fails
        because the conversation is already gone (the blog's "evil DBA" case)."""
        if handle.in_flight:
            self.cancel(handle, "cancelled: the scheduler was released")
        while True:
            try:
                with contextlib.suppress(ConversationNotFound, ConversationStateError):
                    self.broker.end_conversation(handle.conversation_handle)
                return
            except ConnectionLost as exc:
                # The END's commit answer was lost: END again. Had it committed, this END
                # finds the conversation ended (or gone), which release does not mind.
                log.warning("%s; ending the scheduler's conversation again", exc)

    @contextlib.contextmanager
    def scheduler(
        self, *, target: str | None = None, max_in_flight: int | None = None
    ) -> Iterator[SchedulerHandle]:
        """A scheduler for the ``with`` block, released at its end."""
        handle = self.get_scheduler(target=target, max_in_flight=max_in_flight)
        try:
            yield handle
        except DatabaseUnavailable:
            # Releasing would wait out a second reconnect deadline and hide this error;
            # the conversation stays, its sent tasks still run and their rows end truly.
            raise
        except BaseException:
            self.release_scheduler(handle)
            raise
        self.release_scheduler(handle)

    def cancel_queued(self, handle: SchedulerHandle, reason: str = "cancelled") -> int:
        """Mark the scheduler's tasks that have not started as cancelled; the executor
        answers them ``CANCELLED`` without running them.

        :return: how many were cancelled
        """
        return self.cancel(handle, reason, running=False)[0]

    def cancel(
        self, handle: SchedulerHandle, reason: str = "cancelled", *, running: bool = True
    ) -> tuple[int, int]:
        """Cancel the scheduler's tasks that have not started and ask the workers running
        its other tasks to stop them (within about a second); each still answers, with
        ``CANCELLED`` when it stopped early.

        :return: (tasks cancelled before they started, running tasks asked to stop)
        """
        now = time.time()

        def cancel() -> tuple[int, int]:
            with self.broker.transaction() as tx:
                queued = tx.run(
                    "log_cancel_queued",
                    handle=str(handle.conversation_handle),
                    reason=reason,
                    now=now,
                )
                stopping = 0
                if running:
                    stopping = tx.run(
                        "log_cancel_running",
                        handle=str(handle.conversation_handle),
                        reason=reason,
                        now=now,
                    )
            return queued, stopping

        return self.broker.retrying(cancel, what="cancel")

    def cancel_task(self, log_id: int, reason: str = "cancelled") -> str:
        """Cancel one task of the log, whichever scheduler sent it (the Execution Status
        page's action): a task that has not started will not run (the executor answers it
        ``CANCELLED`` when it takes its message), the worker running a started one is
        asked to stop it (within about a second; it answers ``CANCELLED``).

        :param log_id: the task's ``execution_log.log_id``
        :param reason: what its row's error (or cancel reason) will say
        :return: ``"cancelled"`` (it had not started), ``"stopping"`` (its worker was
            asked to stop it, now or before), or the status it had already ended with
            (nothing was done)
        :raises InvalidArgument: for a log id that is no row of the log
        """
        log_id = checks.positive_int(log_id, "log_id")

        def cancel() -> str:
            with self.broker.transaction() as tx:
                now = time.time()
                if tx.run("log_cancel_queued_task", log_id=log_id, reason=reason, now=now):
                    return "cancelled"
                tx.run("log_cancel_running_task", log_id=log_id, reason=reason, now=now)
                row = tx.fetch_one("log_get", log_id=log_id)
            if row is None:
                raise InvalidArgument(f"log id {log_id}: no such row in execution_log")
            return "stopping" if row["status"] not in ENDED else str(row["status"])

        return self.broker.retrying(cancel, what="cancel")

    def resend_task(self, log_id: int) -> int:
        """Send a task of the log that failed (or was cancelled) again, the same body in
        the same wave, on the scheduler that sent it (the Execution Status page's retry of
        a task sent outside Airflow): the scheduler's owner receives its completion as of
        any task it sent.

        :param log_id: the task's ``execution_log.log_id``
        :return: the new task's ``log_id``
        :raises InvalidArgument: for a log id that is no row of the log, or a task that
            has not ended or succeeded
        :raises SchedulerEnded: when its scheduler's conversation is gone or ended
        """
        log_id = checks.positive_int(log_id, "log_id")
        rows = self.broker.fetch("log_get", log_id=log_id)
        if not rows:
            raise InvalidArgument(f"log id {log_id}: no such row in execution_log")
        row = rows[0]
        if row["status"] not in (FAILED, CANCELLED):
            raise InvalidArgument(
                f"log id {log_id} is {row['status']}: only a failed or cancelled task is sent again"
            )
        handle = self.attach(row["scheduler_handle"])
        return self.exec_async(handle, json.loads(row["task_body"]), wave=row["wave"])

    def log(self, handle: SchedulerHandle | uuid.UUID | str) -> list[Mapping[str, Any]]:
        """The scheduler's ``execution_log`` rows, in the order they were sent (``handle``
        may be the conversation handle, e.g. ``RunReport.scheduler_handle``)."""
        return self.broker.fetch("log_of_scheduler", handle=_key(handle))

    def _send_batch(
        self, handle: SchedulerHandle, tasks: Sequence[Task], wave: int | None
    ) -> list[int]:
        """Tasks on PostgreSQL: one task in one round trip (its row inside the SEND's
        statement, in autocommit); a wave in two (the rows and the messages together, then
        the commit). Their log ids were taken ahead, in blocks."""
        bodies = [json.dumps(t.to_dict()) for t in tasks]
        log_ids = self._next_log_ids(len(tasks))
        common = {
            "caller_id": self.caller_id,
            "handle": str(handle.conversation_handle),
            "target": handle.target_service,
            "wave": wave,
            "now": time.time(),
            **self.context,
        }
        # The message carries the row's task body as it is (no second encoding).
        messages = [
            f'{{"log_id": {log_id}, "task": {body}, "wave": {json.dumps(wave)}'
            f"{self._airflow_json}}}"
            for log_id, body in zip(log_ids, bodies, strict=True)
        ]

        def send() -> None:
            if len(tasks) == 1:
                [task] = tasks
                row = {
                    "log_id": log_ids[0],
                    "name": task.label[:256],
                    "kind": task.kind,
                    "body": bodies[0],
                    **common,
                }
                # The row inside the SEND's own statement: one round trip, committed
                # with the message (a transaction of the broker's where it cannot be)
                self.broker.send(
                    handle.conversation_handle,
                    self.names.sent,
                    messages[0],
                    before=("log_insert_one", row),
                )
                return
            rows = {
                "log_ids": log_ids,
                "names": [t.label[:256] for t in tasks],
                "kinds": [t.kind for t in tasks],
                "bodies": bodies,
                **common,
            }
            with self.broker.transaction() as tx:
                tx.send_many(
                    handle.conversation_handle,
                    self.names.sent,
                    messages,
                    before=("log_insert_many", rows),
                )

        self._exactly_once(send, sent=lambda: bool(self.broker.fetch("log_get", log_id=log_ids[0])))
        handle.in_flight += len(log_ids)
        for log_id, task in zip(log_ids, tasks, strict=True):
            handle.names[log_id] = task.label
        return log_ids

    def _exactly_once(self, work: Callable[[], None], *, sent: Callable[[], bool]) -> None:
        """``work`` (one transaction), riding through a lost connection: run again when
        it certainly did not commit; when its commit's answer was lost, ``sent()`` (read
        on a fresh connection) says whether it went through."""
        while True:
            try:
                self.broker.retrying(work, what="exec_async")
                return
            except ConnectionLost as exc:  # lost while committing
                if self.broker.retrying(sent, what="exec_async"):
                    return
                log.warning("%s; it did not commit: sending again", exc)

    def _next_log_ids(self, n: int) -> list[int]:
        """``n`` unused log ids of ``execution_log``'s sequence, taken LOG_ID_BLOCK at a
        time: one statement per block, not one per send (ids left unused leave gaps, as
        a sequence's do)."""
        with self._log_ids_lock:
            self._fill_log_ids(n)
            return [self._log_ids.popleft() for _ in range(n)]

    def _reserve_log_ids(self, n: int) -> None:
        """Take log ids now for ``n`` tasks to be sent later (the next wave's, while this
        one runs): the statement that takes them is then off the path from a wave's last
        completion to the next wave's first start. Like every statement of the run, it
        rides through a lost connection up to the reconnect deadline, and no longer."""
        if n > 0 and self.broker.features.one_statement_send:
            with self._log_ids_lock:
                self._fill_log_ids(n)

    def _fill_log_ids(self, n: int) -> None:
        """At least ``n`` unused log ids held, LOG_ID_BLOCK at a time (the caller holds
        the lock)."""
        if len(self._log_ids) < n:
            more = max(n - len(self._log_ids), LOG_ID_BLOCK)
            self._log_ids.extend(
                int(r["nextval"]) for r in self.broker.fetch("log_ids_next", n=more)
            )

    # --- a scheduler shared between processes (Airflow tasks) ----------------------------

    def attach(self, conversation_handle: uuid.UUID | str) -> SchedulerHandle:
        """A handle to a scheduler another process got (an Airflow task pushed its
        conversation handle to XCom): send more waves on it, watch them, release it.

        :raises InvalidArgument: for a handle that is not a UUID
        :raises SchedulerEnded: when the conversation is gone or was ended
        """
        key = uuid.UUID(checks.handle(conversation_handle, "scheduler handle"))
        try:
            endpoint = self.broker.conversation_endpoint(key)
        except ConversationNotFound:
            raise SchedulerEnded(
                f"scheduler {key}: no such conversation (it was released, or never began "
                "on this broker)"
            ) from None
        if not endpoint.is_initiator or endpoint.service_name != self.names.initiator_service:
            raise InvalidArgument(
                f"{key} is not a scheduler handle: it is the {endpoint.service_name!r} side "
                f"of a conversation on contract {endpoint.contract_name!r}"
            )
        if endpoint.state not in (EndpointState.STARTED_OUTBOUND, EndpointState.CONVERSING):
            raise SchedulerEnded(f"scheduler {key}: its conversation is {endpoint.state.name}")
        # What is in flight comes from the log, not from the process that sent it (which
        # may have died): the tasks not ended yet. Only they may be read back from the log
        # after a lost RECEIVE commit; an ended one may have been returned already.
        handle = SchedulerHandle(key, endpoint.far_service_name)
        for row in self.log(key):
            if row["status"] not in ENDED:
                handle.names[int(row["log_id"])] = row["task_name"]
                handle.in_flight += 1
        return handle

    def wave_progress(
        self, handle: SchedulerHandle | uuid.UUID | str, log_ids: Sequence[int]
    ) -> WaveProgress:
        """Where the tasks ``log_ids`` (sent on ``handle``) stand, read from
        ``execution_log`` — one indexed query, so it can be asked any number of times
        from any process. A task whose row says it ended has answered (its row and its
        ``AsyncDone`` are written in one transaction). For a target on another broker
        the answers are what completes the rows here, so this first takes the
        scheduler's ``AsyncDone`` messages (as :meth:`drain`): do not also wait with
        :meth:`synchronization` on the same scheduler.

        :raises InvalidArgument: when a log id is not one of this scheduler's tasks
        """
        key = _key(handle)
        wanted = sorted({int(i) for i in log_ids})
        if not wanted:
            return WaveProgress(())
        if self._is_remote(key):
            # The tasks ran on another broker: their answers complete this broker's rows.
            self.drain(key)
        rows = {
            int(r["log_id"]): r
            for r in self.broker.fetch("log_of_tasks", handle=key, first=wanted[0], last=wanted[-1])
        }
        missing = [i for i in wanted if i not in rows]
        if missing:
            raise InvalidArgument(f"scheduler {key}: no task with log id {missing} was sent on it")
        states = tuple(TaskState.from_row(rows[i]) for i in wanted)
        ended = None
        if any(not s.ended for s in states):
            ended = self._ended_by_target(key)
        return WaveProgress(states, ended)

    def _ended_by_target(self, key: str) -> str | None:
        try:
            endpoint = self.broker.conversation_endpoint(key)
        except ConversationNotFound:
            return "the conversation is gone (released)"
        if endpoint.state in (EndpointState.STARTED_OUTBOUND, EndpointState.CONVERSING):
            return None
        return f"its conversation is {endpoint.state.name}"

    def wait_for_wave(
        self,
        handle: SchedulerHandle | uuid.UUID | str,
        log_ids: Sequence[int],
        timeout: float | None = None,
    ) -> WaveProgress:
        """:meth:`wave_progress` once the wave is done, the target ended the
        conversation, or ``timeout`` seconds passed (``None``: no limit; ``0``: look
        once). It wakes on each ``AsyncDone`` of the scheduler (a waiting RECEIVE, no
        polling) and takes those messages: the log is what it reads."""
        key = _key(handle)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            progress = self.wave_progress(key, log_ids)
            if progress.done:
                self.drain(key)
                return progress
            left = None if deadline is None else deadline - time.monotonic()
            if progress.ended_by_target is not None or (left is not None and left <= 0):
                return progress
            # Wait for the next answer (or the far side's end) without polling.
            step = WAVE_WAIT_STEP if left is None else min(left, WAVE_WAIT_STEP)
            try:
                messages = self._take_answers(key, len(progress.pending), step)
            except ConversationNotFound:
                continue  # released meanwhile: the next look says so
            except ConnectionLost:
                continue  # lost while the RECEIVE committed: the log is what counts
            self._end_if_ended(key, messages)

    def drain(self, handle: SchedulerHandle | uuid.UUID | str) -> int:
        """Take the scheduler's ``AsyncDone`` messages off the initiator queue, where
        nobody will receive them (a watcher read the log instead), and return how many
        were taken. An ``EndDialog``/``Error`` from the target ends this side too."""
        key = _key(handle)
        taken = 0
        while True:
            try:
                messages = self._take_answers(key, 100, 0)
            except ConversationNotFound:
                return taken
            except ConnectionLost:
                continue  # lost while the RECEIVE committed: take what is still there
            if not messages:
                return taken
            taken += len(messages)
            if self._end_if_ended(key, messages):
                return taken

    def _end_if_ended(self, key: str, messages: Sequence[Any]) -> bool:
        """End this side when the target ended the conversation (``EndDialog``/``Error``
        among ``messages``), as the blog's Synchronization does; whether it had."""
        if not any(m.message_type_name in (END_DIALOG, ERROR) for m in messages):
            return False
        with contextlib.suppress(ConversationNotFound, ConversationStateError):
            self.broker.end_conversation(key)
        return True

    # --- waves -----------------------------------------------------------------------

    def run_waves(
        self,
        waves: Sequence[Sequence[Task | Mapping[str, Any]]],
        *,
        policy: str = "fail_fast",
        max_in_flight: int | None = None,
        target: str | None = None,
        timeout: float | None = None,
        on_completion: Callable[[int, Completion], None] | None = None,
        on_start: Callable[[SchedulerHandle], None] | None = None,
    ) -> RunReport:
        """Run waves in order: the tasks of a wave run together, a wave starts when the
        one before it has completed.

        Every task of every wave is checked before anything is sent.

        :param policy: ``fail_fast`` — at the first failure send nothing more, cancel
            this scheduler's tasks that have not started, stop those running (they answer
            ``CANCELLED``, or their result when they finished first), and
            raise :class:`WaveFailed` listing every failure; ``continue`` — run every
            wave and report (``RunReport.ok``)
        :param max_in_flight: at most this many tasks sent and not completed at once
        :param timeout: seconds to wait for any one completion
        :param on_completion: called with (wave number, completion) as each arrives; the
            first wave is 1, as in ``execution_log.wave``
        :param on_start: called with the scheduler once it exists, so another thread can
            :meth:`cancel` it (e.g. an Airflow ``on_kill``); the cancelled tasks answer,
            and the waves end and release it here (releasing it from that thread would
            leave this one waiting for answers that cannot come)
        """
        if policy not in POLICIES:
            raise InvalidArgument(f"policy must be one of {POLICIES}, got {policy!r}")
        if isinstance(waves, str | bytes) or not isinstance(waves, Sequence):
            raise InvalidArgument(f"waves must be a list of lists of tasks, got {waves!r}")
        checked: list[list[Task]] = []
        service = target or self.target
        for w, wave in enumerate(waves, start=1):
            if isinstance(wave, str | bytes | Mapping) or not isinstance(wave, Sequence):
                raise InvalidArgument(f"wave {w} must be a list of tasks, got {wave!r}")
            tasks = [as_task(t, f"wave {w}, task {i}") for i, t in enumerate(wave, start=1)]
            for t in tasks:
                self._check_kind(service, t)
            checked.append(tasks)
        started = time.time()
        reports: list[WaveReport] = []
        with self.scheduler(target=service, max_in_flight=max_in_flight) as handle:
            if on_start is not None:
                on_start(handle)
            stopped = False
            for number, tasks in enumerate(checked, start=1):
                if stopped:
                    reports.append(WaveReport(number, [], list(tasks)))
                    continue
                began = time.time()
                following = len(checked[number]) if number < len(checked) else 0
                report = self._run_wave(
                    handle, number, tasks, policy, timeout, on_completion, following
                )
                with contextlib.suppress(Exception):  # a metric never costs a wave its end
                    metrics.wave_finished(handle.target_service, time.time() - began)
                reports.append(report)
                stopped = policy == "fail_fast" and any(not c.ok for c in report.completions)
        result = RunReport(handle.conversation_handle, reports, started, time.time())
        if policy == "fail_fast" and result.failures:
            failures = result.failures
            listed = "; ".join(
                f"{c.task_name or c.log_id}: {c.status}"
                + (f" ({(c.error or '').splitlines()[0]})" if c.error else "")
                for c in failures
            )
            raise WaveFailed(
                f"{len([c for c in failures if c.status == FAILED])} task(s) failed, "
                f"{len([c for c in failures if c.status == CANCELLED])} cancelled, "
                f"{sum(len(w.not_sent) for w in reports)} not sent: {listed}",
                failures,
                result.completions,
                result,
            )
        return result

    def _run_wave(
        self,
        handle: SchedulerHandle,
        number: int,
        tasks: list[Task],
        policy: str,
        timeout: float | None,
        on_completion: Callable[[int, Completion], None] | None,
        following: int = 0,
    ) -> WaveReport:
        """One wave: its tasks sent (``max_in_flight`` at a time), their completions
        gathered. ``following``: the size of the wave after it, whose log ids are taken
        while this one runs."""
        pending = collections.deque(tasks)
        completions: list[Completion] = []
        outstanding = 0
        stop = False
        limit = handle.max_in_flight
        while pending or outstanding:
            room = len(pending) if limit is None else max(0, limit - outstanding)
            if pending and not stop and room:
                # What may go now goes in one transaction: one commit, not one per task.
                batch = [pending.popleft() for _ in range(min(room, len(pending)))]
                self._send(handle, batch, number)
                outstanding += len(batch)
                if following:
                    self._reserve_log_ids(len(pending) + following)
                    following = 0
            if not outstanding:
                break
            # The wave's own scheduler, whose answers only this loop consumes: one RECEIVE
            # takes all those there (not one call's), each handled before the next wait.
            if handle.ahead:
                completion = handle.ahead.popleft()
            else:
                completion = self._receive(handle, timeout, batch=True)
            outstanding -= 1
            completions.append(completion)
            if on_completion is not None:
                on_completion(number, completion)
            if not completion.ok and policy == "fail_fast" and not stop:
                stop = True
                cancelled, stopping = self.cancel(
                    handle, f"cancelled: task {completion.task_name or completion.log_id} failed"
                )
                log.warning(
                    "wave %s: %s failed; %s queued task(s) cancelled, %s running asked to "
                    "stop, %s not sent",
                    number,
                    completion.task_name or completion.log_id,
                    cancelled,
                    stopping,
                    len(pending),
                )
        return WaveReport(number, completions, list(pending) if stop else [])

    # --- internals -------------------------------------------------------------------

    def _receive(
        self, handle: SchedulerHandle, timeout: float | None, *, batch: bool = False
    ) -> Completion:
        """The next completion off the queue. Alone, one answer per RECEIVE: its commit is
        what says it was returned, so an answer is still on the queue (for this caller
        after a restart, or for another one attached to the handle) or returned, never
        only in memory. With ``batch`` (run_waves), every answer already there, the
        others kept in ``ahead``."""
        if handle.ended is not None:
            raise handle.ended
        queue = self.names.initiator_queue
        if batch and handle.in_flight > 1 and handle.arrivals is not None:
            # Answers trickle in as tasks end: gather them a moment (no statement runs
            # while it waits), so one RECEIVE takes several rather than one each.
            started = time.monotonic()
            wait = GATHER_WINDOW if timeout is None else min(GATHER_WINDOW, timeout)
            self.broker.wait_for_arrivals(
                queue, handle.arrivals, handle.in_flight, window=wait, timeout=wait
            )  # at most ``wait`` for a first answer, then ``wait`` for the others
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - started))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if batch:
                handle.arrivals = self.broker.arrivals(queue)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            top = max(1, handle.in_flight) if batch else 1
            try:
                messages = self._take_answers(str(handle.conversation_handle), top, left)
            except ConnectionLost as exc:
                # Lost while the RECEIVE committed: the answers it took may be gone with
                # it. Their rows say how those tasks ended (a row's end and its answer
                # commit together); an answer still queued is then skipped as a duplicate.
                log.warning("scheduler %s: %s; reading completions from the log", handle, exc)
                recovered = self._completions_from_log(handle)
                if recovered:
                    handle.ahead.extend(recovered[1:])
                    return recovered[0]
                continue
            if not messages:
                raise SynchronizationTimeout(
                    f"scheduler {handle}: no task completed within {timeout} s "
                    f"({handle.in_flight} in flight)"
                )
            completions = []
            for message in messages:
                try:
                    completion = self._completion(handle, message)
                except SchedulerEnded as ended:
                    handle.ended = ended  # raised once the completions before it are taken
                    break
                if completion is not None:
                    completions.append(completion)
            if completions:
                handle.ahead.extend(completions[1:])  # none unless batch
                return completions[0]
            if handle.ended is not None:
                raise handle.ended
            # only answers already returned (from the log): wait for the next

    def _completions_from_log(self, handle: SchedulerHandle) -> list[Completion]:
        """Completions of the scheduler's tasks that ended, per their rows, and were not
        returned yet (their answers were taken by a RECEIVE whose commit was lost)."""
        waiting = set(handle.names) - handle.completed
        if not waiting:
            return []
        rows = self.broker.fetch("log_of_scheduler", handle=str(handle.conversation_handle))
        completions = []
        for row in rows:
            log_id = int(row["log_id"])
            if log_id in waiting and row["status"] in ENDED and row["end_time"] is not None:
                handle.completed.add(log_id)
                handle.in_flight -= 1
                raw = row["result"]
                completions.append(
                    Completion(
                        log_id=log_id,
                        status=row["status"],
                        error=row["error"],
                        result=None if raw is None else json.loads(raw),
                        task_name=handle.names.get(log_id),
                    )
                )
        return completions

    def _completion(self, handle: SchedulerHandle, message: Any) -> Completion | None:
        if message.message_type_name in (END_DIALOG, ERROR):
            with contextlib.suppress(ConversationNotFound, ConversationStateError):
                self.broker.end_conversation(handle.conversation_handle)
            how = "ended it (EndDialog)"
            if message.error is not None:
                how = f"ended it with error {message.error[0]}: {message.error[1]}"
            raise SchedulerEnded(
                f"scheduler {handle}: the target service {handle.target_service!r} {how}; "
                f"{handle.in_flight} task(s) will not complete"
            )
        done = message.json()
        log_id = done.get("log_id")
        if log_id is not None:
            if log_id in handle.completed:
                return None  # already returned, read from the log
            handle.completed.add(log_id)
        handle.in_flight = max(0, handle.in_flight - 1)  # attach counts from the log
        raw = done.get("result")
        return Completion(
            log_id=log_id,
            status=done["status"],
            error=done.get("error"),
            result=None if raw is None else json.loads(raw),
            task_name=handle.names.get(log_id) if log_id is not None else None,
        )

    def _take_answers(self, key: str, top: int, timeout: float | None) -> list[Any]:
        """RECEIVE the scheduler's messages. An answer from a target on another broker
        also completes this broker's row of its task, in the same transaction: the row
        stays the durable answer however the caller waits."""
        if not self._is_remote(key):
            return self.broker.receive(
                self.names.initiator_queue, top=top, timeout=timeout, conversation=key
            )
        return self.broker.retrying(
            lambda: self._take_remote_answers(key, top, timeout), what="synchronization"
        )

    def _take_remote_answers(self, key: str, top: int, timeout: float | None) -> list[Any]:
        with self.broker.transaction() as tx:
            messages = tx.receive(
                self.names.initiator_queue, top=top, timeout=timeout, conversation=key
            )
            for message in messages:
                if message.message_type_name != self.names.done:
                    continue
                done = message.json()
                if isinstance(done, dict) and done.get("remote") and done.get("log_id") is not None:
                    tx.run(
                        "log_complete_from_answer",
                        log_id=int(done["log_id"]),
                        handle=key,
                        status=done["status"],
                        error=done.get("error"),
                        result=done.get("result"),
                        worker=done.get("worker"),
                        started_at=done.get("started_at"),
                        ended_at=done.get("ended_at"),
                        application_id=done.get("application_id"),
                        job_group=done.get("job_group"),
                        now=time.time(),
                    )
        return messages

    def _is_remote(self, key: str) -> bool:
        """Whether the scheduler's target is on another broker (fixed per conversation)."""
        remote = self._remote.get(key)
        if remote is None:
            try:
                remote = self.broker.conversation_endpoint(key).is_remote
            except ConversationNotFound:
                return False
            self._remote[key] = remote
        return remote

    def _allowed(self, service: str) -> frozenset[str]:
        allowed = self._kinds.get(service)
        if allowed is None:
            rows = self.broker.fetch("target_get", service=service)
            row = rows[0] if rows else None
            if row is None:
                raise ServiceNotFound(
                    f"{service!r} is not a scheduler target service on "
                    f"{self.broker.url.render_as_string(hide_password=True)}",
                    hint=f"create the scheduler's catalog: scheduler-lib init --db "
                    f"{self.broker.url.render_as_string(hide_password=True)} (in Python: "
                    "scheduler_lib.scheduler.init(broker); another target: "
                    "targets=[Target(service=...)])",
                )
            allowed = self._kinds[service] = frozenset(row["allowed_kinds"].split(","))
        return allowed

    def check_task(self, task: Task | Mapping[str, Any], target: str | None = None) -> Task:
        """The task, checked as ``exec_async`` would before sending it.

        :raises InvalidTask: malformed; :raises UnknownKind, KindNotAllowed: see there
        """
        checked = as_task(task)
        self._check_kind(target or self.target, checked)
        return checked

    def _check_kind(self, service: str, task: Task) -> None:
        allowed = self._allowed(service)
        if task.kind not in allowed and task.kind not in KINDS:
            raise UnknownKind(
                f"unknown task kind {task.kind!r}: target service {service!r} runs "
                f"{sorted(allowed)}"
            )
        if task.kind not in allowed:
            raise KindNotAllowed(
                f"target service {service!r} does not run {task.kind!r} tasks "
                f"(it runs {sorted(allowed)})"
            )


def _key(handle: SchedulerHandle | uuid.UUID | str) -> str:
    """A scheduler's conversation handle as text, from a handle object or the handle."""
    return str(handle.conversation_handle if isinstance(handle, SchedulerHandle) else handle)


def _instance(
    context: Mapping[str, str | int | None],
) -> tuple[dict[str, str | None], dict[str, str | int]]:
    """(the log's Airflow ids, the task instance's fields that are set) of a context.

    :raises InvalidArgument: for a field not in :data:`INSTANCE_FIELDS`, or a value that is
        not text (an integer for ``try_number`` and ``map_index``)
    """
    unknown = set(context) - set(INSTANCE_FIELDS)
    if unknown:
        raise InvalidArgument(f"context takes {INSTANCE_FIELDS}, not {sorted(unknown)}")
    numbers = ("try_number", "map_index")
    for field, value in context.items():
        wanted = int if field in numbers else str
        if value is not None and (not isinstance(value, wanted) or isinstance(value, bool)):
            raise InvalidArgument(
                f"context field {field!r} must be {wanted.__name__} or None, got {value!r}"
            )
    ids: dict[str, str | None] = {}
    for field in AIRFLOW_FIELDS:
        value = context.get(field)
        ids[field] = value if value is None else str(value)
    return ids, {k: v for k, v in context.items() if v is not None}


def _wave(wave: Any) -> int | None:
    """A task's wave number: ``None`` or an integer from 1 (the first wave) to 2**31 - 1
    (the log's column)."""
    return None if wave is None else checks.bounded_int(wave, "wave", low=1)
