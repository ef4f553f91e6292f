"""The server restarts at a chosen point of a task's round trip — the caller's send, the
executor's take, the task's start, a lease renewal, the answer, its commit, the caller's
RECEIVE — and nothing is lost, nothing is duplicated, and the log tells the truth: every
task ran once (by the marks it left outside the database), its row is SUCCEEDED with one
attempt, ``synchronization`` returns its completion once (a further one times out), and
no lease is left.

The restart is not timed by hope: the store is patched so that the first time (once
armed) the chosen named query is about to run, through any of the store's doors, the test
restarts the private server right there, in the thread that runs it; the statement then
meets a dead connection. A point "at the commit" restarts right before the COMMIT of the
transaction that ran the query (so the COMMIT meets it), "at the rollback" right before
the ROLLBACK that ends it. Each test checks the restart really met its statement.

"Reply lost" points let the statement (or COMMIT) go through first; then the server
restarts and the caller gets what a connection lost before the reply arrived raises — the
store's own handling of the driver's error on that dead connection. The work happened,
and the caller cannot tell: the case exactly-once rests on.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from marking_tasks import marks
from multiproc import poll
from private_postgres import PrivatePostgres

from scheduler_lib.broker import Broker, ConnectionLost
from scheduler_lib.broker.db import connections
from scheduler_lib.broker.db import store as store_module
from scheduler_lib.broker.db.store import Store
from scheduler_lib.scheduler import (
    Completion,
    Executor,
    SchedulerHandle,
    SynchronizationTimeout,
    Target,
    Task,
    TaskScheduler,
    init,
)
from scheduler_lib.scheduler import prefetch as prefetching

pytestmark = pytest.mark.postgres

QUEUE = "QueueAsyncTarget"
LEASE = 2.0  # the executor's lease (renewed every third of it)
TASK_SECONDS = 0.3
SYNC_TIMEOUT = 15.0  # seconds synchronization waits for one completion
WAIT = 30.0  # seconds any other wait may take before the test fails


@dataclasses.dataclass(frozen=True)
class Point:
    """Where the server restarts.

    :param query: the named query whose first run (once armed) meets the restart
    :param arm: when the trap is set: ``send`` (before the caller sends the task);
        ``work`` (after the send, before the executor takes it: synchronization begins
        once the restart is over, so that it meets the executor alone); ``receive``
        (likewise, but synchronization waits while the executor works: the restart meets
        synchronization's statements); ``answered`` (once the
        answer waits on the caller's queue, before ``synchronization``)
    :param at: ``statement`` (the query itself), ``commit`` (the COMMIT of the transaction
        that ran it) or ``rollback`` (the ROLLBACK that ends it)
    :param reply_lost: the statement (or COMMIT) goes through, then the connection dies
        before its reply; otherwise it meets the dead connection
    :param taken: only a run of ``query`` that returned rows (True) or none (False)
    :param warm: one task goes round first, so that the steady state's fast paths run
        (the pipelined SENDs); cold, the first send and the first answer of the brokers
        read the message types' validations first, and the first send makes its
        conversation's target endpoint in its pipeline
    :param tasks: how many tasks are sent together (``exec_many`` beyond one)
    :param outage: seconds the server stays down (0: a plain restart)
    :param take_only: at the take's round trip (take + start), only the take runs before
        the restart: the start recorded in its round trip is lost with the reply
    :param spark: the executor runs its tasks in a Spark application (named, never
        started): it records the start by itself, after the take
    :param expire_first: once the server is back, another process's timer thread looks
        for expired leases before the statement runs (the worst order for a lease)
    :param seconds: how long each task runs
    :param lease: the executor's lease
    :param prefetch: the executor's takes get several tasks (its queue's tasks count as
        short at once): it runs the first and holds the others, which it starts one by
        one when it runs them (``scheduler_lib.scheduler.prefetch``)
    :param hold: seconds a held task waits for a free reader before it goes back
    :param crash: the server stops without a checkpoint (``immediate``: what it had not
        flushed to its WAL is lost), rather than a clean restart
    """

    query: str
    arm: str
    at: str = "statement"
    reply_lost: bool = False
    taken: bool | None = None
    warm: bool = True
    tasks: int = 1
    outage: float = 0.0
    expire_first: bool = False
    seconds: float = TASK_SECONDS
    lease: float = LEASE
    take_only: bool = False
    spark: bool = False
    prefetch: bool = False
    hold: float = WAIT
    crash: bool = False


POINTS = [
    # -- the caller's send ------------------------------------------------------------
    # its row inside its message's SEND, one autocommit statement (send_fast+log_insert_one)
    pytest.param(Point("log_insert_one", "send"), id="exec_async"),
    # ... which committed, and its reply was lost: the row says it went (sent once)
    pytest.param(Point("log_insert_one", "send", reply_lost=True), id="exec_async-reply-lost"),
    # a new scheduler's first send: a transaction; its first statement reads the types'
    # validations (a new process), then one pipeline makes the conversation's target
    # endpoint and sends the task with its row (target_create_fast, send_fast+log_insert_one)
    pytest.param(Point("message_type_list", "send", warm=False), id="exec_async-first-types"),
    pytest.param(Point("log_insert_one", "send", warm=False), id="exec_async-first"),
    pytest.param(
        Point("log_insert_one", "send", warm=False, at="commit"), id="exec_async-first-commit"
    ),
    pytest.param(
        Point("log_insert_one", "send", warm=False, at="commit", reply_lost=True),
        id="exec_async-first-commit-reply-lost",
    ),
    # a wave's send: log_insert_many + send_many_fast
    pytest.param(Point("log_insert_many", "send", tasks=3), id="exec_many"),
    pytest.param(Point("log_insert_many", "send", tasks=3, at="commit"), id="exec_many-commit"),
    pytest.param(
        Point("log_insert_many", "send", tasks=3, at="commit", reply_lost=True),
        id="exec_many-commit-reply-lost",
    ),
    # -- the executor -----------------------------------------------------------------
    # its take and the task's start in one round trip: the take commits without the WAL
    # flush, then the start durably (log_start_taken)
    pytest.param(Point("take_fast", "work"), id="take"),
    # both went through: the start is found recorded, not counted twice
    pytest.param(Point("take_fast", "work", reply_lost=True), id="take-reply-lost"),
    # the take went through, its start did not: recorded by log_start
    pytest.param(
        Point("log_start_taken", "work", reply_lost=True, take_only=True),
        id="take-without-start",
    ),
    # an executor with a Spark application: the take, then the start (durably) by itself
    pytest.param(Point("take_fast", "work", spark=True), id="take-spark"),
    pytest.param(Point("log_start", "work", spark=True), id="start"),
    pytest.param(Point("log_start", "work", reply_lost=True, spark=True), id="start-reply-lost"),
    # -- tasks the executor took ahead (prefetch): a take of three runs the first and
    # holds the others, each started (log_start, durably) when it runs -----------------
    # the held task's start meets the restart, between its take and its run
    pytest.param(Point("log_start", "work", tasks=3, prefetch=True), id="held-start"),
    # ... went through, and its reply was lost: found started, not counted twice
    pytest.param(
        Point("log_start", "work", tasks=3, prefetch=True, reply_lost=True),
        id="held-start-reply-lost",
    ),
    # ... the server crashed instead: the take committed without the WAL flush, and the
    # durable start of the take's first task flushed it (the held leases survive)
    pytest.param(
        Point("log_start", "work", tasks=3, prefetch=True, crash=True), id="held-start-crash"
    ),
    # held leases renewed through an outage longer than the lease, another process
    # looking for expired leases first thing after it: they are not taken from the holder
    pytest.param(
        Point(
            "lease_renew",
            "work",
            tasks=3,
            prefetch=True,
            outage=2.0,
            expire_first=True,
            seconds=3.0,
            lease=1.5,
        ),
        id="held-lease-renewal",
    ),
    # held tasks going back to their queue (no reader free for them while the first
    # runs): the release meets the restart; they go back (or stay held) and run once
    pytest.param(
        Point("lease_delete", "work", tasks=3, prefetch=True, hold=0.3, seconds=1.5),
        id="held-give-back",
    ),
    # a renewal of the running task's lease, the server away longer than the lease, and
    # another process's timer thread looking for expired leases first thing after it
    pytest.param(
        Point("lease_renew", "work", outage=2.0, expire_first=True, seconds=4.0, lease=1.5),
        id="lease-renewal",
    ),
    # the answer: log_finish inside send_fast (completing the lease), one autocommit
    # statement (send_fast+log_finish)
    pytest.param(Point("log_finish", "work"), id="answer"),
    # ... which committed, and its reply was lost: tried again, the lease is gone, and
    # the row says the answer was this executor's (answered once)
    pytest.param(Point("log_finish", "work", reply_lost=True), id="answer-reply-lost"),
    # a new executor's first answer: the types' validations read first, in a statement of
    # their own (until 2026-11-30 the answer then took a transaction and the checked SEND;
    # now the one statement, as warm)
    pytest.param(Point("message_type_list", "work", warm=False), id="answer-first-types"),
    pytest.param(Point("log_finish", "work", warm=False), id="answer-first"),
    # -- the caller's synchronization -------------------------------------------------
    # the RECEIVE of an answer that waits: one statement in autocommit
    pytest.param(Point("receive_fast_conversation", "answered"), id="synchronization"),
    pytest.param(
        Point("receive_fast_conversation", "answered", reply_lost=True),
        id="synchronization-reply-lost",
    ),
    # the RECEIVE of an answer that arrives while it waits, in a transaction that commits
    pytest.param(
        Point("receive_fast_conversation", "receive", at="commit", taken=True),
        id="synchronization-commit",
    ),
    pytest.param(
        Point("receive_fast_conversation", "receive", at="commit", taken=True, reply_lost=True),
        id="synchronization-commit-reply-lost",
    ),
    # while it waits: its first look, which finds nothing (one statement in autocommit;
    # the wait after it does not look again before a wakeup)
    pytest.param(
        Point("receive_fast_conversation", "receive"),
        id="synchronization-wait",
    ),
]


class RestartTrap:
    """Restarts the server the first time, once armed, ``point.query`` is about to run
    through the store (any door: ``execute``, ``execute_many``, ``_on_driver``,
    ``pipeline``, ``take_then``) — or right before the COMMIT (ROLLBACK) of the
    transaction that ran it. Records what the statement (or the commit) then raised to
    its caller."""

    def __init__(
        self,
        server: PrivatePostgres,
        point: Point,
        monkeypatch: pytest.MonkeyPatch,
        expirer: Broker,
    ) -> None:
        self.server, self.point, self.expirer = server, point, expirer
        self.armed = False
        self.sprung = threading.Event()  # the restart began
        self.settled = threading.Event()  # the statement it met has returned or raised
        self.met: BaseException | None = None  # what the statement (or commit) raised
        self.where = ""  # the door and statements it sprang on
        self._lock = threading.Lock()
        self._ending: sa.Connection | None = None  # whose COMMIT / ROLLBACK springs it
        self._patch(monkeypatch)

    def arm(self) -> None:
        self.armed = True

    def _take(self) -> bool:
        """Whether this call is the one: armed and not sprung yet (it springs once)."""
        with self._lock:
            if not self.armed or self.sprung.is_set():
                return False
            self.sprung.set()
            return True

    def _restart(self) -> None:
        if self.point.outage:
            self.server.stop_for(self.point.outage)
        else:
            self.server.restart("immediate" if self.point.crash else "fast")
        if self.point.expire_first:
            self.expirer.fire_timers()

    def _springing(self, run: Callable[[], Any], lose_reply: Callable[[], BaseException]) -> Any:
        """Run the sprung statement (or commit) on the restarted server, recording what
        its caller gets."""
        try:
            if not self.point.reply_lost:
                self._restart()
                return run()
            run()  # it went through ...
            self._restart()  # ... and its connection dies before the reply arrives
            raise lose_reply()
        except BaseException as exc:
            self.met = exc
            raise
        finally:
            self.settled.set()

    def _statement(
        self, door: str, conn: sa.Connection, names: Sequence[str], run: Callable[[], Any]
    ) -> Any:
        point = self.point
        if point.query not in names or not self.armed or self.sprung.is_set():
            return run()
        if point.at != "statement":
            result = run()
            got_rows = bool(result[1]) if door == "_on_driver" else None
            in_transaction = not getattr(conn.connection.driver_connection, "autocommit", True)
            if in_transaction and point.taken in (None, got_rows):
                with self._lock:
                    if self._ending is None:
                        self._ending = conn
                        self.where = f"the {point.at} after {door}({'+'.join(names)})"
            return result
        if not self._take():
            return run()
        self.where = f"{door}({'+'.join(names)})"
        if point.reply_lost and door not in ("_on_driver", "pipeline", "take_then"):
            raise AssertionError(f"a lost reply is modelled on the driver's doors, not {door}")

        def lose_reply() -> BaseException:
            # What the store raises when the driver finds the connection dead
            driver = conn.connection.driver_connection
            assert driver is not None
            try:
                driver.execute("SELECT 1")
            except Exception as exc:
                return store_module._driver_error(conn, "+".join(names), exc)
            return AssertionError("the connection survived the restart")

        return self._springing(run, lose_reply)

    def _ending_call(self, conn: sa.Connection, what: str, end: Callable[[], None]) -> None:
        if what != self.point.at or conn is not self._ending or not self._take():
            end()
            return

        def lose_reply() -> BaseException:
            # What the commit raises when the driver finds the connection dead:
            # SQLAlchemy's wrapping of it, or the driver's own error where the transaction
            # was the driver's alone (store.commit)
            try:
                if conn.in_transaction():
                    conn.exec_driver_sql("SELECT 1")
                else:
                    conn.connection.driver_connection.execute("SELECT 1")  # type: ignore[union-attr]
            except Exception as exc:
                if isinstance(exc, sa.exc.DBAPIError) or store_module.is_driver_error(exc):
                    return exc
                raise
            return AssertionError("the connection survived the restart")

        self._springing(end, lose_reply)

    def _patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        trap = self
        execute, execute_many = Store.execute, Store.execute_many
        on_driver, pipeline, take_then = Store._on_driver, Store.pipeline, Store.take_then
        commit, rollback = sa.Connection.commit, sa.Connection.rollback
        store_commit, store_rollback = store_module.commit, store_module.rollback

        def patched_execute(self: Store, conn: sa.Connection, query: str, /, **params: Any) -> Any:
            return trap._statement(
                "execute", conn, [query], lambda: execute(self, conn, query, **params)
            )

        def patched_execute_many(
            self: Store, conn: sa.Connection, name: str, rows: Sequence[Mapping[str, Any]]
        ) -> None:
            trap._statement(
                "execute_many", conn, [name], lambda: execute_many(self, conn, name, rows)
            )

        def patched_on_driver(
            self: Store, conn: sa.Connection, query: str, params: Mapping[str, Any]
        ) -> Any:
            # A statement riding inside another (Store.riding) is both of them
            return trap._statement(
                "_on_driver",
                conn,
                query.split("+"),
                lambda: on_driver(self, conn, query, params),
            )

        def patched_pipeline(
            self: Store, conn: sa.Connection, statements: Sequence[tuple[str, Mapping[str, Any]]]
        ) -> Any:
            names = [name for query, _ in statements for name in query.split("+")]
            return trap._statement(
                "pipeline", conn, names, lambda: pipeline(self, conn, statements)
            )

        def patched_take_then(
            self: Store,
            conn: sa.Connection,
            take: tuple[str, Mapping[str, Any]],
            then: tuple[str, Mapping[str, Any]],
            **options: Any,
        ) -> Any:
            def run() -> Any:
                if trap.point.take_only and trap.sprung.is_set() and not trap.settled.is_set():
                    # the sprung call: the take alone commits (its start is never sent)
                    return on_driver(self, conn, take[0], take[1])
                return take_then(self, conn, take, then, **options)

            return trap._statement("take_then", conn, [take[0], then[0]], run)

        def patched_commit(self: sa.Connection) -> None:
            trap._ending_call(self, "commit", lambda: commit(self))

        def patched_rollback(self: sa.Connection) -> None:
            trap._ending_call(self, "rollback", lambda: rollback(self))

        # A transaction of the driver's statements alone ends on the driver, past
        # SQLAlchemy (store.commit): its end is a door too
        def patched_store_commit(conn: sa.Connection) -> None:
            if conn.in_transaction():
                store_commit(conn)  # through sa.Connection.commit, patched above
            else:
                trap._ending_call(conn, "commit", lambda: store_commit(conn))

        def patched_store_rollback(conn: sa.Connection) -> None:
            if conn.in_transaction():
                store_rollback(conn)
            else:
                trap._ending_call(conn, "rollback", lambda: store_rollback(conn))

        monkeypatch.setattr(Store, "execute", patched_execute)
        monkeypatch.setattr(Store, "execute_many", patched_execute_many)
        monkeypatch.setattr(Store, "_on_driver", patched_on_driver)
        monkeypatch.setattr(Store, "pipeline", patched_pipeline)
        monkeypatch.setattr(Store, "take_then", patched_take_then)
        monkeypatch.setattr(sa.Connection, "commit", patched_commit)
        monkeypatch.setattr(sa.Connection, "rollback", patched_rollback)
        monkeypatch.setattr(store_module, "commit", patched_store_commit)
        monkeypatch.setattr(store_module, "rollback", patched_store_rollback)


def _is_lost_connection(exc: BaseException | None) -> bool:
    """What a statement or commit on a connection the restart killed raises: the store's
    ConnectionLost, or (from a commit) SQLAlchemy's wrapped driver error or the driver's."""
    if isinstance(exc, ConnectionLost):
        return True
    if exc is not None and store_module.is_driver_error(exc):
        return connections.is_lost(exc)
    return isinstance(exc, sa.exc.DBAPIError) and type(exc.orig).__module__.startswith("psycopg")


class Worker(threading.Thread):
    """The executor in a thread of its own: handles ``count`` messages (``run_one``)
    until told to stop, or records what it raised."""

    def __init__(self, executor: Executor, count: int) -> None:
        super().__init__(daemon=True)
        self.executor, self.count = executor, count
        self.handled = 0
        self.error: BaseException | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + WAIT
        try:
            while self.handled < self.count and not self.stopping.is_set():
                if time.monotonic() > deadline:
                    return
                if self.executor.run_one(timeout=0.5):
                    self.handled += 1
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def finish(self) -> None:
        """Stop once the message in hand is dealt with; fail if something went wrong."""
        self.stopping.set()
        self.join(WAIT)
        assert not self.is_alive(), "the executor did not stop"
        assert self.error is None, f"the executor raised {self.error!r}"
        assert self.handled == self.count, f"the executor handled {self.handled}/{self.count}"


@pytest.fixture
def caller(private_db_url: str) -> Iterator[Broker]:
    """The caller's broker (the process that runs exec_async and synchronization)."""
    broker = Broker(private_db_url)
    try:
        init(broker, targets=[Target(activation=False)])  # retries=0: a lost task FAILS
        yield broker
    finally:
        broker.close()


