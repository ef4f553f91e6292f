"""SEND: the one-statement paths where the dialect has them, the checked path that names
what is wrong (and makes the target endpoint with the first message), SEND to a service on
another broker, and putting a local message on its queue."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from scheduler_lib.broker import counters, exceptions, models
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.db import session as sessions
from scheduler_lib.broker.db import store
from scheduler_lib.broker.ops import endpoints

Before = tuple[str, Mapping[str, Any]]  # a named statement and its binds


@dataclasses.dataclass
class SendAfter:
    """A layer's named statement (an ``UPDATE``) to ride at the end of a SEND's one
    statement, written only with the message (``Store.riding``), and the rows it changed
    once it rode: ``None`` while it did not run (it could not ride: run it yourself)."""

    query: str
    binds: Mapping[str, Any]
    rows: int | None = None


# Conversations a process remembers as begun and not sent on (``Shared.unsent``): past
# this many (a program that begins dialogs and never sends) it forgets them, and their
# first SEND takes the checked path, as one begun by another process does.
UNSENT_LIMIT = 10_000


def note_unsent(session: sessions.Session, handle: str) -> None:
    """A conversation begun in this session whose target is on this broker: its first
    SEND may make the target endpoint in the SEND's round trip (:func:`fast`)."""
    if session.store.features.one_statement_send:
        unsent = session.shared.unsent
        if len(unsent) >= UNSENT_LIMIT:
            unsent.clear()
        unsent.add(handle)


def known_validation(session: sessions.Session, message_type: str) -> models.Validation | None:
    """The type's validation as this process knows it, for a one-statement SEND (which
    checks it again); ``None``: take the checked path. A process's first SEND of a type
    reads every type's validation (one statement) rather than going the checked way."""
    if not session.store.features.one_statement_send:
        return None
    cache = session.shared.validation_cache
    if message_type not in cache:
        cache.update(
            (r["message_type_name"], models.Validation(r["validation"]))
            for r in session.all("message_type_list")
        )
    return cache.get(message_type)


def _making_target(
    session: sessions.Session, send: Mapping[str, Any]
) -> list[tuple[str, Mapping[str, Any]]]:
    """``target_create_fast`` to run ahead of the SEND ``send`` (its binds) in its round
    trip, when this is the first SEND of a conversation begun here: the target endpoint
    comes into being with the first message, as the checked path makes it, and the SEND
    is one statement already. Not in autocommit, where the endpoint would commit without
    the message; nothing when the conversation sent before."""
    if session.autocommit:
        return []
    # Tried once (by one thread: a set's remove is atomic): should this transaction roll
    # back, the next SEND goes the checked way.
    try:
        session.shared.unsent.remove(send["handle"])
    except KeyError:
        return []
    binds = {
        "handle": send["handle"],
        "message_type": send["message_type"],
        "validation": send["validation"],
        "group_id": str(uuid.uuid4()),
        "target_handle": str(uuid.uuid4()),
        "now": send["now"],
    }
    return [("target_create_fast", binds)]


def _last_rows(session: sessions.Session, statements: list[Before]) -> list[tuple[Any, ...]]:
    """The last statement's rows: one statement alone, several in one round trip (a
    pipeline, in the session's transaction)."""
    if len(statements) == 1:
        [(query, binds)] = statements
        return session.rows(query, **binds)
    return session.pipeline(statements)[-1]


def send(session: sessions.Session, handle: str, message_type: str, data: bytes | None) -> int:
    """SEND inside the session's transaction: in one statement where it can, else the
    checked way. Its sequence number."""
    seq, _ = fast(session, handle, message_type, data)
    return seq if seq is not None else checked(session, handle, message_type, data)


