"""The broker: a Service-Broker-style message broker on a SQLAlchemy database."""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import sqlalchemy as sa

from scheduler_lib.broker import counters, exceptions, schema
from scheduler_lib.broker import leases as leasing
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.catalog import CatalogOperations
from scheduler_lib.broker.conversations import ConversationOperations
from scheduler_lib.broker.db import connections, store, wakeup
from scheduler_lib.broker.db import engine as engines
from scheduler_lib.broker.leases import Lease, LeaseOperations
from scheduler_lib.broker.models import QueueInfo, Validation
from scheduler_lib.broker.ops import poison as poisoning
from scheduler_lib.broker.ops import timers
from scheduler_lib.broker.poison import PoisonOperations
from scheduler_lib.broker.routes import RouteOperations
from scheduler_lib.broker.transaction import Transaction

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_MESSAGE_SIZE = 64 * 1024 * 1024  # bytes of body a message may carry
EMPTY_RECEIVE_STAMP_INTERVAL = 0.25  # seconds; how often a process stamps empty receives
TIMER_POLL_INTERVAL = 1.0  # seconds; the timer thread re-reads the soonest deadline this often
LISTEN_READY_TIMEOUT = 10.0  # seconds to wait for LISTEN before the first receive relies on it
WAITER_LINGER = 5.0  # seconds a process stays registered as waiting after its last waiter


