"""A broker transaction: every operation inside it commits or rolls back together."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy as sa

from scheduler_lib.broker import connections, counters, exceptions, store, wakeup
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.catalog import CatalogOperations
from scheduler_lib.broker.conversations import (
    SENDABLE_STATES,
    ConversationOperations,
    state_error,
)
from scheduler_lib.broker.models import (
    DIALOG_TIMER,
    DIALOG_TIMER_SEQUENCE,
    END_DIALOG,
    ERROR,
    ERROR_SEQUENCE,
    MESSAGE_COLUMNS,
    ConversationEndpoint,
    EndpointState,
    Message,
    QueueInfo,
    SentBy,
    Validation,
)
from scheduler_lib.broker.poison import PoisonOperations
from scheduler_lib.broker.routes import RouteOperations
from scheduler_lib.broker.store import Row

if TYPE_CHECKING:
    from scheduler_lib.broker.broker import Broker

T = TypeVar("T")

LIFETIME_EXPIRED_CODE = -8489  # SQL Server's code for "the dialog has exceeded its LIFETIME"
QUEUE_RECHECK = 1.0  # seconds a waiting RECEIVE trusts the queue's settings
LIFETIME_RETRY = 1.0  # seconds before expiry looks again at an ended endpoint whose group is held


class Transaction(CatalogOperations, ConversationOperations, PoisonOperations, RouteOperations):
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
        self._autocommit = autocommit  # only for single-statement operations
        self._engine = engine  # another engine's connections (Broker.snapshot), no gate
        self._store = broker._store
        self._connection: sa.Connection | None = None
        self._wrote = False
        self._finished = False
        self._touched_queues: set[str] = set()  # got messages: wake local waiters
        self._notified_queues: set[str] = set()  # already NOTIFYed by the statement itself
        self._received_queues: set[str] = set()  # their monitors re-check at our end
        self._receipts: set[str] = set()  # RECEIVE got messages: a rollback is counted
        self._next_deadline: float | None = None  # soonest timer/lease/park this tx set
        self._catalog_changed = False  # activation runtimes look at the catalog again
        self._transmitted = False  # put messages in the transmission queue: wake the transport
        self._queue_cache: dict[str, QueueInfo] | None = None  # set by the transport's batches
        self._in_gate = False
        self._lost = False  # ended by a lost connection
        # What it did, counted once it commits (counters.add): (what, *labels) -> n
        self._tally: dict[tuple[str, ...], int] = {}

    # --- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._finished:
            return
        if exc_type is None:
            self.commit()
            return
        said: Exception | None = None
        if isinstance(exc, sa.exc.DBAPIError) and self._connection is not None:
            # A driver error that came past the one door (SQLAlchemy ran a statement of
            # its own): said as the broker says it, so that a lost connection is ridden
            # through like any other instead of ending the caller's loop
            said = store.dbapi_error(self._connection, "a statement", exc)
        # A lost connection is not the messages' fault: it is not counted as a
        # rollback by poison message detection (an outage would disable queues).
        self._lost = isinstance(said or exc, exceptions.ConnectionLost)
        self.rollback()
        if said is not None:
            raise said from exc

    def commit(self) -> None:
        """Commit, then wake local waiters on the queues that got messages."""
        self._check_open()
        self._finished = True
        conn = self._connection
        if conn is None:
            return
        failed = False
        try:
            for queue in sorted(self._touched_queues - self._notified_queues):
                self._store.execute(conn, "queue_notify", name=queue)
            if self._transmitted and self._store.has("transmission_notify"):
                self._store.execute(conn, "transmission_notify")
            try:
                conn.commit()
            except sa.exc.DBAPIError as exc:
                if not connections.is_lost(exc):
                    raise store.database_error(conn.engine, "commit", exc) from exc
                connections.invalidate(conn, exc)
                # Lost during COMMIT: a transaction that wrote may or may not have
                # committed. One that only read did nothing either way.
                raise connections.lost("commit", exc, committing=self._wrote) from exc
        except BaseException as exc:
            failed = not isinstance(exc, exceptions.ConnectionLost)
            with contextlib.suppress(Exception):  # a lost connection has nothing to undo
                conn.rollback()
            raise
        finally:
            try:
                with contextlib.suppress(Exception):
                    conn.close()
            finally:
                self._connection = None
                self._leave_gate()
                if failed:  # a commit that failed rolled back: count it like one
                    self._after_rollback()
        if self._tally:
            counters.add(self._tally)
        woken = self._touched_queues | self._received_queues
        if self._transmitted:
            woken.add(wakeup.TRANSMISSION)
        if self._catalog_changed:
            woken.add(wakeup.CATALOG)
            self._broker._waited_queues.clear()  # RECEIVEs here see the change at once
        self._broker._after_commit(frozenset(woken), self._next_deadline)

    def rollback(self) -> None:
        """Roll back: nothing this transaction did remains; received messages are back."""
        if self._finished:
            return
        self._finished = True
        conn = self._connection
        if conn is not None:
            self._connection = None
            try:
                conn.rollback()
            except sa.exc.DBAPIError as exc:
                if not connections.is_lost(exc):  # the server rolled back a lost one itself
                    raise
                connections.invalidate(conn, exc)
            finally:
                with contextlib.suppress(Exception):
                    conn.close()
                self._leave_gate()
        self._after_rollback()

    def _after_rollback(self) -> None:
        # A rolled-back RECEIVE put messages back: their queue monitors look again, and
        # built-in poison message detection counts the rollback.
        if self._receipts and not self._lost:
            self._broker._count_rollbacks(frozenset(self._receipts))
        self._broker._wakeups.notify(self._received_queues)

    def _add_count(self, *key: str, n: int = 1) -> None:
        """Count ``key`` (:mod:`~scheduler_lib.broker.counters`'s ``(what, *labels)``)
        ``n`` times if this transaction commits."""
        self._tally[key] = self._tally.get(key, 0) + n

    def _deadline(self, when: float) -> None:
        """This transaction sets something due at ``when`` (a conversation timer, a lease
        expiry, a parked message's return): the timer thread is woken for it at commit
        if it would otherwise sleep past it."""
        if self._next_deadline is None or when < self._next_deadline:
            self._next_deadline = when

    def _commit_without_flush(self) -> None:
        """PostgreSQL: this transaction's commit does not wait for the WAL flush (a later
        durable commit of any session flushes it too). Must come before any write."""
        if self._wrote:
            raise exceptions.TransactionError(
                "a transaction that already wrote cannot give up its durable commit"
            )
        if self._store.is_postgresql:
            self._execute("commit_without_fsync")

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        """A part of the transaction that can fail alone (SAVEPOINT): on an exception
        only what it did is undone, and the exception goes on."""
        conn = self._conn()
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

    def _check_open(self) -> None:
        if self._finished:
            raise exceptions.TransactionError("the transaction has already ended")

    @contextlib.contextmanager
    def _operation(self) -> Iterator[Transaction]:
        self._check_open()
        yield self

    def _conn(self) -> sa.Connection:
        self._check_open()
        if self._connection is None:
            engine = self._broker._autocommit_engine if self._autocommit else self._engine
            self._connection = connections.connect(engine or self._broker._engine)
        if self._engine is None:
            self._enter_gate()
        return self._connection

    def _release_while_idle(self) -> None:
        """End the database transaction if it did nothing yet (so waiting holds no lock).

        By COMMIT, which ends a transaction that wrote nothing just as ROLLBACK would:
        psycopg forgets every prepared statement of the connection at a ROLLBACK
        (DEALLOCATE ALL), so the statements after each empty look were planned anew."""
        conn = self._connection
        if not self._wrote and conn is not None and conn.in_transaction():
            try:
                conn.commit()
            except sa.exc.DBAPIError as exc:
                if not connections.is_lost(exc):
                    raise exceptions.DatabaseError(f"commit: {exc.orig}") from exc
                connections.invalidate(conn, exc)
                # It had done nothing: nothing went with it, and the operation can run again
                raise connections.lost("commit", exc) from exc
            self._leave_gate()

    def _enter_gate(self) -> None:
        """SQLite: take this process's write gate before BEGIN IMMEDIATE. Threads of one
        process then queue for the write lock in turn instead of racing SQLite's sleeping
        busy handler, which lets a thread that commits and begins again starve the rest."""
        gate = self._broker._write_gate
        if gate is None or self._in_gate:
            return
        if not gate.acquire(timeout=self._broker._write_gate_timeout):
            raise exceptions.DatabaseError(
                "timed out waiting for another transaction of this process to end",
                hint="on SQLite one transaction writes at a time; keep transactions short",
            )
        self._in_gate = True

    def _leave_gate(self) -> None:
        if self._in_gate:
            self._in_gate = False
            assert self._broker._write_gate is not None
            self._broker._write_gate.release()

    # --- the one door, bound to this transaction's connection -------------------------

    def _execute(self, query: str, /, **params: Any) -> sa.CursorResult[Any]:
        return self._store.execute(self._conn(), query, **params)

    def _one(self, query: str, /, **params: Any) -> Row | None:
        return self._store.one(self._conn(), query, **params)

    def _all(self, query: str, /, **params: Any) -> list[Row]:
        return self._store.all(self._conn(), query, **params)

    def _scalar(self, query: str, /, **params: Any) -> Any:
        return self._store.scalar(self._conn(), query, **params)

    def _count(self, query: str, /, **params: Any) -> int:
        return self._store.count(self._conn(), query, **params)

    # --- named queries of the layers above (Broker.use_queries) ------------------------

    @property
    def broker(self) -> Broker:
        """The broker this transaction belongs to."""
        return self._broker

    def run(self, query: str, /, **params: Any) -> int:
        """Run a named statement in this transaction; how many rows it changed."""
        self._wrote = True
        return self._count(query, **params)

    def fetch(self, query: str, /, **params: Any) -> list[Row]:
        """Every row of a named query, as mappings."""
        return self._all(query, **params)

    def fetch_one(self, query: str, /, **params: Any) -> Row | None:
        """The first row of a named query, or ``None``."""
        return self._one(query, **params)

    def fetch_value(self, query: str, /, **params: Any) -> Any:
        """The first column of the first row of a named query, or ``None``."""
        return self._scalar(query, **params)

    # --- lookups that raise the right NotFound ---------------------------------------

    def _queue(self, name: str) -> QueueInfo:
        row = self._one("queue_get", name=name)
        if row is None:
            raise exceptions.QueueNotFound(f"queue {name!r} does not exist")
        return QueueInfo.from_row(row)

    def _service(self, name: str) -> Row:
        row = self._one("service_get", name=name)
        if row is None:
            raise exceptions.ServiceNotFound(f"service {name!r} does not exist")
        return row

    def _endpoint(self, handle: str) -> ConversationEndpoint:
        row = self._one("endpoint_get", handle=handle)
        if row is None:
            raise exceptions.ConversationNotFound(
                f"conversation handle {handle} does not exist (never began, or already closed)"
            )
        return ConversationEndpoint.from_row(row)

    def _far_endpoint(
        self, endpoint: ConversationEndpoint, *, create: bool
    ) -> ConversationEndpoint | None:
        row = self._one(
            "endpoint_far",
            conversation_id=str(endpoint.conversation_id),
            is_initiator=endpoint.is_initiator,
        )
        if row is not None:
            return ConversationEndpoint.from_row(row)
        if not create or not endpoint.is_initiator:
            return None
        if endpoint.send_sequence > 0:
            # The target existed and was removed WITH CLEANUP: never bring it back.
            raise exceptions.ConversationStateError(
                f"cannot send on conversation {endpoint.conversation_handle}: the target "
                "endpoint no longer exists (it was ended with cleanup); end it here too"
            )
        # The target endpoint comes into being with the conversation's first message.
        return self._create_target_endpoint(
            conversation_id=str(endpoint.conversation_id),
            service=endpoint.far_service_name,
            far_service=endpoint.service_name,
            contract=endpoint.contract_name,
            lifetime_expires_at=endpoint.lifetime_expires_at,
            is_remote=False,
        )

    def _create_target_endpoint(
        self,
        *,
        conversation_id: str,
        service: str,
        far_service: str,
        contract: str,
        lifetime_expires_at: float | None,
        is_remote: bool,
    ) -> ConversationEndpoint:
        """A conversation's target endpoint, in a new group of its service's queue (its
        initiator is here, or on another broker when ``is_remote``)."""
        target = self._service(service)
        now = time.time()
        handle, group_id = str(uuid.uuid4()), str(uuid.uuid4())
        self._execute("group_insert", group_id=group_id, queue=target["queue_name"], now=now)
        self._execute(
            "endpoint_insert",
            handle=handle,
            conversation_id=conversation_id,
            is_initiator=False,
            service=service,
            far_service=far_service,
            contract=contract,
            queue=target["queue_name"],
            group_id=group_id,
            state=EndpointState.STARTED_INBOUND.value,
            lifetime_expires_at=lifetime_expires_at,
            now=now,
            is_remote=is_remote,
        )
        self._wrote = True
        return self._endpoint(handle)

    # --- sending ---------------------------------------------------------------------

    def _send_fast(
        self,
        handle: str,
        message_type: str,
        data: bytes | None,
        lease_id: str | None = None,
        before: tuple[str, Mapping[str, Any]] | None = None,
    ) -> tuple[int | None, bool]:
        """SEND in one statement where the dialect has one and the message type's
        validation is known: its sequence number, or ``None`` for "use
        :meth:`_send_checked`" (the SEND wrote nothing) — and whether ``before`` (a named
        statement and its binds) ran, in the same round trip, ahead of it. With
        ``lease_id`` the SEND also ends that lease.

        :raises LeaseLost: when the lease was gone (the transaction must roll back)
        """
        cached = self._broker._validation_cache.get(message_type)
        if cached is None or not self._store.has("send_fast"):
            return None, False
        checks.check_body(message_type, cached, data)
        send = {
            "handle": handle,
            "message_type": message_type,
            "validation": cached.value,
            "body": data,
            "now": time.time(),
            "lease_id": lease_id,
        }
        if before is not None:
            _, rows = self._store.pipeline(self._conn(), [before, ("send_fast", send)])
            self._wrote = True
        else:
            rows = self._store.rows(self._conn(), "send_fast", **send)
        if not rows:
            return None, before is not None
        seq, queue, _notified, completed = rows[0]
        self._wrote = True
        if lease_id is not None and not completed:
            raise exceptions.LeaseLost(
                f"lease {lease_id} on conversation {handle} is gone: it expired (the "
                "message went back to its queue or to its poison disposition) or already "
                "ended; roll back the answer"
            )
        # The statement already sent NOTIFY if, and only if, somebody waits.
        self._notified_queues.add(queue)
        self._touched_queues.add(queue)
        self._add_count(counters.SENT, queue)
        return int(seq), before is not None

    def _send_many_fast(
        self,
        handle: str,
        message_type: str,
        data: list[bytes | None],
        before: tuple[str, Mapping[str, Any]] | None = None,
    ) -> tuple[int | None, bool]:
        """Several SENDs in one statement where the dialect has one and the message
        type's validation is known: the first sequence number, or ``None`` ("send them
        one by one on the checked path") — and whether ``before`` (a named statement and
        its binds) ran, in the same round trip, ahead of the SEND."""
        cached = self._broker._validation_cache.get(message_type)
        if cached is None or not self._store.has("send_many_fast"):
            return None, False
        for body in data:
            checks.check_body(message_type, cached, body)
        send = {
            "handle": handle,
            "message_type": message_type,
            "validation": cached.value,
            "bodies": data,
            "n": len(data),
            "now": time.time(),
        }
        if before is not None:
            _, rows = self._store.pipeline(self._conn(), [before, ("send_many_fast", send)])
            self._wrote = True
        else:
            rows = self._store.rows(self._conn(), "send_many_fast", **send)
        if not rows:
            return None, before is not None
        first, queue, _notified = rows[0]
        self._wrote = True
        self._notified_queues.add(queue)
        self._touched_queues.add(queue)
        self._add_count(counters.SENT, queue, n=len(data))
        return int(first), before is not None

    def _send_checked(self, handle: str, message_type: str, data: bytes | None) -> int:
        """SEND with every check spelled out: the path that names what is wrong, creates
        the target endpoint with the first message, and holds messages for a disabled
        queue. PostgreSQL's one-statement fast path falls back to it."""
        endpoint = self._endpoint(handle)
        mt = self._one("message_type_get", name=message_type)
        if mt is None:
            raise exceptions.MessageTypeNotFound(f"message type {message_type!r} does not exist")
        validation = Validation(mt["validation"])
        self._broker._validation_cache[message_type] = validation
        allowed = {
            r["message_type_name"]: SentBy(r["sent_by"])
            for r in self._all("contract_message_types", name=endpoint.contract_name)
        }
        side = SentBy.INITIATOR if endpoint.is_initiator else SentBy.TARGET
        if message_type not in allowed:
            raise exceptions.ContractViolation(
                f"message type {message_type!r} is not part of contract {endpoint.contract_name!r}"
            )
        if allowed[message_type] not in (side, SentBy.ANY):
            raise exceptions.ContractViolation(
                f"contract {endpoint.contract_name!r} lets only the {allowed[message_type].value} "
                f"send {message_type!r}; this endpoint is the {side.value}"
            )
        if endpoint.state.value not in SENDABLE_STATES:
            raise state_error(endpoint, "send on")
        checks.check_body(message_type, validation, data)
        if endpoint.is_remote:
            return self._send_remote(endpoint, message_type, data)
        far = self._far_endpoint(endpoint, create=True)
        assert far is not None
        if far.state.value not in SENDABLE_STATES:
            # The far side ended or failed; its EndDialog/Error is on our queue already.
            raise state_error(far, "send to the far side of")
        target = self._queue(far.queue_name)
        taken = self._one(
            "endpoint_take_send_sequence",
            handle=handle,
            quantum=target.fair_share_quantum,
            now=time.time(),
        )
        if taken is None:  # the state changed since we read it
            raise state_error(self._endpoint(handle), "send on")
        seq = int(taken["message_sequence_number"])
        self._enqueue_at(far, seq, message_type, data, fair_at=float(taken["fair_at"]))
        self._retain_sent(handle, seq, message_type, data)
        return seq

    def _send_remote(
        self, endpoint: ConversationEndpoint, message_type: str, data: bytes | None
    ) -> int:
        """SEND to a service on another broker: the message waits in the transmission
        queue until that broker acknowledges it (the transport sends it)."""
        handle = str(endpoint.conversation_handle)
        taken = self._one(
            "endpoint_take_send_sequence", handle=handle, quantum=None, now=time.time()
        )
        if taken is None:  # the state changed since we read it
            raise state_error(self._endpoint(handle), "send on")
        seq = int(taken["message_sequence_number"])
        self._transmit(endpoint, seq, message_type, data)
        self._retain_sent(handle, seq, message_type, data)
        return seq

    def _send_remote_many(
        self, handle: str, message_type: str, data: list[bytes | None]
    ) -> list[int]:
        """The rest of a ``send_many`` to another broker, after its first message went
        the checked way (so the contract, direction and state are known to be fine)."""
        validation = self._broker._validation_cache[message_type]
        for body in data:
            checks.check_body(message_type, validation, body)
        endpoint = self._endpoint(handle)
        first = self._scalar("endpoint_take_send_sequences", handle=handle, n=len(data))
        if first is None:
            raise state_error(endpoint, "send on")
        now = time.time()
        common = self._outgoing_row(endpoint, message_type, now)
        self._store.execute_many(
            self._conn(),
            "outgoing_insert",
            [{**common, "seq": int(first) + i, "body": body} for i, body in enumerate(data)],
        )
        if self._queue(endpoint.queue_name).is_retention_enabled:
            self._store.execute_many(
                self._conn(),
                "message_retain_sent",
                [
                    {
                        "handle": handle,
                        "seq": int(first) + i,
                        "message_type": message_type,
                        "body": body,
                        "now": now,
                    }
                    for i, body in enumerate(data)
                ],
            )
        self._wrote = True
        self._transmitted = True
        self._add_count(counters.SENT, counters.TRANSMISSION, n=len(data))
        return list(range(int(first), int(first) + len(data)))

    def _retain_sent(self, handle: str, seq: int, message_type: str, body: bytes | None) -> None:
        """RETENTION on the sender's queue: a copy of what this endpoint sent stays there
        (status 3) until the conversation ends. One statement, which writes nothing when
        the sender's queue keeps nothing. (PostgreSQL's one-statement SEND leaves such
        senders to the checked path, which calls this.)"""
        self._execute(
            "message_retain_sent",
            handle=handle,
            seq=seq,
            message_type=message_type,
            body=body,
            now=time.time(),
        )

    def _outgoing_row(
        self, endpoint: ConversationEndpoint, message_type: str, now: float
    ) -> dict[str, Any]:
        return {
            "handle": str(endpoint.conversation_handle),
            "conversation_id": str(endpoint.conversation_id),
            "is_initiator": endpoint.is_initiator,
            "from_service": endpoint.service_name,
            "to_service": endpoint.far_service_name,
            "contract": endpoint.contract_name,
            "message_type": message_type,
            "priority": endpoint.priority,
            "lifetime_expires_at": endpoint.lifetime_expires_at,
            "group_id": str(endpoint.conversation_group_id),
            "now": now,
        }

    def _transmit(
        self, endpoint: ConversationEndpoint, seq: int, message_type: str, body: bytes | None
    ) -> None:
        """Put message ``seq`` of ``endpoint`` in the transmission queue for its far
        broker; the transport is woken at commit."""
        row = self._outgoing_row(endpoint, message_type, time.time())
        self._execute("outgoing_insert", seq=seq, body=body, **row)
        self._wrote = True
        self._transmitted = True
        self._add_count(counters.SENT, counters.TRANSMISSION)

    def _end_remote(
        self, endpoint: ConversationEndpoint, error: int | None, description: str | None
    ) -> None:
        """END CONVERSATION of a conversation whose far side is on another broker: the
        ``EndDialog`` (or ``Error``) travels as the conversation's next message."""
        handle = str(endpoint.conversation_handle)
        if endpoint.is_initiator and endpoint.send_sequence == 0:
            self._close(endpoint)  # nothing was ever sent: the far side never knew of it
            return
        self._execute("messages_delete_conversation", handle=handle)
        self._execute("transmission_delete_held", handle=handle)
        seq = int(self._scalar("endpoint_take_system_sequence", handle=handle))
        if endpoint.state in (EndpointState.DISCONNECTED_INBOUND, EndpointState.ERROR):
            # The far side ended (or this side failed): the last to leave closes, and tells
            # the far side, which waits in DISCONNECTED_OUTBOUND for this.
            self._close(endpoint)
            self._transmit(endpoint, seq, END_DIALOG, None)
            return
        if error is None:
            self._transmit(endpoint, seq, END_DIALOG, None)
        else:
            body = json.dumps({"code": error, "description": description}).encode()
            self._transmit(endpoint, seq, ERROR, body)
        self._execute(
            "endpoint_set_state", handle=handle, state=EndpointState.DISCONNECTED_OUTBOUND.value
        )

    def _enqueue_at(
        self,
        endpoint: ConversationEndpoint,
        seq: int,
        message_type: str,
        body: bytes | None,
        *,
        fair_at: float = 0.0,
    ) -> None:
        """A local message to ``endpoint``: the sender's row lock already ordered it."""
        row = {
            "queue_name": endpoint.queue_name,
            "conversation_group_id": str(endpoint.conversation_group_id),
            "priority": endpoint.priority,
            "service_name": endpoint.service_name,
            "contract_name": endpoint.contract_name,
        }
        self._enqueue(
            row, str(endpoint.conversation_handle), seq, message_type, body, fair_at=fair_at
        )

    def _enqueue(
        self,
        endpoint: Row,
        handle: str,
        seq: int,
        message_type: str,
        body: bytes | None,
        *,
        fair_at: float = 0.0,
    ) -> None:
        """Put a message on the endpoint's queue, or hold it while that queue is off.
        ``fair_at`` is its fair-share stamp (0: served in arrival order, ahead of stamped
        messages of its level — system messages and messages put back)."""
        self._wrote = True
        if self._queue_cache is None:
            queue = self._queue(endpoint["queue_name"])
        else:  # the transport's batch: one read per queue and transaction
            queue = self._queue_cache.get(endpoint["queue_name"]) or self._queue_cache.setdefault(
                endpoint["queue_name"], self._queue(endpoint["queue_name"])
            )
        params = {
            "queue": queue.name,
            "group_id": endpoint["conversation_group_id"],
            "handle": handle,
            "seq": seq,
            "message_type": message_type,
            "body": body,
            "priority": endpoint["priority"],
            "service": endpoint["service_name"],
            "contract": endpoint["contract_name"],
            "now": time.time(),
            "fair_at": fair_at,
        }
        self._add_count(counters.SENT, queue.name)
        if queue.is_receive_enabled:
            self._execute("message_insert", **params)
            self._touched_queues.add(queue.name)
        else:
            self._execute(
                "transmission_insert",
                transmission_status=f"target queue {queue.name!r} is disabled",
                **params,
            )

    def _close(self, endpoint: ConversationEndpoint, *, cleanup: bool = False) -> None:
        """Remove an endpoint, its messages and, once empty, its group. A remote
        conversation's endpoint stays as a tombstone (state ``CD``) for a while: late
        copies of its messages must be recognised, not open a new conversation; and its
        outgoing messages still go (the far side needs their numbers to take what
        follows, its EndDialog), unless this is a cleanup."""
        handle = str(endpoint.conversation_handle)
        self._execute("messages_delete_conversation", handle=handle)
        if endpoint.is_remote and not cleanup:
            self._execute("transmission_delete_held", handle=handle)
        else:
            self._execute("transmission_delete_conversation", handle=handle)
        self._execute("leases_delete_conversation", handle=handle)
        self._execute("poison_history_delete_conversation", handle=handle)
        self._wrote = True
        if endpoint.is_remote:
            self._execute(
                "fragments_delete_conversation",
                conversation_id=str(endpoint.conversation_id),
                is_initiator=not endpoint.is_initiator,
            )
            self._execute("endpoint_tombstone", handle=handle, now=time.time())
            return
        self._execute("endpoint_delete", handle=handle)
        self._execute("group_delete_if_empty", group_id=str(endpoint.conversation_group_id))

    # --- receiving -------------------------------------------------------------------

    def _receive_once(
        self,
        queue: str,
        top: int,
        handle: str | None,
        group_id: str | None,
        *,
        fast_looked: bool = False,
    ) -> list[Message]:
        """One look; ``fast_looked``: the caller has just made the one-statement look."""
        if not fast_looked and group_id is None:
            found = self._receive_fast(queue, top, handle)
            if found:
                return found
        # RECEIVEs re-read a queue's settings at most every QUEUE_RECHECK seconds per broker
        # (a queue turned off elsewhere is noticed that soon, here at once: catalog
        # changes clear the cache), so an empty look costs one statement, not two.
        now = time.monotonic()
        cached = self._broker._waited_queues.get(queue)
        if cached is None or now - cached[0] > QUEUE_RECHECK:
            cached = self._broker._waited_queues[queue] = (now, self._queue(queue))
        info = cached[1]
        if not info.is_receive_enabled:
            raise info.disabled_error()
        fast_ran = self._store.has("receive_fast") and group_id is None
        if (
            fast_ran
            and not info.is_retention_enabled
            and (handle is not None or info.receive_aging_seconds is None)
        ):
            return []  # the one-statement RECEIVE covers this queue: nothing is there
        take = "receive_take_conversation"
        if info.is_retention_enabled:
            take += "_retained"
        if handle is not None:
            locked = self._scalar("receive_lock_conversation", queue=queue, handle=handle)
            if locked is None:
                return []
            conversations = [handle]
        else:
            if group_id is not None:
                locked = self._scalar("receive_lock_group", queue=queue, group_id=group_id)
            else:
                locked = self._pick_group(info)
            if locked is None:
                return []
            conversations = _arrival_order(
                self._all("receive_group_firsts", group_id=locked, top=top)
            )
        messages: list[Message] = []
        for conversation in conversations:
            rows = self._all(take, handle=conversation, top=top - len(messages))
            messages.extend(sorted(map(Message.from_row, rows), key=_sequence))
            if len(messages) >= top:
                break
        self._wrote = True
        if messages:
            self._add_count(counters.RECEIVED, queue, n=len(messages))
            self._receipts.add(queue)
            # Inside this transaction: only a commit ends the queue's run of rollbacks.
            self._execute("queue_reset_rollbacks", name=queue)
        return messages

    def _pick_group(self, queue: QueueInfo, query: str = "receive_pick_group") -> str | None:
        """Lock the group to serve next: with aging on, the group of the oldest message
        that waited past the bound, whatever its level; otherwise (or if none has) the
        group of the highest-level message, oldest first."""
        if queue.receive_aging_seconds is not None:
            cutoff = time.time() - queue.receive_aging_seconds
            aged = self._scalar("receive_pick_aged", queue=queue.name, cutoff=cutoff)
            if aged is not None:
                return str(aged)
        picked = self._scalar(query, queue=queue.name)
        return None if picked is None else str(picked)

    def _receive_fast(self, queue: str, top: int, handle: str | None = None) -> list[Message]:
        """RECEIVE (of one conversation, with ``handle``) in one statement where the
        dialect has one; ``[]`` also when the queue needs the checked path (unknown,
        disabled, retention)."""
        query = "receive_fast" if handle is None else "receive_fast_conversation"
        if not self._store.has(query):
            return []
        params: dict[str, Any] = {"queue": queue, "top": top}
        if handle is not None:
            params["handle"] = handle
        rows = self._store.rows(self._conn(), query, **params)
        if not rows:
            return []
        self._wrote = True
        self._receipts.add(queue)  # the statement reset the rollback count itself
        self._add_count(counters.RECEIVED, queue, n=len(rows))
        # The statement returns them in RECEIVE's order.
        return [Message.from_row(dict(zip(MESSAGE_COLUMNS, r, strict=True))) for r in rows]

    def _get_group_once(self, queue: str) -> uuid.UUID | None:
        info = self._queue(queue)
        if not info.is_receive_enabled:
            raise info.disabled_error()
        group_id = self._pick_group(info, query="get_group_pick")
        if group_id is None:
            return None
        self._wrote = True  # the group stays locked until the transaction ends
        return uuid.UUID(group_id)

    def _wait_for(
        self,
        queue: str,
        timeout: float | None,
        attempt: Callable[[], T],
        empty: T,
        *,
        unfiltered: bool = True,
        looked: tuple[int, Callable[[], T]] | None = None,
    ) -> T:
        """Run ``attempt`` until it finds something or ``timeout`` passes (WAITFOR).

        :param looked: the caller has just looked (one statement) and found nothing: the
            wakeup generation it read before that look, and the rest of a first attempt
            after it — so an empty RECEIVE costs one look, not two
        """
        broker = self._broker
        deadline = None if timeout is None else time.monotonic() + timeout
        waiter_registered = False
        try:
            while True:
                noted = None
                if looked is not None:
                    (seen, rest), looked = looked, None
                    found = rest()
                else:
                    seen = broker._wakeups.generation(queue)
                    if unfiltered and not self._in_gate:
                        noted = broker._note_blocked_receiver(queue)
                    found = attempt()
                if found:
                    group = _group_of(found)
                    # SQLite: a receiver that queued for the write lock and then got the
                    # group the previous holder just let go of was waiting for that group
                    # (PostgreSQL's second reader would have found it locked, and empty):
                    # its note stands. One that got another group was a busy reader.
                    if noted is not None and broker._last_group_received.get(queue) != group:
                        broker._unnote_blocked_receiver(queue, noted)
                    if group is not None:
                        broker._last_group_received[queue] = group
                    self._received_queues.add(queue)
                    return found
                self._release_while_idle()
                if unfiltered and not self._wrote:
                    # Queue monitors read this as "a reader is here, waiting for work".
                    broker._record_empty_receive(queue)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return empty
                broker._watch_sqlite()
                if broker._listener is not None and not waiter_registered:
                    waiter_registered = True
                    if broker._set_waiting(queue, +1):
                        # Senders NOTIFY only while somebody is registered: look once more
                        # after registering, so a message sent meanwhile is not missed.
                        continue
                poll = (
                    wakeup.POSTGRESQL_POLL_INTERVAL
                    if broker._listener is not None
                    else wakeup.SQLITE_POLL_INTERVAL
                )
                broker._wakeups.wait(
                    queue, seen, poll if remaining is None else min(poll, remaining)
                )
        finally:
            if waiter_registered:
                broker._set_waiting(queue, -1)

    # --- timers ----------------------------------------------------------------------

    def _fire_due_timers(self, now: float, limit: int = 100) -> int:
        """Put ``DialogTimer`` and lifetime ``Error`` messages on their queues."""
        fired = 0
        for row in self._all("timers_due", now=now, limit=limit):
            self._execute("timer_clear", handle=row["conversation_handle"])
            self._enqueue(
                row, row["conversation_handle"], DIALOG_TIMER_SEQUENCE, DIALOG_TIMER, None
            )
            fired += 1
        for row in self._all("lifetimes_due", now=now, limit=limit):
            if row["state"] == EndpointState.DISCONNECTED_OUTBOUND.value:
                # This side already ended: the lifetime bounds its wait for the far side's
                # END. It closes; nobody is told (its application has left the conversation).
                if self._one("group_try_lock", group_id=row["conversation_group_id"]) is None:
                    retry_at = now + LIFETIME_RETRY
                    self._execute(
                        "lifetime_retry", handle=row["conversation_handle"], retry_at=retry_at
                    )
                    self._deadline(retry_at)
                    self._wrote = True
                    continue
                self._close(ConversationEndpoint.from_row(row))
                fired += 1
                continue
            self._execute("lifetime_expire", handle=row["conversation_handle"])
            body = json.dumps(
                {
                    "code": LIFETIME_EXPIRED_CODE,
                    "description": "The dialog has exceeded its lifetime.",
                }
            ).encode()
            self._enqueue(row, row["conversation_handle"], ERROR_SEQUENCE, ERROR, body)
            fired += 1
        self._wrote = self._wrote or fired > 0
        return fired


def _arrival_order(firsts: list[Row]) -> list[str]:
    """RECEIVE's order of a group's conversations, from ``receive_group_firsts`` (rows by
    level, then arrival): each conversation where its oldest ready message first appears —
    by level, then by that message's arrival, never by the handle's text."""
    return list(dict.fromkeys(str(row["conversation_handle"]) for row in firsts))


def _sequence(message: Message) -> int:
    """A conversation's order (DELETE ... RETURNING promises no order of its own)."""
    return message.message_sequence_number


def _group_of(found: object) -> str | None:
    """The conversation group a RECEIVE (its messages) or GET CONVERSATION GROUP got."""
    if isinstance(found, uuid.UUID):
        return str(found)
    if isinstance(found, list) and found and isinstance(found[0], Message):
        return str(found[0].conversation_group_id)
    return None
