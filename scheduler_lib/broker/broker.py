"""The broker: a Service-Broker-style message broker on a SQLAlchemy database — its two
fronts, :class:`Broker` and :class:`Transaction`, in one module because each names the
other (a broker makes transactions; a transaction belongs to its broker)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa

from scheduler_lib.broker import (
    catalog,
    conversations,
    counters,
    exceptions,
    failures,
    routes,
    schema,
)
from scheduler_lib.broker import leases as leasing
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.db import connections, dialects, session, store, waiting
from scheduler_lib.broker.db import engine as engines
from scheduler_lib.broker.ops import leases as leasing_ops
from scheduler_lib.broker.ops import poison as poisoning
from scheduler_lib.broker.ops import timers

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_MESSAGE_SIZE = 64 * 1024 * 1024  # bytes of body a message may carry
TIMER_POLL_INTERVAL = 1.0  # seconds; the timer thread re-reads the soonest deadline this often
CLOCK_CHECK_INTERVAL = 600.0  # seconds between the timer thread's looks at the server's clock
# Seconds this host's clock may be off the PostgreSQL server's before the timer thread says
# so: the hosts sharing a database compare their clocks through its rows (a lease written
# by one host's clock expires by another's; `run` trusts a queue monitor stamped in the
# last 10 s), and NTP keeps hosts within milliseconds.
CLOCK_SKEW_WARNING = 2.0


class Transaction(
    catalog.CatalogOperations,
    conversations.ConversationOperations,
    leasing.LeaseOperations,
    failures.PoisonOperations,
    routes.RouteOperations,
):
    """One database transaction. Use as a context manager: it commits on a clean exit and
    rolls back on an exception, and received messages then return to their queue.

    The connection is taken at the first operation. On SQLite that first statement takes
    the write lock (``BEGIN IMMEDIATE``); a RECEIVE that waits before the transaction wrote
    anything gives the lock back while it waits, so senders are never blocked by a waiting
    receiver.
    """

    def __init__(
        self, broker: Broker, *, autocommit: bool = False, engine: sa.Engine | None = None
    ) -> None:
        self._broker = broker
        if broker._file_watched:
            broker._look_at_file()
        #: the connection and what this transaction's operations did (the broker's own
        #: operations use it; a layer above uses the named-query methods below)
        self.session = session.Session(broker._shared, autocommit=autocommit, engine=engine)
        self.session.serves(self)

    # --- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.session.finished:
            return
        if exc_type is None:
            self.session.commit()
            return
        self.session.end_on(exc)

    def commit(self) -> None:
        """Commit, then wake local waiters on the queues that got messages."""
        self.session.commit()

    def rollback(self) -> None:
        """Roll back: nothing this transaction did remains; received messages are back."""
        self.session.rollback()

    def savepoint(self) -> contextlib.AbstractContextManager[None]:
        """A part of the transaction that can fail alone (SAVEPOINT): on an exception
        only what it did is undone, and the exception goes on."""
        return self.session.savepoint()

    @contextlib.contextmanager
    def _operation(self) -> Iterator[Transaction]:
        self.session.check_open()
        yield self

    # --- named queries of the layers above (Broker.use_queries) ------------------------

    @property
    def broker(self) -> Broker:
        """The broker this transaction belongs to."""
        return self._broker

    def run(self, query: str, /, **params: Any) -> int:
        """Run a named statement in this transaction; how many rows it changed."""
        self.session.mark_written()
        return self.session.count(query, **params)

    def fetch(self, query: str, /, **params: Any) -> list[store.Row]:
        """Every row of a named query, as mappings."""
        return self.session.all(query, **params)

    def fetch_one(self, query: str, /, **params: Any) -> store.Row | None:
        """The first row of a named query, or ``None``."""
        return self.session.one(query, **params)

    def fetch_value(self, query: str, /, **params: Any) -> Any:
        """The first column of the first row of a named query, or ``None``."""
        return self.session.scalar(query, **params)


class Broker(
    catalog.CatalogOperations,
    conversations.ConversationOperations,
    leasing.LeaseOperations,
    failures.PoisonOperations,
    routes.RouteOperations,
):
    """A message broker on one database.

    Every operation is available two ways: on the broker itself, where it runs in a
    transaction of its own (autocommit, like a statement in SQL Server), and on
    :meth:`transaction`, where several run atomically::

        with broker.transaction() as tx:
            messages = tx.receive("TargetQueue", timeout=5)
            tx.send(messages[0].conversation_handle, "Reply", b"...")

    :param url: SQLAlchemy URL; ``sqlite:///file.db`` (embedded) or ``postgresql://...``
    :param migrate: apply the schema migrations first (idempotent)
    :param timers: run the timer thread that fires conversation timers and lifetimes
        while this broker is open, whether or not anybody waits on those queues
    :param max_message_size: largest body accepted by SEND, in bytes
    :param clock: seconds since the epoch for activation bookkeeping (injectable for tests)
    :param reconnect_timeout: seconds an operation keeps trying while the database is
        unreachable (restarting, failing over) before it raises
        :class:`~scheduler_lib.broker.exceptions.DatabaseUnavailable`; default
        ``SCHEDULER_LIB_RECONNECT_TIMEOUT``, else 120. Every operation called on the
        broker itself rides through such an outage (see :meth:`retrying`)
    """

    def __init__(
        self,
        url: str | sa.URL = engines.DEFAULT_URL,
        *,
        migrate: bool = True,
        timers: bool = True,
        max_message_size: int = MAX_MESSAGE_SIZE,
        engine_options: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
        reconnect_timeout: float | None = None,
    ) -> None:
        timeout = connections.reconnect_timeout(reconnect_timeout)
        self._engine = engines.create_engine(url, **(engine_options or {}))
        self._closed = threading.Event()
        self.availability = connections.Availability(
            self._engine.url, timeout, self._closed, self._engines
        )
        self._store = store.Store(self._engine.dialect)
        # Single-statement fast paths run on connections that are always in autocommit,
        # rather than switching a pooled connection back and forth on every checkout.
        self._autocommit_engine: sa.Engine | None = None
        if self._store.is_postgresql:
            self._autocommit_engine = engines.create_engine(
                url, isolation_level="AUTOCOMMIT", **(engine_options or {})
            )
        self._async_engine: sa.Engine | None = None  # commits without the WAL flush
        self._read_engine: sa.Engine | None = None  # SQLite's snapshots (snapshot())
        self._async_engine_lock = threading.Lock()
        if migrate:
            self.retrying(lambda: _migrating(self._engine), what="migrate")
        self._file = connections.DatabaseFile(self._engine.url)
        # Transactions look at the SQLite file, at most once a second: the timer thread's
        # each second, and those of a broker without one (the Airflow page's and the
        # triggerer's, which only read: they read the file they first opened for ever,
        # and a sensor waited on a file nobody wrote any more).
        self._file_watched = self._file.path is not None
        self._file_looked_at = -math.inf  # time.monotonic() of the last look
        self._file_look = threading.Lock()
        self.clock = clock
        # SQLite: one writing transaction at a time, handed over in turn inside a process.
        self._write_gate: threading.RLock | None = (
            threading.RLock() if self._store.features.single_writer else None
        )
        # This process's waiting readers: wakeups, registrations, monitors' notes
        self.waiting = waiting.Waiting(
            self._engine, self._store, self.availability, clock, self._write_gate
        )
        # What its transactions' sessions use of it, and nothing else. SEND's cache of
        # validations feeds its fast path; the statement re-checks the validation in the
        # database, so a stale entry costs a slow path, never a wrong send.
        self._shared = session.Shared(
            store=self._store,
            engine=self._engine,
            autocommit_engine=self._autocommit_engine,
            write_gate=self._write_gate,
            write_gate_timeout=engines.SQLITE_BUSY_TIMEOUT,
            waiting=self.waiting,
            after_commit=self._after_commit,
            count_rollbacks=self._count_rollbacks,
            max_message_size=max_message_size,
        )
        self._lease_keeper: leasing.LeaseKeeper | None = None  # started on first use
        self._lease_keeper_lock = threading.Lock()
        self._timer_wakeup = threading.Event()
        self._timer_sleeps_until = 0.0  # epoch seconds: when the timer thread looks next
        self._clock_looked_at = -math.inf  # time.monotonic() of the last look (_look_at_clock)
        self._clock_skewed = False  # the last look found this host's clock off (said once)
        self._timer_thread: threading.Thread | None = None
        if timers:
            self._timer_thread = threading.Thread(
                target=self._run_timers, name="broker-timers", daemon=True
            )
            self._timer_thread.start()

    def apply_migrations(self, migrations: schema.MigrationSet) -> None:
        """Bring a layer's own schema (its migrations, its version table) up to date on
        this broker's database. Idempotent."""
        self.retrying(lambda: _migrating(self._engine, migrations), what="migrate")

    def schema_revision(self, migrations: schema.MigrationSet = schema.BROKER) -> str | None:
        """The revision a layer's schema is at on this broker's database (``None``: not
        there), read without writing anything; rides through an outage."""
        return self.retrying(
            lambda: _reading_revision(self._engine, migrations), what="read the schema"
        )

    def _engines(self) -> list[sa.Engine]:
        engines = [self._engine, self._autocommit_engine, self._async_engine, self._read_engine]
        return [e for e in engines if e is not None]

    def retrying(self, call: Callable[[], T], *, what: str = "the operation") -> T:
        """``call()`` — work in transactions of its own — run again on a fresh
        connection while it fails because the connection was lost before a commit,
        backing off while the database is unreachable, until the reconnect deadline.
        Every operation called on the broker itself already does this; use it for a
        ``with broker.transaction()`` block that may be repeated::

            def answer() -> None:
                with broker.transaction() as tx:
                    ...
            broker.retrying(answer)

        A connection lost during the commit of a transaction that wrote is raised
        (:class:`~scheduler_lib.broker.exceptions.ConnectionLost` with ``committing``):
        it may have committed, and only the caller can tell.

        :raises DatabaseUnavailable: the database stayed away past the deadline
        """
        return self.availability.retrying(call, what=what)

    @property
    def max_message_size(self) -> int:
        """The largest body SEND accepts, in bytes."""
        return self._shared.max_message_size

    @max_message_size.setter
    def max_message_size(self, size: int) -> None:
        self._shared.max_message_size = size

    def has_query(self, query: str) -> bool:
        """Whether this database's dialect has the named query (some exist on one only)."""
        return self._store.has(query)

    def run(self, query: str, /, **params: Any) -> int:
        """Run one named statement (of :meth:`use_queries`) in a transaction of its own —
        on PostgreSQL in autocommit, one round trip; how many rows it changed. A
        connection lost before its reply runs it again (it may have committed): give it
        statements that can run twice, as the task scheduler's do."""

        def statement() -> int:
            with self._single_statement() as tx:
                return tx.run(query, **params)

        return self.retrying(statement, what=query)

    def fetch(self, query: str, /, **params: Any) -> list[Any]:
        """The rows of one named query (of :meth:`use_queries`), in a transaction of its
        own — on PostgreSQL in autocommit, one round trip."""

        def read() -> list[Any]:
            with self._single_statement() as tx:
                return tx.fetch(query, **params)

        return self.retrying(read, what=query)

    def take_recorded(
        self,
        queue: str,
        query: str,
        params: dict[str, Any],
        *,
        timeout: float | None = None,
        lease: float = leasing.DEFAULT_LEASE,
        worker: str | None = None,
        durable: bool = True,
        top: int = 1,
    ) -> tuple[list[leasing.Lease], list[tuple[Any, ...]] | None]:
        """:meth:`take` of up to ``top`` messages with ``durable=False``, and in the same
        round trip the named statement ``query`` (of :meth:`use_queries`) in a transaction
        of its own that commits durably — which flushes the take too: what a worker
        records before the work begins ("started") at no round trip of its own. The
        statement finds the leases as ``message_leases`` rows of ``worker = :holder`` and
        ``taken_at = :taken_at`` (both bound here, besides ``params``).

        :param durable: ``False``: the statement's transaction commits without waiting
            for the WAL flush too (what it records may be lost with the take in a
            database crash, the message then going back to its queue)
        :param top: most messages to take (of one conversation group, as RECEIVE's);
            where the one-statement take cannot be used, one
        :return: the leases and the statement's rows — ``None`` when it did not run or
            its outcome is unknown (another dialect, a failure, a lost reply): record
            each lease the usual way then (the statement must be idempotent)
        """
        top = checks.positive_int(top, "top")
        duration = checks.timeout(lease, "lease")
        if not duration:
            raise exceptions.InvalidArgument("a lease needs a duration greater than 0 seconds")
        holder = worker or poisoning.worker_name()
        record = leasing_ops.Record(query, params, durable)
        wait = checks.timeout(timeout)
        taken = self.retrying(  # as every operation on the broker, through a lost connection
            lambda: self._take_alone(queue, top, duration, holder, wait, record),
            what="take_recorded",
        )
        if taken is None:  # the dialect or the queue needs the checked take: at once
            return self._take_checked(queue, wait, duration, holder), None
        return taken, record.rows if taken else None

    def _take_checked(
        self, queue: str, timeout: float | None, duration: float, holder: str
    ) -> list[leasing.Lease]:
        """The checked take of one message, in a transaction of its own that commits
        without the WAL flush (``take(durable=False)`` once the one-statement take has
        said no: asking it again would only repeat its look)."""

        def checked() -> list[leasing.Lease]:
            with self._operation() as tx:
                return leasing_ops.take(tx.session, queue, 1, timeout, duration, holder, False)

        return self.retrying(checked, what="take")

    def _take_alone(
        self,
        queue: str,
        top: int,
        duration: float,
        holder: str,
        timeout: float | None,
        record: leasing_ops.Record | None = None,
    ) -> list[leasing.Lease] | None:
        """The one-statement take and its wait (``ops.leases.take_waiting``), each look a
        transaction of its own that commits without the WAL flush; ``None`` where the
        dialect or the queue needs the checked take. (``take`` rides through a lost
        connection, as every operation on the broker.)"""
        if not self._store.features.one_statement_take:
            return None

        def look() -> list[leasing.Lease]:
            now = time.time()
            try:
                with self._taking() as tx:
                    tx.session.connection()
                    # The take's instant (its leases', and the start it records) read
                    # once connected, just before the statement: a look begun before a
                    # message was sent, that takes it, records a start no earlier than
                    # the send but for the instant the statement takes to go out.
                    now = time.time()
                    return leasing_ops.take_fast(
                        tx.session, queue, top, duration, holder, now, record
                    )
            except exceptions.ConnectionLost:
                # In autocommit the take commits as it runs: lost before its reply, its
                # leases may exist. They are this holder's, taken at this instant.
                found = self.retrying(lambda: self._found_again(queue, holder, duration, now))
                if not found:
                    raise
                return found

        return leasing_ops.take_waiting(
            self.waiting, queue, timeout, look, lambda: self.queue(queue)
        )

    def _taking(self) -> Transaction:
        """A transaction for one look of the one-statement take: autocommit, on
        connections whose commits do not wait for the WAL flush."""
        if self._async_engine is None:
            with self._async_engine_lock:
                if self._async_engine is None:
                    self._async_engine = engines.create_engine(
                        self._engine.url,
                        isolation_level="AUTOCOMMIT",
                        connect_args={"options": "-c synchronous_commit=off"},
                    )
        return Transaction(self, autocommit=True, engine=self._async_engine)

    def _unflushed(self) -> contextlib.AbstractContextManager[Transaction]:
        if self._autocommit_engine is None:  # (SQLite: no one-statement SEND to ride)
            return self._single_statement()
        return self._taking()

    def _found_again(
        self, queue: str, holder: str, duration: float, now: float
    ) -> list[leasing.Lease]:
        with self.transaction() as tx:
            # It only reads, and commits: a ROLLBACK would drop the prepared statements.
            return leasing_ops.found_again(tx.session, queue, holder, duration, now)

    def arrivals(self, queue: str) -> int:
        """A number that grows whenever messages may have arrived on ``queue`` (this
        process's wakeups). Take it before a RECEIVE; :meth:`wait_for_arrivals` counts
        from it."""
        return self.waiting.wakeups.generation(queue)

    def wait_for_arrivals(
        self, queue: str, since: int, count: int, *, window: float, timeout: float
    ) -> bool:
        """Wait, running no statement, until about ``count`` messages may have arrived on
        ``queue`` since ``since`` (:meth:`arrivals`), or ``window`` seconds after the
        first of them, or ``timeout`` seconds with none — so that one RECEIVE then takes
        several, instead of one RECEIVE per message as they trickle in.

        Only where each arrival is announced (PostgreSQL's NOTIFY, once this process is
        registered as waiting on the queue by an earlier RECEIVE); elsewhere it returns at
        once. It is a hint: a RECEIVE must follow, and may find fewer or more.

        :return: whether it waited
        """
        listener = self.waiting.listener
        if listener is None or count < 1:
            return False
        if not self.waiting.is_registered(queue):
            return False  # senders would not NOTIFY yet: the RECEIVE registers
        if not listener.wait_ready(0):
            return False  # LISTEN is reconnecting: no NOTIFY would reach us meanwhile
        self.waiting.set_waiting(queue, +1, ready_timeout=0)
        try:
            self.waiting.wakeups.wait_for_arrivals(queue, since, count, window, timeout)
        finally:
            self.waiting.set_waiting(queue, -1)
        return True

    def use_queries(self, package: str) -> None:
        """Let transactions run the named queries of ``package`` (its ``sql/queries.sql``
        and dialect overrides): how a layer above the broker runs its own SQL without
        touching a connection. Idempotent."""
        self._store.extend(package)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (nothing can be done on it any more)."""
        return self._closed.is_set()

    @property
    def url(self) -> sa.URL:
        return self._engine.url

    @property
    def dialect(self) -> str:
        """The database's SQLAlchemy dialect name (``sqlite``, ``postgresql``)."""
        return self._store.dialect

    @property
    def features(self) -> dialects.Dialect:
        """What the broker does on this database, chosen once from its dialect (the
        one-statement paths, the wake-ups, the locking): a layer above builds its own
        fast paths on these."""
        return self._store.features

    def transaction(self) -> Transaction:
        """A transaction for several operations; use it as a context manager."""
        return Transaction(self)

    def snapshot(self) -> Transaction:
        """A transaction that only reads, all of it from one moment, and holds no one up:
        on PostgreSQL ``REPEATABLE READ, READ ONLY``; on SQLite a plain ``BEGIN`` (a WAL
        snapshot) outside this process's write gate, so it neither waits for a writer
        nor makes one wait (what a metrics scrape needs). Use it as a context manager;
        a statement that writes fails."""
        if self._store.features.read_only_snapshots:
            tx = Transaction(self)
            tx.run("snapshot_begin")
            return tx
        if self._read_engine is None:
            with self._async_engine_lock:
                if self._read_engine is None:
                    self._read_engine = engines.create_engine(self._engine.url, read_only=True)
        return Transaction(self, engine=self._read_engine)

    @contextlib.contextmanager
    def _operation(self) -> Iterator[Transaction]:
        with Transaction(self) as tx:
            yield tx

    @contextlib.contextmanager
    def _single_statement(self) -> Iterator[Transaction]:
        # One statement is atomic by itself: autocommit saves the BEGIN and COMMIT round
        # trips. Only the fast paths run here; they fall back to _operation() otherwise.
        with Transaction(self, autocommit=self._autocommit_engine is not None) as tx:
            yield tx

    def close(self) -> None:
        """Stop the background threads and close the connections."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._timer_wakeup.set()
        if self._timer_thread is not None:
            self._timer_thread.join(timeout=5)
        self.waiting.close()
        if self._lease_keeper is not None:
            self._lease_keeper.stop()
        self._shared.kept.close()
        self._engine.dispose()
        if self._autocommit_engine is not None:
            self._autocommit_engine.dispose()
        if self._async_engine is not None:
            self._async_engine.dispose()
        if self._read_engine is not None:
            self._read_engine.dispose()

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- used by transactions --------------------------------------------------------

    def _after_commit(self, queues: frozenset[str], deadline: float | None) -> None:
        self.waiting.wakeups.notify(queues)
        if deadline is not None and deadline < self._timer_sleeps_until:
            self._timer_wakeup.set()  # it would sleep past the new deadline

    def _count_rollbacks(self, queues: frozenset[str]) -> None:
        """Built-in poison message detection, in a transaction of its own: the one that
        received has just rolled back."""
        counters.rolled_back(queues)
        try:
            with self.transaction() as tx:
                poisoning.count_rollbacks(tx.session, queues)
        except Exception:  # never hide the error that caused the rollback
            log.warning("could not count a rollback on %s", sorted(queues), exc_info=True)

    def keep_alive(
        self, leases: Sequence[leasing.Lease], interval: float | None = None
    ) -> contextlib.AbstractContextManager[dict[str, Any]]:
        """Renew ``leases`` in the background while a ``with`` block runs (the worker's
        heartbeat)::

            leases = broker.take("TargetQueue", lease=30)
            with broker.keep_alive(leases):
                run_for_minutes(leases[0].message)
            with broker.transaction() as tx:
                tx.send(leases[0].message.conversation_handle, "Done")
                tx.complete(leases[0])

        :param interval: seconds between renewals; default a third of the shortest lease
        :return: a context manager whose target maps lease ids found lost to their error
        """
        with self._lease_keeper_lock:
            if self._lease_keeper is None:
                self._lease_keeper = leasing.LeaseKeeper(self)
        return self._lease_keeper.holding(leases, interval)

    # --- timers ----------------------------------------------------------------------

    def fire_timers(self) -> int:
        """Fire every conversation timer and lifetime that is due now, expire leases whose
        heartbeat ran out and bring parked poison messages back.

        The timer thread calls this; it is public for processes that run without it.

        :return: how many fired, expired or came back
        """
        return self.retrying(self._fire_timers_once, what="fire_timers")

    def _fire_timers_once(self) -> int:
        with self.transaction() as tx:
            fired = timers.fire_due(tx.session, time.time())
        # Apart, so that a failing poison policy cannot hold conversation timers up.
        with self.transaction() as tx:
            # A lease is not expired before its holder had a whole lease to renew it
            # since the database came back: a live worker is never lost to an outage.
            fired += leasing.expire_leases(tx.session, time.time(), self.availability.recovered_at)
            fired += poisoning.redeliver_parked(tx.session, time.time())
        return fired

    def _reopen_if_moved(self) -> None:
        """SQLite: a database file removed or replaced under this process is opened again
        from its path (a removed one: a new, empty file, said once more as a missing
        schema until ``scheduler-lib init`` or a restore makes it)."""
        if not self._file.moved():
            return
        for engine in self._engines():
            connections.discard_pool(engine)
        log.warning(
            "the SQLite database file %s was removed or replaced under this process: "
            "opening it again",
            self._file.path,
        )

    def _look_at_file(self) -> None:
        """:meth:`_reopen_if_moved` from a transaction's start (before it takes a
        connection), at most once a second and by one thread at a time (the others go
        on: a look a second late changes nothing)."""
        now = time.monotonic()
        if now - self._file_looked_at < TIMER_POLL_INTERVAL or not self._file_look.acquire(
            blocking=False
        ):
            return
        try:
            self._file_looked_at = now
            self._reopen_if_moved()
        finally:
            self._file_look.release()

    def _run_timers(self) -> None:
        while not self._closed.is_set():
            try:
                while self.fire_timers():
                    pass
                # A snapshot: on SQLite it stays out of the write gate
                with self.snapshot() as tx:
                    deadline = timers.next_deadline(tx.session)
                self.availability.mark_ok()
                self._look_at_clock()
            except Exception as exc:  # the thread must outlive a passing database error
                # This thread looks every second: it notices an outage (and its end) for
                # the whole process, which is what lease expiry measures from. An outage
                # or a refused connection is said once there; anything else with a trace.
                self.availability.report(log, "timer thread: firing timers failed", exc)
                deadline = None
            sleep = TIMER_POLL_INTERVAL
            if deadline is not None:
                sleep = max(0.0, min(sleep, float(deadline) - time.time()))
            if self.waiting.announced:
                linger = self.waiting.unregister_idle()
                if linger is not None:
                    sleep = min(sleep, linger)
            self._timer_sleeps_until = time.time() + sleep
            self._timer_wakeup.wait(sleep)
            self._timer_wakeup.clear()
            self._timer_sleeps_until = 0.0  # awake: every new deadline will be seen

    def _look_at_clock(self) -> None:
        """Every ``CLOCK_CHECK_INTERVAL`` (the first tick too), on a database server: say
        once when this host's clock is more than ``CLOCK_SKEW_WARNING`` off the server's —
        the clocks of the hosts that share the database are compared through its rows,
        and a skewed one shortens or lengthens leases unseen (SQLite: one host, one
        clock)."""
        now = time.monotonic()
        if (
            not self._store.features.server_clock
            or now - self._clock_looked_at < CLOCK_CHECK_INTERVAL
        ):
            return
        with self.snapshot() as tx:
            tx.session.connection()  # connected first: the bracket holds no connect
            before = time.time()
            server = float(tx.session.scalar("server_clock"))
            after = time.time()
        # (only a look that reached the server counts: one that failed is the next tick's)
        self._clock_looked_at = now
        skew = (before + after) / 2 - server
        skewed = abs(skew) > CLOCK_SKEW_WARNING
        if skewed and not self._clock_skewed:
            log.warning(
                "this host's clock is %.1f s %s the database server's (%s): leases, readers' "
                "heartbeats and `scheduler-lib run`'s wait for a reader compare the clocks of "
                "the hosts that share the database; keep them in sync (NTP)",
                abs(skew),
                "ahead of" if skew > 0 else "behind",
                self.availability.database,
            )
        self._clock_skewed = skewed


def _migrating(engine: sa.Engine, migrations: schema.MigrationSet = schema.BROKER) -> None:
    """Apply the migrations; a server that is not up yet is a lost connection (a broker
    started during an outage waits for the database, as its operations do)."""
    _schema_call(engine, "migrate", lambda: schema.migrate(engine, migrations=migrations))


def _reading_revision(engine: sa.Engine, migrations: schema.MigrationSet) -> str | None:
    """:func:`schema.current`, a failure to connect said as :func:`_migrating` says it."""
    return _schema_call(engine, "read the schema", lambda: schema.current(engine, migrations))


def _schema_call(engine: sa.Engine, what: str, call: Callable[[], T]) -> T:
    """``call()`` on its own connection, its connection failures said the broker's way."""
    try:
        return call()
    except sa.exc.DBAPIError as exc:
        if exc.statement is None:
            # Opening the connection failed (no statement ran): an outage to wait out,
            # or a setting to fix, said at once.
            raise connections.connect_error(engine, what, exc) from exc
        if engine.dialect.name == "postgresql" and connections.is_lost(exc):
            raise connections.lost(what, exc) from exc
        raise


def _rides_through(operation: Callable[..., T]) -> Callable[..., T]:
    """An operation called on the broker runs in a transaction of its own, so it can be
    run again when that transaction's connection is lost (see :meth:`Broker.retrying`)."""

    @functools.wraps(operation)
    def short_form(self: Broker, *args: Any, **kwargs: Any) -> T:
        return self.retrying(lambda: operation(self, *args, **kwargs), what=operation.__name__)

    return short_form


# The operations shared with Transaction (where the caller owns the transaction, and a
# lost connection is the caller's to handle) ride through outages on the broker itself.
for _operations in (
    catalog.CatalogOperations,
    conversations.ConversationOperations,
    leasing.LeaseOperations,
    failures.PoisonOperations,
    routes.RouteOperations,
):
    for _name, _operation in vars(_operations).items():
        public = not _name.startswith("_") and inspect.isfunction(_operation)
        if public and _name not in vars(Broker):
            setattr(Broker, _name, _rides_through(_operation))