def fast(
    session: sessions.Session,
    handle: str,
    message_type: str,
    data: bytes | None,
    lease_id: str | None = None,
    before: Before | None = None,
    after: SendAfter | None = None,
) -> tuple[int | None, bool]:
    """SEND in one statement where the dialect has one and the message type's
    validation is known: its sequence number, or ``None`` for "use :func:`checked`" (the
    SEND wrote nothing) — and whether ``before`` ran: inside the SEND's statement where it
    can ride there (``Store.riding``: then only with the message), else in the same round
    trip, ahead of it (not in autocommit). With ``lease_id`` the SEND also ends that lease.
    ``after`` rides there too, in autocommit, with ``before`` riding (``after.rows`` set),
    or does not run.

    :raises LeaseLost: when the lease was gone (the transaction must roll back)
    """
    cached = known_validation(session, message_type)
    if cached is None:
        return None, False
    if not passes(message_type, cached, [data]):
        return None, False
    send = {
        "handle": handle,
        "message_type": message_type,
        "validation": cached.value,
        "body": data,
        "now": time.time(),
        "lease_id": lease_id,
    }
    making = _making_target(session, send)
    if after is not None and not session.autocommit:
        after = None  # (in a transaction the caller runs it in its own round trip)
    riding = None
    if before is not None:
        riding = session.store.riding(
            "send_fast", before[0], None if after is None else after.query
        )
        if riding is None and after is not None:  # it cannot ride: ``before`` alone
            after = None
            riding = session.store.riding("send_fast", before[0])
    if riding is not None:
        assert before is not None
        # One statement: ``before`` writes only with the message (none back: neither ran)
        binds = {**send, **store.before_binds(before[1])}
        if after is not None:
            binds.update(store.after_binds(after.binds))
        rows = _last_rows(session, [*making, (riding, binds)])
        if not rows:
            return None, False
        if after is not None:
            after.rows = int(rows[0][-1])
    elif before is not None and session.autocommit:
        return None, False  # a pipeline would commit ``before`` without the message
    else:
        ahead = [] if before is None else [before]
        rows = _last_rows(session, [*ahead, *making, ("send_fast", send)])
    if not rows:
        return None, before is not None
    seq, queue, _notified, completed = rows[0][:4]
    session.mark_written()
    if lease_id is not None and not completed:
        raise exceptions.LeaseLost(
            f"lease {lease_id} on conversation {handle} is gone: it expired (the "
            "message went back to its queue or to its poison disposition) or already "
            "ended; roll back the answer"
        )
    # The statement already sent NOTIFY if, and only if, somebody waits.
    session.notified(queue)
    session.touched(queue)
    session.tally(counters.SENT, queue)
    return int(seq), before is not None


def many_fast(
    session: sessions.Session,
    handle: str,
    message_type: str,
    data: list[bytes | None],
    before: Before | None = None,
) -> tuple[int | None, bool]:
    """Several SENDs in one statement where the dialect has one and the message type's
    validation is known: the first sequence number, or ``None`` ("send them one by one
    on the checked path") — and whether ``before`` ran, in the same round trip, ahead of
    the SEND."""
    cached = known_validation(session, message_type)
    if cached is None:
        return None, False
    if not passes(message_type, cached, data):
        return None, False
    send = {
        "handle": handle,
        "message_type": message_type,
        "validation": cached.value,
        "bodies": data,
        "n": len(data),
        "now": time.time(),
    }
    ahead = [] if before is None else [before]
    rows = _last_rows(session, [*ahead, *_making_target(session, send), ("send_many_fast", send)])
    if not rows:
        return None, before is not None
    first, queue, _notified = rows[0]
    session.mark_written()
    session.notified(queue)
    session.touched(queue)
    session.tally(counters.SENT, queue, n=len(data))
    return int(first), before is not None