@pytest.fixture
def worker(private_db_url: str, caller: Broker) -> Iterator[Broker]:
    """The executor's broker: another process, with pools and caches of its own."""
    broker = Broker(private_db_url)
    try:
        yield broker
    finally:
        broker.close()


def _round_trip(
    scheduler: TaskScheduler,
    handle: SchedulerHandle,
    executor: Executor,
    tasks: list[Task],
    trap: RestartTrap | None = None,
) -> tuple[list[int], list[Completion]]:
    """Send ``tasks``, let the executor run them, synchronize once per task; the trap is
    armed where its point says. Returns the log ids and the completions."""
    arm = trap.point.arm if trap is not None else None
    if trap is not None and arm == "send":
        trap.arm()
    if len(tasks) == 1:
        log_ids = [scheduler.exec_async(handle, tasks[0])]
    else:
        log_ids = scheduler.exec_many(handle, tasks)
    if trap is not None and arm in ("work", "receive"):
        trap.arm()
    worker = Worker(executor, len(tasks))
    worker.start()
    if trap is not None and arm == "work":
        # The restart meets the executor's statement alone: synchronization begins once
        # it is over (a synchronization waiting through a restart is the "receive" points)
        assert trap.settled.wait(WAIT), f"the point {trap.point} was never reached"
    if trap is not None and arm == "answered":
        # The answers wait on the caller's queue: the next RECEIVE is the one to take them
        poll(lambda: worker.handled == len(tasks), WAIT, "the executor to answer")
        worker.finish()
        trap.arm()
    completions = [scheduler.synchronization(handle, timeout=SYNC_TIMEOUT) for _ in tasks]
    worker.finish()
    return log_ids, completions


