"""A broker transaction: every operation inside it commits or rolls back together."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

import sqlalchemy as sa

from scheduler_lib.broker import counters, exceptions, wakeup
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.catalog import CatalogOperations
from scheduler_lib.broker.conversations import (
    SENDABLE_STATES,
    ConversationOperations,
    state_error,
)
from scheduler_lib.broker.leases import LeaseOperations
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
from scheduler_lib.broker.session import Session
from scheduler_lib.broker.store import Row

if TYPE_CHECKING:
    from scheduler_lib.broker.broker import Broker

T = TypeVar("T")

LIFETIME_EXPIRED_CODE = -8489  # SQL Server's code for "the dialog has exceeded its LIFETIME"
QUEUE_RECHECK = 1.0  # seconds a waiting RECEIVE trusts the queue's settings
LIFETIME_RETRY = 1.0  # seconds before expiry looks again at an ended endpoint whose group is held


class Transaction(
    CatalogOperations, ConversationOperations, LeaseOperations, PoisonOperations, RouteOperations
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
        self._store = broker._store
        #: the connection and what this transaction's operations did (the broker's own
        #: operations use it; a layer above uses the named-query methods below)
        self.session = Session(broker, autocommit=autocommit, engine=engine)

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

    def fetch(self, query: str, /, **params: Any) -> list[Row]:
        """Every row of a named query, as mappings."""
        return self.session.all(query, **params)

    def fetch_one(self, query: str, /, **params: Any) -> Row | None:
        """The first row of a named query, or ``None``."""
        return self.session.one(query, **params)

    def fetch_value(self, query: str, /, **params: Any) -> Any:
        """The first column of the first row of a named query, or ``None``."""
        return self.session.scalar(query, **params)

    # --- lookups that raise the right NotFound ---------------------------------------

    def _queue(self, name: str) -> QueueInfo:
        row = self.session.one("queue_get", name=name)
        if row is None:
            raise exceptions.QueueNotFound(f"queue {name!r} does not exist")
        return QueueInfo.from_row(row)

    def _service(self, name: str) -> Row:
        row = self.session.one("service_get", name=name)
        if row is None:
            raise exceptions.ServiceNotFound(f"service {name!r} does not exist")
        return row

    def _endpoint(self, handle: str) -> ConversationEndpoint:
        row = self.session.one("endpoint_get", handle=handle)
        if row is None:
            raise exceptions.ConversationNotFound(
                f"conversation handle {handle} does not exist (never began, or already closed)"
            )
        return ConversationEndpoint.from_row(row)

    @overload
    def _far_endpoint(
        self, endpoint: ConversationEndpoint, *, create: Literal[True]
    ) -> ConversationEndpoint: ...

    @overload
    def _far_endpoint(
        self, endpoint: ConversationEndpoint, *, create: bool
    ) -> ConversationEndpoint | None: ...

    def _far_endpoint(
        self, endpoint: ConversationEndpoint, *, create: bool
    ) -> ConversationEndpoint | None:
        """The other side's endpoint; with ``create`` (a SEND), the target's made with the
        conversation's first message.

        :raises ConversationStateError: with ``create``, when the other side existed and
            was removed WITH CLEANUP (never brought back)
        """
        row = self.session.one(
            "endpoint_far",
            conversation_id=str(endpoint.conversation_id),
            is_initiator=endpoint.is_initiator,
        )
        if row is not None:
            return ConversationEndpoint.from_row(row)
        if not create:
            return None
        if not endpoint.is_initiator or endpoint.send_sequence > 0:
            # The other side existed and was removed WITH CLEANUP: never bring it back.
            side = "target" if endpoint.is_initiator else "initiator"
            raise exceptions.ConversationStateError(
                f"cannot send on conversation {endpoint.conversation_handle}: the {side} "
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
        self.session.execute("group_insert", group_id=group_id, queue=target["queue_name"], now=now)
        self.session.execute(
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
        self.session.mark_written()
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
        if cached is None or not self._store.features.one_statement_send:
            return None, False
        if not _passes(message_type, cached, [data]):
            return None, False
        send = {
            "handle": handle,
            "message_type": message_type,
            "validation": cached.value,
            "body": data,
            "now": time.time(),
            "lease_id": lease_id,
        }
        if before is not None:
            _, rows = self.session.pipeline([before, ("send_fast", send)])
        else:
            rows = self.session.rows("send_fast", **send)
        if not rows:
            return None, before is not None
        seq, queue, _notified, completed = rows[0]
        self.session.mark_written()
        if lease_id is not None and not completed:
            raise exceptions.LeaseLost(
                f"lease {lease_id} on conversation {handle} is gone: it expired (the "
                "message went back to its queue or to its poison disposition) or already "
                "ended; roll back the answer"
            )
        # The statement already sent NOTIFY if, and only if, somebody waits.
        self.session.notified(queue)
        self.session.touched(queue)
        self.session.tally(counters.SENT, queue)
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
        if cached is None or not self._store.features.one_statement_send:
            return None, False
        if not _passes(message_type, cached, data):
            return None, False
        send = {
            "handle": handle,
            "message_type": message_type,
            "validation": cached.value,
            "bodies": data,
            "n": len(data),
            "now": time.time(),
        }
        if before is not None:
            _, rows = self.session.pipeline([before, ("send_many_fast", send)])
        else:
            rows = self.session.rows("send_many_fast", **send)
        if not rows:
            return None, before is not None
        first, queue, _notified = rows[0]
        self.session.mark_written()
        self.session.notified(queue)
        self.session.touched(queue)
        self.session.tally(counters.SENT, queue, n=len(data))
        return int(first), before is not None

    def _send_checked(self, handle: str, message_type: str, data: bytes | None) -> int:
        """SEND with every check spelled out: the path that names what is wrong, creates
        the target endpoint with the first message, and holds messages for a disabled
        queue. PostgreSQL's one-statement fast path falls back to it."""
        endpoint = self._endpoint(handle)
        mt = self.session.one("message_type_get", name=message_type)
        if mt is None:
            raise exceptions.MessageTypeNotFound(f"message type {message_type!r} does not exist")
        validation = Validation(mt["validation"])
        self._broker._validation_cache[message_type] = validation
        allowed = {
            r["message_type_name"]: SentBy(r["sent_by"])
            for r in self.session.all("contract_message_types", name=endpoint.contract_name)
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
        if far.state.value not in SENDABLE_STATES:
            # The far side ended or failed; its EndDialog/Error is on our queue already.
            raise state_error(far, "send to the far side of")
        target = self._queue(far.queue_name)
        taken = self.session.one(
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
        taken = self.session.one(
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
        first = self.session.scalar("endpoint_take_send_sequences", handle=handle, n=len(data))
        if first is None:
            raise state_error(endpoint, "send on")
        now = time.time()
        common = self._outgoing_row(endpoint, message_type, now)
        self.session.execute_many(
            "outgoing_insert",
            [{**common, "seq": int(first) + i, "body": body} for i, body in enumerate(data)],
        )
        if self._queue(endpoint.queue_name).is_retention_enabled:
            self.session.execute_many(
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
        self.session.mark_written()
        self.session.transmitted()
        self.session.tally(counters.SENT, counters.TRANSMISSION, n=len(data))
        return list(range(int(first), int(first) + len(data)))

    def _retain_sent(self, handle: str, seq: int, message_type: str, body: bytes | None) -> None:
        """RETENTION on the sender's queue: a copy of what this endpoint sent stays there
        (status 3) until the conversation ends. One statement, which writes nothing when
        the sender's queue keeps nothing. (PostgreSQL's one-statement SEND leaves such
        senders to the checked path, which calls this.)"""
        self.session.execute(
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
        self.session.execute("outgoing_insert", seq=seq, body=body, **row)
        self.session.mark_written()
        self.session.transmitted()
        self.session.tally(counters.SENT, counters.TRANSMISSION)

    def _end_remote(
        self, endpoint: ConversationEndpoint, error: int | None, description: str | None
    ) -> None:
        """END CONVERSATION of a conversation whose far side is on another broker: the
        ``EndDialog`` (or ``Error``) travels as the conversation's next message."""
        handle = str(endpoint.conversation_handle)
        if endpoint.is_initiator and endpoint.send_sequence == 0:
            self._close(endpoint)  # nothing was ever sent: the far side never knew of it
            return
        self.session.execute("messages_delete_conversation", handle=handle)
        self.session.execute("transmission_delete_held", handle=handle)
        seq = int(self.session.scalar("endpoint_take_system_sequence", handle=handle))
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
        self.session.execute(
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
        self.session.mark_written()
        if self.session.queue_cache is None:
            queue = self._queue(endpoint["queue_name"])
        else:  # the transport's batch: one read per queue and transaction
            queue = self.session.queue_cache.get(
                endpoint["queue_name"]
            ) or self.session.queue_cache.setdefault(
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
        self.session.tally(counters.SENT, queue.name)
        if queue.is_receive_enabled:
            self.session.execute("message_insert", **params)
            self.session.touched(queue.name)
        else:
            self.session.execute(
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
        self.session.execute("messages_delete_conversation", handle=handle)
        if endpoint.is_remote and not cleanup:
            self.session.execute("transmission_delete_held", handle=handle)
        else:
            self.session.execute("transmission_delete_conversation", handle=handle)
        self.session.execute("leases_delete_conversation", handle=handle)
        self.session.execute("poison_history_delete_conversation", handle=handle)
        self.session.mark_written()
        if endpoint.is_remote:
            self.session.execute(
                "fragments_delete_conversation",
                conversation_id=str(endpoint.conversation_id),
                is_initiator=not endpoint.is_initiator,
            )
            self.session.execute("endpoint_tombstone", handle=handle, now=time.time())
            return
        self.session.execute("endpoint_delete", handle=handle)
        self.session.execute("group_delete_if_empty", group_id=str(endpoint.conversation_group_id))

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
        fast_ran = self._store.features.one_statement_receive and group_id is None
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
            locked = self.session.scalar("receive_lock_conversation", queue=queue, handle=handle)
            if locked is None:
                return []
            conversations = [handle]
        else:
            if group_id is not None:
                locked = self.session.scalar("receive_lock_group", queue=queue, group_id=group_id)
            else:
                locked = self._pick_group(info)
            if locked is None:
                return []
            conversations = _arrival_order(
                self.session.all("receive_group_firsts", group_id=locked, top=top)
            )
        messages: list[Message] = []
        for conversation in conversations:
            rows = self.session.all(take, handle=conversation, top=top - len(messages))
            messages.extend(sorted(map(Message.from_row, rows), key=_sequence))
            if len(messages) >= top:
                break
        self.session.mark_written()
        if messages:
            self.session.tally(counters.RECEIVED, queue, n=len(messages))
            self.session.receipt(queue)
            # Inside this transaction: only a commit ends the queue's run of rollbacks.
            self.session.execute("queue_reset_rollbacks", name=queue)
        return messages

    def _pick_group(self, queue: QueueInfo, query: str = "receive_pick_group") -> str | None:
        """Lock the group to serve next: with aging on, the group of the oldest message
        that waited past the bound, whatever its level; otherwise (or if none has) the
        group of the highest-level message, oldest first."""
        if queue.receive_aging_seconds is not None:
            cutoff = time.time() - queue.receive_aging_seconds
            aged = self.session.scalar("receive_pick_aged", queue=queue.name, cutoff=cutoff)
            if aged is not None:
                return str(aged)
        picked = self.session.scalar(query, queue=queue.name)
        return None if picked is None else str(picked)

    def _receive_fast(self, queue: str, top: int, handle: str | None = None) -> list[Message]:
        """RECEIVE (of one conversation, with ``handle``) in one statement where the
        dialect has one; ``[]`` also when the queue needs the checked path (unknown,
        disabled, retention)."""
        query = "receive_fast" if handle is None else "receive_fast_conversation"
        if not self._store.features.one_statement_receive:
            return []
        params: dict[str, Any] = {"queue": queue, "top": top}
        if handle is not None:
            params["handle"] = handle
        rows = self.session.rows(query, **params)
        if not rows:
            return []
        self.session.mark_written()
        self.session.receipt(queue)  # the statement reset the rollback count itself
        self.session.tally(counters.RECEIVED, queue, n=len(rows))
        # The statement returns them in RECEIVE's order.
        return [Message.from_row(dict(zip(MESSAGE_COLUMNS, r, strict=True))) for r in rows]

    def _get_group_once(self, queue: str) -> uuid.UUID | None:
        info = self._queue(queue)
        if not info.is_receive_enabled:
            raise info.disabled_error()
        group_id = self._pick_group(info, query="get_group_pick")
        if group_id is None:
            return None
        self.session.mark_written()  # the group stays locked until the transaction ends
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
                    if unfiltered and not self.session.in_gate:
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
                    self.session.received_from(queue)
                    return found
                self.session.release_while_idle()
                if unfiltered and not self.session.wrote:
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
        for row in self.session.all("timers_due", now=now, limit=limit):
            self.session.execute("timer_clear", handle=row["conversation_handle"])
            self._enqueue(
                row, row["conversation_handle"], DIALOG_TIMER_SEQUENCE, DIALOG_TIMER, None
            )
            fired += 1
        for row in self.session.all("lifetimes_due", now=now, limit=limit):
            if row["state"] == EndpointState.DISCONNECTED_OUTBOUND.value:
                # This side already ended: the lifetime bounds its wait for the far side's
                # END. It closes; nobody is told (its application has left the conversation).
                if (
                    self.session.one("group_try_lock", group_id=row["conversation_group_id"])
                    is None
                ):
                    retry_at = now + LIFETIME_RETRY
                    self.session.execute(
                        "lifetime_retry", handle=row["conversation_handle"], retry_at=retry_at
                    )
                    self.session.deadline(retry_at)
                    self.session.mark_written()
                    continue
                self._close(ConversationEndpoint.from_row(row))
                fired += 1
                continue
            self.session.execute("lifetime_expire", handle=row["conversation_handle"])
            body = json.dumps(
                {
                    "code": LIFETIME_EXPIRED_CODE,
                    "description": "The dialog has exceeded its lifetime.",
                }
            ).encode()
            self._enqueue(row, row["conversation_handle"], ERROR_SEQUENCE, ERROR, body)
            fired += 1
        if fired > 0:
            self.session.mark_written()
        return fired


def _passes(message_type: str, validation: Validation, bodies: Sequence[bytes | None]) -> bool:
    """Whether every body passes ``validation`` as this process has it cached. A fast path
    that finds one failing takes the checked path instead, which says what is wrong in its
    own order (existence, contract, direction, state, then the body) and against the
    type's validation now: the cache may be behind an ALTER MESSAGE TYPE."""
    try:
        for body in bodies:
            checks.check_body(message_type, validation, body)
    except exceptions.InvalidMessageBody:
        return False
    return True


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