def checked(session: sessions.Session, handle: str, message_type: str, data: bytes | None) -> int:
    """SEND with every check spelled out: the path that names what is wrong, creates
    the target endpoint with the first message, and holds messages for a disabled
    queue. PostgreSQL's one-statement fast path falls back to it."""
    session.shared.unsent.discard(handle)  # its target endpoint is made here, if at all
    near = endpoints.endpoint(session, handle)
    mt = session.one("message_type_get", name=message_type)
    if mt is None:
        raise exceptions.MessageTypeNotFound(f"message type {message_type!r} does not exist")
    validation = models.Validation(mt["validation"])
    session.shared.validation_cache[message_type] = validation
    allowed = {
        r["message_type_name"]: models.SentBy(r["sent_by"])
        for r in session.all("contract_message_types", name=near.contract_name)
    }
    side = models.SentBy.INITIATOR if near.is_initiator else models.SentBy.TARGET
    if message_type not in allowed:
        raise exceptions.ContractViolation(
            f"message type {message_type!r} is not part of contract {near.contract_name!r}"
        )
    if allowed[message_type] not in (side, models.SentBy.ANY):
        raise exceptions.ContractViolation(
            f"contract {near.contract_name!r} lets only the {allowed[message_type].value} "
            f"send {message_type!r}; this endpoint is the {side.value}"
        )
    if near.state.value not in endpoints.SENDABLE_STATES:
        raise endpoints.state_error(near, "send on")
    checks.check_body(message_type, validation, data)
    if near.is_remote:
        return remote(session, near, message_type, data)
    far = endpoints.far(session, near, create=True)
    if far.state.value not in endpoints.SENDABLE_STATES:
        # The far side ended or failed; its EndDialog/Error is on our queue already.
        raise endpoints.state_error(far, "send to the far side of")
    target = endpoints.queue(session, far.queue_name)
    taken = session.one(
        "endpoint_take_send_sequence",
        handle=handle,
        quantum=target.fair_share_quantum,
        now=time.time(),
    )
    if taken is None:  # the state changed since we read it
        raise endpoints.state_error(endpoints.endpoint(session, handle), "send on")
    seq = int(taken["message_sequence_number"])
    enqueue_at(session, far, seq, message_type, data, fair_at=float(taken["fair_at"]))
    retain_sent(session, handle, seq, message_type, data)
    return seq


def remote(
    session: sessions.Session,
    near: models.ConversationEndpoint,
    message_type: str,
    data: bytes | None,
) -> int:
    """SEND to a service on another broker: the message waits in the transmission
    queue until that broker acknowledges it (the transport sends it)."""
    handle = str(near.conversation_handle)
    taken = session.one("endpoint_take_send_sequence", handle=handle, quantum=None, now=time.time())
    if taken is None:  # the state changed since we read it
        raise endpoints.state_error(endpoints.endpoint(session, handle), "send on")
    seq = int(taken["message_sequence_number"])
    transmit(session, near, seq, message_type, data)
    retain_sent(session, handle, seq, message_type, data)
    return seq


