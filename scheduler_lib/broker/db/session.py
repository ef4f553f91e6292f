"""The one owner of a broker transaction's connection, and what its operations declare.

A :class:`Session` takes its connection at the first statement, runs the broker's named
statements on it (the one door to the database), and ends it: a commit that then wakes
this process's waiters and counts what was done, or a rollback that gives received
messages back. The broker's operations (``catalog``, ``conversations``, ``leases``,
``poison``, ``routes``, ``arrival``, ``events``, ``activation``'s monitors, the transport's
delivery) do not touch its fields: they declare what they did through a small API —
:meth:`Session.mark_written`, :meth:`Session.touched`, :meth:`Session.deadline`,
:meth:`Session.catalog_changed` and the rest below — which the commit reads.
:class:`~scheduler_lib.broker.transaction.Transaction` is the public front that owns one
session (``tx.session``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import sqlalchemy as sa

from scheduler_lib.broker import counters, exceptions, models
from scheduler_lib.broker.db import connections, store, waiting, wakeup


@dataclasses.dataclass(eq=False)
class Shared:
    """What the sessions of one broker share, handed over once by the broker (a
    ``Broker``) that builds it: this module, below every operation, imports none of
    them, and a session reaches nothing of the broker but this."""

    store: store.Store
    engine: sa.Engine
    #: PostgreSQL: connections always in autocommit, for single-statement operations
    autocommit_engine: sa.Engine | None
    #: SQLite: one writing transaction at a time in this process, handed over in turn
    write_gate: threading.RLock | None
    write_gate_timeout: float  # seconds a transaction waits for the gate
    waiting: waiting.Waiting  # this process's waiting readers (WAITFOR)
    #: after a commit: wake this process's waiters on these queues; the soonest timer,
    #: lease or park the transaction set (the timer thread may have to look sooner)
    after_commit: Callable[[frozenset[str], float | None], None]
    #: after a rollback of a transaction that received from these queues (poison
    #: message detection counts it, in a transaction of its own)
    count_rollbacks: Callable[[frozenset[str]], None]
    #: SEND's cache of message types' validations (message type -> validation)
    validation_cache: dict[str, models.Validation] = dataclasses.field(default_factory=dict)
    #: conversations begun here to a service of this broker that have sent nothing yet
    #: (where SEND is one statement): their first SEND makes the target endpoint in its
    #: own round trip (``sending.UNSENT_LIMIT`` at most are kept)
    unsent: set[str] = dataclasses.field(default_factory=set)
    max_message_size: int = 0  # bytes; the largest body SEND accepts
    #: each thread's own connection of each engine, kept between its operations
    kept: connections.Kept = dataclasses.field(default_factory=connections.Kept)

    @property
    def url(self) -> sa.URL:
        """The database's URL."""
        return self.engine.url


class InTransaction(Protocol):
    """What the fronts' operation mixins run in: a public transaction (a ``Transaction``),
    of which they use the session only. Declared here, so that the mixins name no front
    (the fronts import them: a type-only import back would make a cycle)."""

    @property
    def session(self) -> Session: ...