class Broker(
    CatalogOperations, ConversationOperations, LeaseOperations, PoisonOperations, RouteOperations
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
        # queue -> the lock a taking thread holds while it looks and waits (see _take_waiting)
        self._take_turns: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
        self.max_message_size = max_message_size
        # Message type -> validation, for SEND's fast path; the statement re-checks the
        # validation in the database, so a stale entry costs a slow path, never a wrong send.
        self._validation_cache: dict[str, Validation] = {}
        if migrate:
            self.retrying(lambda: _migrating(self._engine), what="migrate")
        self._wakeups = wakeup.Wakeups()
        self._listener: wakeup.PostgresListener | None = None
        self._watcher: wakeup.SqliteWatcher | None = None
        self._watcher_lock = threading.Lock()
        if self._store.features.notifies:
            self._listener = wakeup.PostgresListener(self._engine, self._wakeups)
        self.clock = clock
        # SQLite: one writing transaction at a time, handed over in turn inside a process.
        self._write_gate: threading.RLock | None = (
            threading.RLock() if self._store.features.single_writer else None
        )
        self._write_gate_timeout: float = engines.SQLITE_BUSY_TIMEOUT
        self._waiters: dict[str, int] = {}  # queue -> this process's waiting receivers
        self._registered: set[str] = set()  # queues where this process counts as waiting
        self._waiters_idle_since: dict[str, float] = {}
        self._waiters_lock = threading.Lock()
        self._empty_stamped: dict[str, float] = {}
        self._waiting_noted: dict[str, float] = {}
        self._last_group_received: dict[str, str] = {}  # queue -> group (SQLite's notes)
        self._empty_stamp_lock = threading.Lock()
        self._lease_keeper: leasing.LeaseKeeper | None = None  # started on first use
        self._lease_keeper_lock = threading.Lock()
        self._timer_wakeup = threading.Event()
        # queue -> (monotonic time read, settings): what RECEIVE checks before it waits
        self._waited_queues: dict[str, tuple[float, QueueInfo]] = {}
        self._timer_sleeps_until = 0.0  # epoch seconds: when the timer thread looks next
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

    def has_query(self, query: str) -> bool:
        """Whether this database's dialect has the named query (some exist on one only)."""
        return self._store.has(query)

    def run(self, query: str, /, **params: Any) -> int:
        """Run one named statement (of :meth:`use_queries`) in a transaction of its own —
        on PostgreSQL in autocommit, one round trip; how many rows it changed."""

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
    ) -> tuple[list[Lease], list[tuple[Any, ...]] | None]:
        """:meth:`take` of one message with ``durable=False``, and in the same round trip
        the named statement ``query`` (of :meth:`use_queries`) in a transaction of its
        own that commits durably — which flushes the take too: what a worker records
        before the work begins ("started") at no round trip of its own. The statement
        finds the leases as ``message_leases`` rows of ``worker = :holder`` and
        ``taken_at = :taken_at`` (both bound here, besides ``params``).

        :param durable: ``False``: the statement's transaction commits without waiting
            for the WAL flush too (what it records may be lost with the take in a
            database crash, the message then going back to its queue)
        :return: the leases and the statement's rows — ``None`` when it did not run or
            its outcome is unknown (another dialect, a failure, a lost reply): record
            each lease the usual way then (the statement must be idempotent)
        """
        duration = checks.timeout(lease, "lease")
        if not duration:
            raise exceptions.InvalidArgument("a lease needs a duration greater than 0 seconds")
        holder = worker or poisoning.worker_name()
        if not self._store.has(query):
            return self.take(queue, 1, timeout, lease=duration, worker=holder, durable=False), None
        record = _Record(query, params, durable)
        wait = checks.timeout(timeout)
        taken = self.retrying(  # as every operation on the broker, through a lost connection
            lambda: self._take_waiting(queue, 1, duration, holder, wait, record),
            what="take_recorded",
        )
        if taken is None:  # the dialect has no one-statement take
            return self.take(queue, 1, timeout, lease=duration, worker=holder, durable=False), None
        return taken, record.rows if taken else None

    def _take_alone(
        self, queue: str, top: int, duration: float, holder: str, timeout: float | None
    ) -> list[Lease] | None:
        # (take itself rides through a lost connection, as every operation on the broker)
        return self._take_waiting(queue, top, duration, holder, timeout)

    def _take_waiting(
        self,
        queue: str,
        top: int,
        duration: float,
        holder: str,
        timeout: float | None,
        record: _Record | None = None,
    ) -> list[Lease] | None:
        """:meth:`_take_fast` with WAITFOR: tries again whenever the queue may have got
        messages, until ``timeout``; ``None`` when the dialect cannot, or the queue needs
        the checked take (retention, receive aging)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        registered = False
        checked = False
        # The threads of this process that take from one queue do it in turns: the one
        # whose turn it is looks, and waits for wakeups; the others wait for the turn.
        # A message that arrives then wakes one taker, not every idle one (a herd whose
        # looks all but one find nothing, and slow the one that matters); a taker that
        # got one hands the turn on at once, so a backlog still goes to all of them.
        turn = self._take_turns[queue]
        poll = wakeup.POSTGRESQL_POLL_INTERVAL
        try:
            while True:
                if not turn.acquire(blocking=False):
                    # Another thread waits for wakeups; look anyway, once per poll interval
                    # (a message can become takeable with no wakeup here: a group another
                    # process held, a NOTIFY lost while LISTEN reconnects), then wait for
                    # the turn.
                    leases = self._take_fast(queue, top, duration, holder, record)
                    if leases is None or leases:
                        return leases
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return []
                    if not turn.acquire(
                        timeout=poll if remaining is None else min(poll, remaining)
                    ):
                        continue
                try:
                    seen = self._wakeups.generation(queue)
                    leases = self._take_fast(queue, top, duration, holder, record)
                    if leases is None or leases:
                        return leases
                    if not checked:
                        info = self.queue(queue)  # unknown or off: say so, as RECEIVE does
                        if not info.is_receive_enabled:
                            raise info.disabled_error()
                        if info.is_retention_enabled or info.receive_aging_seconds is not None:
                            # take_fast leaves these queues to the checked take (its "no
                            # row" did not mean "nothing there"): a take in a transaction
                            return None
                        checked = True
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return []
                    self._record_empty_receive(queue)
                    if self._listener is not None and not registered:
                        # Look once more after registering: a message sent meanwhile sent
                        # no NOTIFY.
                        self._set_waiting(queue, +1)
                        registered = True
                        continue
                    self._wakeups.wait(
                        queue, seen, poll if remaining is None else min(poll, remaining)
                    )
                finally:
                    turn.release()
        finally:
            if registered:
                self._set_waiting(queue, -1)

    def _take_fast(
        self, queue: str, top: int, duration: float, holder: str, record: _Record | None = None
    ) -> list[Lease] | None:
        """:meth:`take` with ``durable=False`` in one round trip, where the dialect can:
        the leases, ``[]`` when nothing was there, ``None`` when it cannot. With
        ``record``, its statement follows a take that got leases, in the same round trip
        (:meth:`take_recorded`)."""
        if not self._store.features.one_statement_take:
            return None
        if self._async_engine is None:
            with self._async_engine_lock:
                if self._async_engine is None:
                    self._async_engine = engines.create_engine(
                        self._engine.url,
                        isolation_level="AUTOCOMMIT",
                        connect_args={"options": "-c synchronous_commit=off"},
                    )
        now = time.time()
        take = {
            "queue": queue,
            "top": top,
            "worker": holder,
            "now": now,
            "expires_at": now + duration,
        }
        try:
            with connections.connect(self._async_engine) as conn:
                if record is None:
                    rows = self._store.rows(conn, "take_fast", **take)
                else:
                    record.rows = None  # unknown until this round trip's reply
                    then = (record.query, {**record.params, "holder": holder, "taken_at": now})
                    rows, recorded = self._store.take_then(
                        conn, ("take_fast", take), then, durable=record.durable
                    )
                    if isinstance(recorded, Exception):
                        log.warning("after a take on %s: %s", queue, recorded)
                    else:
                        record.rows = recorded
        except exceptions.ConnectionLost:
            # In autocommit the take commits as it runs: lost before its reply, its leases
            # may exist. They are this holder's, taken at this instant: find them again
            # (else they would expire, and count as a lost worker's).
            rows = self.retrying(lambda: self._leases_taken(holder, now), what="take")
            if not rows:
                raise
        leases = [leasing.lease_from_row(row, holder, duration, now) for row in rows]
        if leases:  # its monitor looks again; the timer thread learns the expiry
            counters.received(queue, len(leases))
            self._after_commit(frozenset({queue}), now + duration)
        return leases

    def _leases_taken(self, holder: str, now: float) -> list[tuple[Any, ...]]:
        with connections.connect(self._engine) as conn:
            rows = self._store.rows(conn, "leases_taken", worker=holder, now=now)
            conn.commit()  # it only read; a ROLLBACK would drop the prepared statements
        return rows

    def arrivals(self, queue: str) -> int:
        """A number that grows whenever messages may have arrived on ``queue`` (this
        process's wakeups). Take it before a RECEIVE; :meth:`wait_for_arrivals` counts
        from it."""
        return self._wakeups.generation(queue)

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
        if self._listener is None or count < 1:
            return False
        with self._waiters_lock:
            if queue not in self._registered:
                return False  # senders would not NOTIFY yet: the RECEIVE registers
        if not self._listener.wait_ready(0):
            return False  # LISTEN is reconnecting: no NOTIFY would reach us meanwhile
        self._set_waiting(queue, +1, ready_timeout=0)
        try:
            self._wakeups.wait_for_arrivals(queue, since, count, window, timeout)
        finally:
            self._set_waiting(queue, -1)
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
        return self._store.dialect

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
        with self._waiters_lock:
            registered, self._registered = self._registered, set()
        for queue in registered:  # leave no count behind (senders would NOTIFY for nobody)
            try:
                self._register_waiter(queue, -1)
            except Exception:
                log.warning("could not unregister the waiters of %s", queue, exc_info=True)
        if self._listener is not None:
            self._listener.stop()
        if self._watcher is not None:
            self._watcher.stop()
        if self._lease_keeper is not None:
            self._lease_keeper.stop()
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
        self._wakeups.notify(queues)
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
        self, leases: Sequence[Lease], interval: float | None = None
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

    def _note_blocked_receiver(self, queue: str) -> tuple[float | None, float] | None:
        """SQLite: a receiver that must queue for the write gate is waiting in RECEIVE
        too (another transaction holds the database). Noted in memory for this process's
        queue monitors; a database stamp would need the very lock it waits for.

        :return: (the stamp before, the stamp written), for :meth:`_unnote_blocked_receiver`
            — or ``None`` when the gate was free (nothing noted)
        """
        gate = self._write_gate
        if gate is None:
            return None
        if gate.acquire(blocking=False):
            gate.release()
            return None
        before, now = self._waiting_noted.get(queue), self.clock()
        self._waiting_noted[queue] = now
        return before, now

    def _unnote_blocked_receiver(self, queue: str, noted: tuple[float | None, float]) -> None:
        """The receiver got messages once through the gate: it was busy, not idle. Its note
        would read as "a reader waits for work" and hold back activation while messages
        pile up (on SQLite the gate is busy most of the time under load), so take it back
        unless someone noted since."""
        before, stamp = noted
        if self._waiting_noted.get(queue) == stamp:
            if before is None:
                self._waiting_noted.pop(queue, None)
            else:
                self._waiting_noted[queue] = before

    def last_waiting_receiver(self, queue: str) -> float | None:
        """When a receiver of this process last waited on the queue without the database
        knowing (see :meth:`_note_blocked_receiver`)."""
        return self._waiting_noted.get(queue)

    def _record_empty_receive(self, queue: str) -> None:
        """Stamp the queue monitor's last empty RECEIVE, at most every
        ``EMPTY_RECEIVE_STAMP_INTERVAL`` per queue and process."""
        now = time.time()
        with self._empty_stamp_lock:
            if now - self._empty_stamped.get(queue, 0.0) < EMPTY_RECEIVE_STAMP_INTERVAL:
                return
            self._empty_stamped[queue] = now
        self._waiting_noted[queue] = self.clock()
        try:
            with self._engine.begin() as conn:
                self._store.execute(conn, "monitor_record_empty", queue=queue, now=self.clock())
        except Exception as exc:  # bookkeeping for monitors must never fail a receive
            self.availability.report(log, f"could not record an empty receive on {queue}", exc)

    def _hear_other_processes(self) -> None:
        """For a thread that waits for wakeups without registering as a receiver (the
        transport's loader: its NOTIFYs are sent whoever waits; a queue monitor: arrivals
        announced for another process's readers): start LISTENing on PostgreSQL, or the
        watcher of other connections' commits on SQLite."""
        if self._listener is not None:
            self._listener.start()
        else:
            self._watch_sqlite()

    def _watch_sqlite(self) -> None:
        """Start the SQLite watcher when the first receiver waits (PostgreSQL LISTENs)."""
        if self._listener is not None or self._watcher is not None:
            return
        with self._watcher_lock:
            if self._watcher is None and self._engine.url.database:
                self._watcher = wakeup.SqliteWatcher(self._engine.url.database, self._wakeups)

    def _set_waiting(
        self, queue: str, delta: int, ready_timeout: float = LISTEN_READY_TIMEOUT
    ) -> bool:
        """Register a PostgreSQL receiver as waiting (senders then NOTIFY).

        The process registers once per queue, on its first waiter, and keeps the
        registration ``WAITER_LINGER`` seconds after its last waiter left: a reader that
        waits again and again (an executor, ``synchronization``) then costs no
        bookkeeping transactions. A registration nobody uses costs extra NOTIFYs only.

        :return: whether the process registered just now: a message sent before then
            sent no NOTIFY, so a look made before it must be made again
        """
        assert self._listener is not None
        if delta > 0:
            self._listener.wait_ready(ready_timeout)
        with self._waiters_lock:
            count = self._waiters.get(queue, 0) + (1 if delta > 0 else -1)
            self._waiters[queue] = max(count, 0)
            if delta > 0:
                self._waiters_idle_since.pop(queue, None)
                if queue in self._registered:
                    return False
                self._registered.add(queue)
            else:
                if count <= 0:  # the timer thread unregisters it once the linger is over
                    self._waiters_idle_since[queue] = time.monotonic()
                return False
        try:
            self._register_waiter(queue, +1)
        except BaseException:
            with self._waiters_lock:  # not registered: the next waiter tries again
                self._registered.discard(queue)
                self._waiters[queue] = max(self._waiters.get(queue, 1) - 1, 0)
            raise
        return True

    def _register_waiter(self, queue: str, delta: int) -> None:
        name = "queue_add_waiter" if delta > 0 else "queue_remove_waiter"
        with connections.connect(self._engine) as conn:
            self._store.execute(conn, "commit_without_fsync")
            self._store.execute(conn, name, name=queue)
            conn.commit()

    def _unregister_idle_waiters(self) -> float | None:
        """Drop registrations whose linger is over; seconds until the next one ends."""
        now = time.monotonic()
        due, soonest = [], None
        with self._waiters_lock:
            for queue, since in list(self._waiters_idle_since.items()):
                if now - since >= WAITER_LINGER:
                    del self._waiters_idle_since[queue]
                    self._registered.discard(queue)
                    due.append(queue)
                else:
                    left = WAITER_LINGER - (now - since)
                    soonest = left if soonest is None else min(soonest, left)
        for queue in due:
            try:
                self._register_waiter(queue, -1)
            except Exception:
                log.warning("could not unregister the waiters of %s", queue, exc_info=True)
        return soonest

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

    def _run_timers(self) -> None:
        while not self._closed.is_set():
            try:
                while self.fire_timers():
                    pass
                with connections.connect(self._engine) as conn:
                    deadline = self._store.scalar(conn, "next_deadline")
                    conn.commit()  # it only read; a ROLLBACK would drop the prepared statements
                self.availability.mark_ok()
            except (exceptions.ConnectionLost, exceptions.DatabaseUnavailable) as exc:
                # This thread looks every second: it notices an outage (and its end) for
                # the whole process, which is what lease expiry measures from.
                self.availability.mark_lost(exc)
                deadline = None
            except Exception:  # the thread must outlive a passing database error
                log.warning("timer thread: firing timers failed", exc_info=True)
                deadline = None
            sleep = TIMER_POLL_INTERVAL
            if deadline is not None:
                sleep = max(0.0, min(sleep, float(deadline) - time.time()))
            if self._listener is not None:
                linger = self._unregister_idle_waiters()
                if linger is not None:
                    sleep = min(sleep, linger)
            self._timer_sleeps_until = time.time() + sleep
            self._timer_wakeup.wait(sleep)
            self._timer_wakeup.clear()
            self._timer_sleeps_until = 0.0  # awake: every new deadline will be seen


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
    CatalogOperations,
    ConversationOperations,
    LeaseOperations,
    PoisonOperations,
    RouteOperations,
):
    for _name, _operation in vars(_operations).items():
        public = not _name.startswith("_") and inspect.isfunction(_operation)
        if public and _name not in vars(Broker):
            setattr(Broker, _name, _rides_through(_operation))


class _Record:
    """A named statement run right after a take that got leases, in its round trip
    (:meth:`Broker.take_recorded`); ``rows``: what it returned, ``None`` when it did not
    run or its outcome is unknown; ``durable``: whether its commit waits for the flush."""

    def __init__(self, query: str, params: dict[str, Any], durable: bool = True) -> None:
        self.query = query
        self.params = params
        self.durable = durable
        self.rows: list[tuple[Any, ...]] | None = None