def remote_many(
    session: sessions.Session, handle: str, message_type: str, data: list[bytes | None]
) -> list[int]:
    """The rest of a ``send_many`` to another broker, after its first message went
    the checked way (so the contract, direction and state are known to be fine)."""
    validation = session.shared.validation_cache[message_type]
    for body in data:
        checks.check_body(message_type, validation, body)
    near = endpoints.endpoint(session, handle)
    first = session.scalar("endpoint_take_send_sequences", handle=handle, n=len(data))
    if first is None:
        raise endpoints.state_error(near, "send on")
    now = time.time()
    common = outgoing_row(near, message_type, now)
    session.execute_many(
        "outgoing_insert",
        [{**common, "seq": int(first) + i, "body": body} for i, body in enumerate(data)],
    )
    if endpoints.queue(session, near.queue_name).is_retention_enabled:
        session.execute_many(
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
    session.mark_written()
    session.transmitted()
    session.tally(counters.SENT, counters.TRANSMISSION, n=len(data))
    return list(range(int(first), int(first) + len(data)))


def retain_sent(
    session: sessions.Session, handle: str, seq: int, message_type: str, body: bytes | None
) -> None:
    """RETENTION on the sender's queue: a copy of what this endpoint sent stays there
    (status 3) until the conversation ends. One statement, which writes nothing when
    the sender's queue keeps nothing. (PostgreSQL's one-statement SEND leaves such
    senders to the checked path, which calls this.)"""
    session.execute(
        "message_retain_sent",
        handle=handle,
        seq=seq,
        message_type=message_type,
        body=body,
        now=time.time(),
    )


def outgoing_row(
    near: models.ConversationEndpoint, message_type: str, now: float
) -> dict[str, Any]:
    """The binds of ``outgoing_insert`` that come from the sending endpoint."""
    return {
        "handle": str(near.conversation_handle),
        "conversation_id": str(near.conversation_id),
        "is_initiator": near.is_initiator,
        "from_service": near.service_name,
        "to_service": near.far_service_name,
        "contract": near.contract_name,
        "message_type": message_type,
        "priority": near.priority,
        "lifetime_expires_at": near.lifetime_expires_at,
        "group_id": str(near.conversation_group_id),
        "now": now,
    }


def transmit(
    session: sessions.Session,
    near: models.ConversationEndpoint,
    seq: int,
    message_type: str,
    body: bytes | None,
) -> None:
    """Put message ``seq`` of ``near`` in the transmission queue for its far broker;
    the transport is woken at commit."""
    row = outgoing_row(near, message_type, time.time())
    session.execute("outgoing_insert", seq=seq, body=body, **row)
    session.mark_written()
    session.transmitted()
    session.tally(counters.SENT, counters.TRANSMISSION)


def end_remote(
    session: sessions.Session,
    near: models.ConversationEndpoint,
    error: int | None,
    description: str | None,
) -> None:
    """END CONVERSATION of a conversation whose far side is on another broker: the
    ``EndDialog`` (or ``Error``) travels as the conversation's next message."""
    handle = str(near.conversation_handle)
    if near.is_initiator and near.send_sequence == 0:
        endpoints.close(session, near)  # nothing was ever sent: the far side never knew of it
        return
    session.execute("messages_delete_conversation", handle=handle)
    session.execute("transmission_delete_held", handle=handle)
    seq = int(session.scalar("endpoint_take_system_sequence", handle=handle))
    if near.state in (models.EndpointState.DISCONNECTED_INBOUND, models.EndpointState.ERROR):
        # The far side ended (or this side failed): the last to leave closes, and tells
        # the far side, which waits in DISCONNECTED_OUTBOUND for this.
        endpoints.close(session, near)
        transmit(session, near, seq, models.END_DIALOG, None)
        return
    if error is None:
        transmit(session, near, seq, models.END_DIALOG, None)
    else:
        body = json.dumps({"code": error, "description": description}).encode()
        transmit(session, near, seq, models.ERROR, body)
    session.execute(
        "endpoint_set_state", handle=handle, state=models.EndpointState.DISCONNECTED_OUTBOUND.value
    )


def enqueue_at(
    session: sessions.Session,
    to: models.ConversationEndpoint,
    seq: int,
    message_type: str,
    body: bytes | None,
    *,
    fair_at: float = 0.0,
) -> None:
    """A local message to endpoint ``to``: the sender's row lock already ordered it."""
    row = {
        "queue_name": to.queue_name,
        "conversation_group_id": str(to.conversation_group_id),
        "priority": to.priority,
        "service_name": to.service_name,
        "contract_name": to.contract_name,
    }
    enqueue(session, row, str(to.conversation_handle), seq, message_type, body, fair_at=fair_at)


def enqueue(
    session: sessions.Session,
    to: store.Row,
    handle: str,
    seq: int,
    message_type: str,
    body: bytes | None,
    *,
    fair_at: float = 0.0,
) -> None:
    """Put a message on the queue of endpoint row ``to``, or hold it while that queue is
    off. ``fair_at`` is its fair-share stamp (0: served in arrival order, ahead of
    stamped messages of its level — system messages and messages put back)."""
    session.mark_written()
    cache = session.queue_cache
    if cache is None:
        queue = endpoints.queue(session, to["queue_name"])
    else:  # the transport's batch: one read per queue and transaction
        queue = cache.get(to["queue_name"]) or cache.setdefault(
            to["queue_name"], endpoints.queue(session, to["queue_name"])
        )
    params = {
        "queue": queue.name,
        "group_id": to["conversation_group_id"],
        "handle": handle,
        "seq": seq,
        "message_type": message_type,
        "body": body,
        "priority": to["priority"],
        "service": to["service_name"],
        "contract": to["contract_name"],
        "now": time.time(),
        "fair_at": fair_at,
    }
    session.tally(counters.SENT, queue.name)
    if queue.is_receive_enabled:
        session.execute("message_insert", **params)
        session.touched(queue.name)
    else:
        session.execute(
            "transmission_insert",
            transmission_status=f"target queue {queue.name!r} is disabled",
            **params,
        )


def passes(
    message_type: str, validation: models.Validation, bodies: Sequence[bytes | None]
) -> bool:
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