class Session:
    """One database transaction of a broker, from its first statement to its end.

    :param shared: what the sessions of its broker share (engines, store, wake-ups)
    :param autocommit: single-statement operations: each statement commits as it runs
    :param engine: another engine's connections (``Broker.snapshot``'s; the take's,
        whose commits do not wait for the WAL flush), without the SQLite write gate
    """

    def __init__(
        self, shared: Shared, *, autocommit: bool = False, engine: sa.Engine | None = None
    ) -> None:
        self.shared = shared
        self.store = shared.store
        self.waiting = shared.waiting  # this process's waiting readers (WAITFOR)
        self.autocommit = autocommit  # only for single-statement operations
        # The transport's batches share their queue lookups here (None: not cached).
        self.queue_cache: dict[str, models.QueueInfo] | None = None
        # The public transaction this session serves, held weakly: a reference cycle per
        # transaction would leave every one to the cyclic garbage collector.
        self._front: weakref.ref[Any] | None = None
        self._engine = engine
        self._connection: sa.Connection | None = None
        self._kept: connections.Keeping | None = None  # its thread keeps the connection
        self._wrote = False
        self._finished = False
        self._touched_queues: set[str] = set()  # got messages: wake local waiters
        self._notified_queues: set[str] = set()  # already NOTIFYed by the statement itself
        self._received_queues: set[str] = set()  # their monitors re-check at our end
        self._receipts: set[str] = set()  # RECEIVE got messages: a rollback is counted
        self._next_deadline: float | None = None  # soonest timer/lease/park this tx set
        self._catalog_changed = False  # activation runtimes look at the catalog again
        self._transmitted = False  # put messages in the transmission queue: wake the transport
        self._in_gate = False
        self._lost = False  # ended by a lost connection
        # What it did, counted once it commits (counters.add): (what, *labels) -> n
        self._tally: dict[tuple[str, ...], int] = {}

    @property
    def front(self) -> Any:
        """The public transaction this session serves (a ``Transaction``), handed to the
        user callbacks an operation calls (a ``Notify`` callback's ``PoisonEvent.tx``)."""
        return None if self._front is None else self._front()

    def serves(self, front: object) -> None:
        """Name the public transaction this session serves (:attr:`front`)."""
        self._front = weakref.ref(front)

    # --- the one door: named statements on this session's connection -----------------

    def execute(self, query: str, /, **params: Any) -> sa.CursorResult[Any]:
        return self.store.execute(self.connection(), query, **params)

    def one(self, query: str, /, **params: Any) -> store.Row | None:
        return self.store.one(self.connection(), query, **params)

    def all(self, query: str, /, **params: Any) -> list[store.Row]:
        return self.store.all(self.connection(), query, **params)

    def scalar(self, query: str, /, **params: Any) -> Any:
        return self.store.scalar(self.connection(), query, **params)

    def count(self, query: str, /, **params: Any) -> int:
        return self.store.count(self.connection(), query, **params)

    def execute_many(self, query: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """One named statement for each of ``rows`` (executemany)."""
        self.store.execute_many(self.connection(), query, rows)

    def rows(self, query: str, /, **params: Any) -> list[tuple[Any, ...]]:
        """The rows of a named query as plain tuples (the driver's own cursor on
        PostgreSQL: no SQLAlchemy result handling)."""
        return self.store.rows(self.connection(), query, **params)

    def pipeline(
        self, statements: Sequence[tuple[str, Mapping[str, Any]]]
    ) -> list[list[tuple[Any, ...]]]:
        """Several named statements in one round trip (PostgreSQL), in this transaction;
        it wrote."""
        rows = self.store.pipeline(self.connection(), statements)
        self._wrote = True
        return rows

    def take_then(
        self,
        take: tuple[str, Mapping[str, Any]],
        then: tuple[str, Mapping[str, Any]],
        *,
        durable: bool = True,
    ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]] | Exception]:
        """A take that commits as it runs (this session is in autocommit) and a statement
        in a transaction of its own after it, in one round trip (:meth:`Store.take_then`)."""
        return self.store.take_then(self.connection(), take, then, durable=durable)

    def connection(self) -> sa.Connection:
        """The connection, taken at the first call (on SQLite after this process's write
        gate)."""
        self.check_open()
        if self._connection is None:
            engine = self._engine
            if engine is None and self.autocommit:
                engine = self.shared.autocommit_engine
            engine = engine or self.shared.engine
            # its thread's own, kept between its transactions (connections.Kept: a
            # pool's checkout and checkin each time cost more than a short statement)
            self._connection, self._kept = self.shared.kept.take(engine)
        elif self._connection.invalidated:
            # Lost earlier in this transaction, and its caller went on past the
            # ConnectionLost: what it did went with the connection. SQLAlchemy would hand
            # out a new one (a transaction of the driver's alone is none it knows of), and
            # the rest would run, and commit, without the start.
            raise exceptions.ConnectionLost(
                "the transaction's connection was lost earlier: roll it back and run it again"
            )
        if self._engine is None:
            self._enter_gate()
        return self._connection

    @property
    def in_gate(self) -> bool:
        """Whether it holds this process's SQLite write gate."""
        return self._in_gate

    @property
    def connected(self) -> bool:
        """Whether a connection was taken (a statement ran)."""
        return self._connection is not None

    # --- what the operations declare (read when the transaction ends) ----------------

    @property
    def wrote(self) -> bool:
        """Whether it wrote (or locked) anything: its commit matters, and a wait inside
        it must keep the transaction."""
        return self._wrote

    def mark_written(self) -> None:
        """It wrote or locked something that must last until its end."""
        self._wrote = True

    def touched(self, queue: str) -> None:
        """``queue`` got messages (or changed): its local waiters wake at commit, and
        other processes' through a NOTIFY unless the statement sent one (:meth:`notified`)."""
        self._touched_queues.add(queue)

    def notified(self, queue: str) -> None:
        """The statement itself sent ``queue``'s NOTIFY (only if a receiver waited)."""
        self._notified_queues.add(queue)

    def received_from(self, queue: str) -> None:
        """A receive looked at ``queue``: its monitor re-checks when this ends."""
        self._received_queues.add(queue)

    def receipt(self, queue: str) -> None:
        """A RECEIVE got messages from ``queue``: a rollback is counted against it (poison
        message detection)."""
        self._receipts.add(queue)

    def deadline(self, when: float) -> None:
        """It set something due at ``when`` (a conversation timer, a lease expiry, a
        parked message's return): the timer thread is woken for it at commit if it would
        otherwise sleep past it."""
        if self._next_deadline is None or when < self._next_deadline:
            self._next_deadline = when

    def catalog_changed(self) -> None:
        """It changed queues or event notifications: activation runtimes look again."""
        self._catalog_changed = True

    def transmitted(self) -> None:
        """It put messages in the transmission queue: the transport wakes at commit."""
        self._transmitted = True

    def tally(self, *key: str, n: int = 1) -> None:
        """Count ``key`` (:mod:`~scheduler_lib.broker.counters`'s ``(what, *labels)``)
        ``n`` times if this transaction commits."""
        self._tally[key] = self._tally.get(key, 0) + n

    def commit_without_flush(self) -> None:
        """PostgreSQL: this transaction's commit does not wait for the WAL flush (a later
        durable commit of any session flushes it too). Must come before any write."""
        if self._wrote:
            raise exceptions.TransactionError(
                "a transaction that already wrote cannot give up its durable commit"
            )
        if self.store.features.commits_without_flush:
            self.execute("commit_without_fsync")

    # --- its end ---------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self._finished

    def check_open(self) -> None:
        if self._finished:
            raise exceptions.TransactionError("the transaction has already ended")

    def end_on(self, exc: BaseException) -> None:
        """Roll back because ``exc`` was raised inside; a driver error that came past the
        one door (SQLAlchemy ran a statement of its own) is raised as the broker says it,
        so that a lost connection is ridden through like any other instead of ending the
        caller's loop."""
        said: Exception | None = None
        if isinstance(exc, sa.exc.DBAPIError) and self._connection is not None:
            said = store.dbapi_error(self._connection, "a statement", exc)
        # A lost connection is not the messages' fault: it is not counted as a
        # rollback by poison message detection (an outage would disable queues).
        self._lost = isinstance(said or exc, exceptions.ConnectionLost)
        self.rollback()
        if said is not None:
            raise said from exc

    def commit(self) -> None:
        """Commit, then wake local waiters on the queues that got messages."""
        self.check_open()
        self._finished = True
        conn = self._connection
        if conn is None:
            return
        failed = False
        try:
            # Lost earlier in the transaction: its wake-ups must not run either (on a
            # new connection, or refused by SQLAlchemy as a pending rollback)
            self._refuse_lost(conn)
            for queue in sorted(self._touched_queues - self._notified_queues):
                self.store.execute(conn, "queue_notify", name=queue)
            if self._transmitted and self.store.features.notifies:
                self.store.execute(conn, "transmission_notify")
            # Lost during COMMIT: a transaction that wrote may or may not have committed.
            # One that only read did nothing either way.
            self._commit_on(conn, committing=self._wrote)
        except BaseException as exc:
            # A commit that failed rolled back: counted like one, unless the connection
            # was lost (not the messages' fault) — its RECEIVEs' messages are back on
            # their queues then too (or, lost during COMMIT, maybe taken): this
            # process's readers of them look again at once either way.
            failed = True
            self._lost = self._lost or isinstance(exc, exceptions.ConnectionLost)
            with contextlib.suppress(Exception):  # a lost connection has nothing to undo
                store.rollback(conn)
            raise
        finally:
            try:
                self._give_back(conn)
            finally:
                self._connection = None
                self._leave_gate()
                if failed:
                    self._after_rollback()
        if self._tally:
            counters.add(self._tally)
        woken = self._touched_queues | self._received_queues
        if self._transmitted:
            woken.add(wakeup.TRANSMISSION)
        if self._catalog_changed:
            woken.add(wakeup.CATALOG)
            self.waiting.waited_queues.clear()  # RECEIVEs here see the change at once
        self.shared.after_commit(frozenset(woken), self._next_deadline)

    def rollback(self) -> None:
        """Roll back: nothing this transaction did remains; received messages are back."""
        if self._finished:
            return
        self._finished = True
        conn = self._connection
        if conn is not None:
            self._connection = None
            try:
                store.rollback(conn)
            except Exception as exc:
                if not isinstance(exc, sa.exc.DBAPIError) and not store.is_driver_error(exc):
                    raise
                if not store.is_lost(conn, exc):  # the server rolled back a lost one itself
                    raise
                connections.invalidate(conn, exc)
            finally:
                self._give_back(conn)
                self._leave_gate()
        self._after_rollback()

    def _give_back(self, conn: sa.Connection) -> None:
        kept, self._kept = self._kept, None
        self.shared.kept.give_back(conn, kept)

    def __del__(self) -> None:
        # Dropped in the middle of its transaction (never committed nor rolled back):
        # its thread must not keep the connection, which is still in it. (A connection
        # of the pool would be given back by SQLAlchemy when it goes.)
        kept = getattr(self, "_kept", None)
        if kept is not None:
            kept.discard()

    def _after_rollback(self) -> None:
        # A rolled-back RECEIVE put messages back: their queue monitors look again, and
        # built-in poison message detection counts the rollback.
        if self._receipts and not self._lost:
            self.shared.count_rollbacks(frozenset(self._receipts))
        self.waiting.wakeups.notify(self._received_queues)

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        """A part of the transaction that can fail alone (SAVEPOINT): on an exception
        only what it did is undone, and the exception goes on."""
        conn = self.connection()
        try:
            nested = conn.begin_nested()
        except sa.exc.DBAPIError as exc:
            raise store.dbapi_error(conn, "savepoint", exc) from exc
        try:
            yield
        except BaseException as exc:
            try:
                nested.rollback()
            except sa.exc.DBAPIError as undo:
                # A lost connection took the savepoint with it: the caller hears of the
                # loss (and its retry runs again), never SQLAlchemy's own error for it
                raise store.dbapi_error(conn, "rollback to savepoint", undo) from exc
            raise
        try:
            nested.commit()
        except sa.exc.DBAPIError as exc:
            raise store.dbapi_error(conn, "release savepoint", exc) from exc

    def release_while_idle(self) -> None:
        """End the database transaction if it did nothing yet (so waiting holds no lock).

        By COMMIT, which ends a transaction that wrote nothing just as ROLLBACK would:
        psycopg forgets every prepared statement of the connection at a ROLLBACK
        (DEALLOCATE ALL), so the statements after each empty look were planned anew."""
        conn = self._connection
        if not self._wrote and conn is not None and store.in_transaction(conn):
            # It had done nothing: nothing went with it, and the operation can run again
            self._commit_on(conn, committing=False)
            self._leave_gate()

    @staticmethod
    def _refuse_lost(conn: sa.Connection) -> None:
        if conn.invalidated:  # lost earlier in the transaction: nothing is there to commit
            raise exceptions.ConnectionLost(
                "commit: the transaction's connection was lost earlier; nothing of it was kept"
            )

    @staticmethod
    def _commit_on(conn: sa.Connection, *, committing: bool) -> None:
        """Commit ``conn``'s transaction (SQLAlchemy's or the driver's own), a failure said
        as the broker says it: a lost connection is thrown away and becomes ConnectionLost
        (``committing``: the commit may have happened), any other error DatabaseError."""
        Session._refuse_lost(conn)
        try:
            store.commit(conn)
        except Exception as exc:
            if not isinstance(exc, sa.exc.DBAPIError) and not store.is_driver_error(exc):
                raise
            if not store.is_lost(conn, exc):
                raise store.commit_error(conn, exc) from exc
            connections.invalidate(conn, exc)
            raise connections.lost("commit", exc, committing=committing) from exc

    def _enter_gate(self) -> None:
        """SQLite: take this process's write gate before BEGIN IMMEDIATE. Threads of one
        process then queue for the write lock in turn instead of racing SQLite's sleeping
        busy handler, which lets a thread that commits and begins again starve the rest."""
        gate = self.shared.write_gate
        if gate is None or self._in_gate:
            return
        if not gate.acquire(timeout=self.shared.write_gate_timeout):
            raise exceptions.DatabaseError(
                "timed out waiting for another transaction of this process to end",
                hint="on SQLite one transaction writes at a time; keep transactions short",
            )
        self._in_gate = True

    def _leave_gate(self) -> None:
        if self._in_gate:
            self._in_gate = False
            assert self.shared.write_gate is not None
            self.shared.write_gate.release()