@pytest.mark.parametrize("point", POINTS)
def test_a_restart_at_this_point_loses_and_duplicates_nothing(
    point: Point,
    caller: Broker,
    worker: Broker,
    private_postgres: PrivatePostgres,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    marks_file = str(tmp_path / "marks")
    scheduler = TaskScheduler(caller)
    spark = ("app-never-started", None) if point.spark else None
    executor = Executor(
        worker,
        QUEUE,
        lease=point.lease,
        idle_timeout=WAIT,
        spark_application=spark,
        prefetch=4 if point.prefetch else 1,
    )
    held: list[int] = []
    if point.prefetch:
        # The warm task makes the queue's tasks count as short, however slow the machine
        # (prefetch then takes several from one scheduler at once)
        monkeypatch.setattr(prefetching, "SHORT", WAIT)
        monkeypatch.setattr(prefetching, "ONE_SCHEDULER", 1)
        monkeypatch.setattr(prefetching, "HOLD", point.hold)
        hold = prefetching.Prefetched.hold

        def holding(self: prefetching.Prefetched, leases: Sequence[Any]) -> None:
            held.append(len(leases))
            hold(self, leases)

        monkeypatch.setattr(prefetching.Prefetched, "hold", holding)
    handle = scheduler.get_scheduler()
    trap = RestartTrap(private_postgres, point, monkeypatch, expirer=caller)
    expected: dict[int, str] = {}
    completions: list[Completion] = []
    if point.warm:
        # Given one task has gone round already (caches filled: the fast paths run)
        warm = Task.python("marking_tasks:mark", marks_file, "warm", 0.05, name="warm")
        ids, done = _round_trip(scheduler, handle, executor, [warm])
        expected[ids[0]] = "warm"
        completions += done
    # When the server restarts the first time the point's statement is about to run
    names = [f"t{i}" for i in range(point.tasks)]
    tasks = [Task.python("marking_tasks:mark", marks_file, n, point.seconds, name=n) for n in names]
    ids, done = _round_trip(scheduler, handle, executor, tasks, trap)
    expected.update(zip(ids, names, strict=True))
    completions += done
    # (it did: the statement, or the commit, met the dead connection and rode through)
    assert trap.sprung.is_set(), f"the point {point} was never reached"
    assert trap.settled.wait(WAIT), f"{trap.where} never returned"
    assert _is_lost_connection(trap.met), f"{trap.where} met {trap.met!r}, not a lost connection"
    if point.prefetch:
        assert held and held[0] == point.tasks - 1, f"the take held {held}, not the rest"
    # Then synchronization returned one SUCCEEDED completion per task, and no more
    assert sorted(c.log_id for c in completions if c.log_id is not None) == sorted(expected)
    assert [c.status for c in completions] == ["SUCCEEDED"] * len(expected), completions
    with pytest.raises(SynchronizationTimeout):
        scheduler.synchronization(handle, timeout=1)
    # And each task ran exactly once, by the marks it left outside the database
    starts, ends = marks(marks_file)
    assert starts == ends == {name: 1 for name in expected.values()}, (starts, ends)
    # And its row says so: SUCCEEDED, one attempt, ended
    for log_id, name in expected.items():
        (row,) = caller.fetch("log_get", log_id=log_id)
        got = (row["task_name"], row["status"], row["attempts"], row["end_time"] is not None)
        assert got == (name, "SUCCEEDED", 1, True), (trap.where, dict(row))
    # And no lease is left behind
    assert caller.leases() == []
