"""Poison messages, as plain functions over a session: the policies and their
dispositions, the failure records, built-in detection (rollbacks counted per queue), the
routing of a message that failed too often, the poison-message log and the holding queue.
:mod:`scheduler_lib.broker.poison` is the public namespace of the policy types and holds
the seed's detector; the fronts' ``PoisonOperations`` documents each operation."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

from scheduler_lib.broker import counters, exceptions, models
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.db import session as sessions
from scheduler_lib.broker.ops import conversations, endpoints, events, sending

log = logging.getLogger("scheduler_lib.broker.poison")

ROLLBACK_LIMIT = 5  # built-in detection: this many consecutive rollbacks turn a queue off
DEFAULT_THRESHOLD = 5  # failures after which the detector routes a message
POISON_ERROR_CODE = 50001  # END CONVERSATION WITH ERROR code (user range, as in SQL Server)
ERROR_TEXT_LIMIT = 4000  # characters of an error kept per failure
# Endpoint states in which this side still reads its messages (not ended here, not failed).
REPLAYABLE_STATES = frozenset(
    {
        models.EndpointState.STARTED_OUTBOUND,
        models.EndpointState.STARTED_INBOUND,
        models.EndpointState.CONVERSING,
        models.EndpointState.DISCONNECTED_INBOUND,
    }
)


# --- dispositions ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Drop:
    """Consume the message and do nothing else (the seed's option 1: it is gone)."""

    kind: ClassVar[str] = "drop"


@dataclasses.dataclass(frozen=True)
class EndConversation:
    """End the message's conversation with an error: the partner gets an ``Error``
    message (the seed's option 2). Nothing waits forever."""

    code: int = POISON_ERROR_CODE
    description: str | None = None  # default: says which message failed how often and why
    kind: ClassVar[str] = "end_conversation"


@dataclasses.dataclass(frozen=True)
class Log:
    """Keep the message in ``poison_messages`` for an operator to replay or drop (the
    seed's option 3)."""

    kind: ClassVar[str] = "log"


@dataclasses.dataclass(frozen=True)
class Notify:
    """Tell somebody (the seed's option 4): post a ``POISON_MESSAGE`` event to the
    queue's subscribers and/or call ``callback(PoisonEvent)`` inside the transaction. A
    policy stored on a queue names its callback by dotted path."""

    event: bool = True
    callback: str | Callable[[PoisonEvent], None] | None = None
    kind: ClassVar[str] = "notify"


@dataclasses.dataclass(frozen=True)
class Park:
    """Move the message to the holding queue and redeliver it after ``delay`` seconds,
    at most ``max_cycles`` times (the seed's option 5); after that the policy's other
    dispositions apply (just :class:`Log` if it has none). Its failures are counted
    afresh after each return. While parked, later messages of its conversation are
    delivered: the poison message steps aside."""

    delay: float
    max_cycles: int = 3
    kind: ClassVar[str] = "park"


Disposition = Drop | EndConversation | Log | Notify | Park
_KINDS: dict[str, type[Any]] = {d.kind: d for d in (Drop, EndConversation, Log, Notify, Park)}


@dataclasses.dataclass(frozen=True)
class PoisonPolicy:
    """What happens to a message that keeps failing.

    :param threshold: failures after which the message is routed (on its next receive by
        a :class:`PoisonDetector`; at once when a lease fails)
    :param dispositions: what routing does; combinable, e.g. ``(Park(60), Log(),
        Notify())``. The default keeps the message (:class:`Log`) and tells the partner
        (:class:`EndConversation`)
    """

    threshold: int = DEFAULT_THRESHOLD
    dispositions: tuple[Disposition, ...] = (Log(), EndConversation())

    def __post_init__(self) -> None:
        if (
            isinstance(self.threshold, bool)
            or not isinstance(self.threshold, int)
            or self.threshold < 1
        ):
            raise exceptions.InvalidArgument(
                f"poison threshold must be an integer >= 1, got {self.threshold!r}"
            )
        dispositions = self.dispositions
        if not isinstance(dispositions, tuple | list) or not dispositions:
            raise exceptions.InvalidArgument(
                "a poison policy needs at least one disposition "
                "(Drop, EndConversation, Log, Notify, Park)"
            )
        object.__setattr__(self, "dispositions", tuple(dispositions))
        seen: set[str] = set()
        for d in self.dispositions:
            if not isinstance(d, Drop | EndConversation | Log | Notify | Park):
                raise exceptions.InvalidArgument(
                    f"unknown poison disposition {d!r}; use Drop, EndConversation, Log, "
                    "Notify or Park"
                )
            if d.kind in seen:
                raise exceptions.InvalidArgument(f"disposition {d.kind!r} is given twice")
            seen.add(d.kind)
            _check_disposition(d)

    def to_json(self) -> str:
        """The dispositions as stored on a queue (callables cannot be stored)."""
        items = []
        for d in self.dispositions:
            fields = {f.name: getattr(d, f.name) for f in dataclasses.fields(d)}
            if isinstance(d, Notify) and d.callback is not None and not isinstance(d.callback, str):
                raise exceptions.InvalidArgument(
                    "a poison policy stored on a queue names its Notify callback by dotted "
                    f"path (package.module.function), not {d.callback!r}"
                )
            items.append({"kind": d.kind, **fields})
        return json.dumps(items)

    @classmethod
    def from_stored(cls, threshold: int, dispositions: str) -> PoisonPolicy:
        items = json.loads(dispositions)
        return cls(
            threshold=int(threshold),
            dispositions=tuple(_KINDS[item.pop("kind")](**item) for item in items),
        )


def _check_disposition(d: Disposition) -> None:
    if isinstance(d, EndConversation):
        if isinstance(d.code, bool) or not isinstance(d.code, int) or d.code <= 0:
            raise exceptions.InvalidArgument(
                f"EndConversation code must be a positive integer, got {d.code!r}"
            )
        if d.description is not None and (not isinstance(d.description, str) or not d.description):
            raise exceptions.InvalidArgument("EndConversation description must be non-empty text")
    elif isinstance(d, Park):
        delay = checks.timeout(d.delay, "Park delay")
        if delay is None:
            raise exceptions.InvalidArgument("Park needs a delay in seconds")
        if isinstance(d.max_cycles, bool) or not isinstance(d.max_cycles, int) or d.max_cycles < 1:
            raise exceptions.InvalidArgument(
                f"Park max_cycles must be an integer >= 1, got {d.max_cycles!r}"
            )
    elif isinstance(d, Notify):
        if not d.event and d.callback is None:
            raise exceptions.InvalidArgument("Notify needs event=True and/or a callback")
        if d.callback is not None and not (callable(d.callback) or isinstance(d.callback, str)):
            raise exceptions.InvalidArgument(
                f"Notify callback must be a callable or a dotted path, got {d.callback!r}"
            )


# --- values handed out -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class History:
    """A message's failures since it last came back from the holding queue."""

    failures: int = 0
    cycles: int = 0  # times it was parked
    last_error: str | None = None
    incidents: int = 0  # rows in poison_message_details, parkings included


@dataclasses.dataclass(frozen=True)
class PoisonEvent:
    """What a :class:`Notify` callback is given. ``tx`` is the routing transaction (a
    :class:`~scheduler_lib.broker.transaction.Transaction`): the callback may send on it
    (e.g. a failure result to the caller)."""

    tx: Any
    message: models.Message
    failures: int
    cycles: int
    last_error: str | None
    poison_id: int | None  # the logged row, when the policy also logs


@dataclasses.dataclass(frozen=True)
class PoisonMessage:
    """A row of ``poison_messages``: a poison message LOGGED for an operator or PARKED in
    the holding queue."""

    poison_id: int
    state: str
    message: models.Message
    failures: int
    cycles: int
    last_error: str | None
    dispositions: str
    recorded_at: float
    redeliver_at: float | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> PoisonMessage:
        return cls(
            poison_id=int(row["poison_id"]),
            state=row["state"],
            message=message_of(row),
            failures=int(row["failures"]),
            cycles=int(row["cycles"]),
            last_error=row["last_error"],
            dispositions=row["dispositions"],
            recorded_at=float(row["recorded_at"]),
            redeliver_at=row["redeliver_at"],
        )


def worker_name() -> str:
    """Who is working: host, process and thread (our SPID)."""
    return f"{socket.gethostname()}:{os.getpid()}:{threading.current_thread().name}"


def message_of(row: Mapping[str, Any]) -> models.Message:
    return models.Message.from_row({**row, "status": row.get("status", models.MessageStatus.READY)})


def error_text(error: BaseException | str | None) -> str | None:
    if error is None:
        return None
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return text[:ERROR_TEXT_LIMIT]


def _ids(poison_ids: Iterable[int]) -> list[int]:
    ids = list(poison_ids)
    if not ids:
        raise exceptions.InvalidArgument("name at least one poison message id")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or i < 1:
            raise exceptions.InvalidArgument(f"poison message ids are positive integers, got {i!r}")
    return list(dict.fromkeys(ids))


# --- operations ------------------------------------------------------------------------


def set_poison_policy(session: sessions.Session, queue: str, policy: PoisonPolicy | None) -> None:
    """Store the queue's poison policy (``None``: back to the default); every process"""
    if policy is not None and not isinstance(policy, PoisonPolicy):
        raise exceptions.InvalidArgument(f"expected a PoisonPolicy or None, got {policy!r}")
    stored = None if policy is None else policy.to_json()
    for d in () if policy is None else policy.dispositions:
        if isinstance(d, Notify) and isinstance(d.callback, str):
            checks.resolve(d.callback, "Notify callback")  # fail now, not when routing
    endpoints.queue(session, queue)
    session.execute("poison_policy_delete", queue=queue)
    if policy is not None:
        session.execute(
            "poison_policy_insert",
            queue=queue,
            threshold=policy.threshold,
            dispositions=stored,
            now=time.time(),
        )


def poison_policy(session: sessions.Session, queue: str) -> PoisonPolicy:
    """The queue's poison policy (the default when none is stored)."""
    endpoints.queue(session, queue)
    return policy_for(session, queue)


def record_failure(
    session: sessions.Session,
    message: models.Message,
    error: BaseException | str | None = None,
    *,
    worker: str | None = None,
) -> History:
    """Record that handling ``message`` failed. Call it *after* the failed transaction"""
    _record(session, message, "FAILED", error_text(error), worker or worker_name())
    return history(session, message)


def failure_history(session: sessions.Session, message: models.Message) -> History:
    """How often ``message`` failed since it last came back from the holding queue."""
    return history(session, message)


def forget_failures(session: sessions.Session, message: models.Message) -> int:
    """Delete ``message``'s failure records (a hand-written loop calls it once the"""
    return session.count(
        "poison_history_delete",
        handle=str(message.conversation_handle),
        seq=message.message_sequence_number,
    )


def poison_incidents(
    session: sessions.Session, conversation_handle: uuid.UUID | str, message_sequence_number: int
) -> list[Mapping[str, Any]]:
    """Every failure and parking recorded for one message, oldest first."""
    handle = checks.handle(conversation_handle)
    return session.all("poison_history", handle=handle, seq=int(message_sequence_number))


def poison_messages(
    session: sessions.Session, queue: str | None = None, state: str | None = None
) -> list[PoisonMessage]:
    """Poison messages LOGGED for an operator or PARKED in the holding queue."""
    if state is not None and state.upper() not in ("LOGGED", "PARKED"):
        raise exceptions.InvalidArgument(f"state must be LOGGED or PARKED, got {state!r}")
    rows = session.all(
        "poison_message_list", queue=queue, state=None if state is None else state.upper()
    )
    return [PoisonMessage.from_row(r) for r in rows]


def poison_message(session: sessions.Session, poison_id: int) -> PoisonMessage:
    """One poison message."""
    (checked,) = _ids([poison_id])
    return PoisonMessage.from_row(_poison_row(session, checked))


def replay_poison_messages(session: sessions.Session, poison_ids: Iterable[int]) -> int:
    """Put exactly these poison messages back on their queues, on their conversations,"""
    ids = _ids(poison_ids)
    for poison_id in ids:
        row = _poison_row(session, poison_id)
        endpoint = session.one("endpoint_get", handle=row["conversation_handle"])
        if endpoint is None:
            raise exceptions.ConversationNotFound(
                f"poison message {poison_id}: its conversation "
                f"{row['conversation_handle']} has ended, so there is nobody to "
                "deliver it to; `scheduler-lib poison show` prints its body"
            )
        state = models.ConversationEndpoint.from_row(endpoint).state
        if state not in REPLAYABLE_STATES:
            raise exceptions.ConversationStateError(
                f"poison message {poison_id}: its conversation "
                f"{row['conversation_handle']} is {state.name} on this side, so "
                "nothing would read it; `scheduler-lib poison show` prints its body"
            )
        message = message_of(row)
        session.execute("poison_message_delete", poison_id=poison_id)
        session.execute(
            "poison_history_delete",
            handle=row["conversation_handle"],
            seq=row["message_sequence_number"],
        )
        requeue(session, message, models.ConversationEndpoint.from_row(endpoint))
    return len(ids)


def drop_poison_messages(session: sessions.Session, poison_ids: Iterable[int]) -> int:
    """Delete exactly these poison messages for good, with their failure records."""
    ids = _ids(poison_ids)
    for poison_id in ids:
        row = _poison_row(session, poison_id)
        session.execute("poison_message_delete", poison_id=poison_id)
        session.execute(
            "poison_history_delete",
            handle=row["conversation_handle"],
            seq=row["message_sequence_number"],
        )
    return len(ids)


def _poison_row(session: sessions.Session, poison_id: int) -> Mapping[str, Any]:
    row = session.one("poison_message_get", poison_id=poison_id)
    if row is None:
        raise exceptions.NotFound(f"poison message {poison_id} does not exist")
    return row


# --- the machinery, inside a transaction -------------------------------------------------


def policy_for(session: sessions.Session, queue: str) -> PoisonPolicy:
    """The queue's stored policy, else the default."""
    row = session.one("poison_policy_get", queue=queue)
    if row is None:
        return PoisonPolicy()
    return PoisonPolicy.from_stored(row["threshold"], row["dispositions"])


def history(session: sessions.Session, message: models.Message) -> History:
    rows = session.all(
        "poison_history",
        handle=str(message.conversation_handle),
        seq=message.message_sequence_number,
    )
    return summarize(rows)


def summarize(rows: Sequence[Mapping[str, Any]]) -> History:
    """A message's history from its rows of ``poison_message_details``."""
    failures = cycles = 0
    last_error = None
    for row in rows:
        if row["kind"] == "PARKED":
            cycles += 1
            failures, last_error = 0, None  # counted afresh after each return
        else:
            failures += 1
            last_error = row["error"] or last_error
    return History(failures, cycles, last_error, len(rows))


def _record(
    session: sessions.Session,
    message: models.Message,
    kind: str,
    error: str | None,
    worker: str | None,
) -> None:
    session.execute(
        "poison_incident_insert",
        queue=message.queue_name,
        handle=str(message.conversation_handle),
        seq=message.message_sequence_number,
        message_type=message.message_type_name,
        kind=kind,
        error=error,
        worker=worker,
        now=time.time(),
    )
    session.mark_written()


def count_rollbacks(session: sessions.Session, queues: Iterable[str]) -> list[str]:
    """Built-in detection: a transaction that received from ``queues`` rolled back.

    :return: the queues this turned off
    """
    disabled = []
    now = time.time()
    for queue in sorted(queues):
        count = session.scalar("queue_count_rollback", name=queue)
        session.mark_written()
        if count is None or int(count) < ROLLBACK_LIMIT:
            continue
        reason = (
            f"poison message handling: {int(count)} consecutive rollbacks of transactions "
            "that received from it"
        )
        if session.count("queue_disable", name=queue, reason=reason, now=now):
            try:
                with session.savepoint():  # the queue goes off even if a subscriber is broken
                    events.post(
                        session, queue, events.BROKER_QUEUE_DISABLED, {"Reason": reason}, now=now
                    )
            except Exception:
                log.exception("posting BROKER_QUEUE_DISABLED for %s failed", queue)
            session.catalog_changed()  # monitors stop activating it
            session.touched(queue)  # waiting receivers wake and see it is off
            disabled.append(queue)
            session.tally(counters.DISABLED, queue)
            log.error("queue %s disabled: %s", queue, reason)
    return disabled


def route(
    session: sessions.Session, message: models.Message, policy: PoisonPolicy, hist: History
) -> tuple[tuple[str, ...], bool]:
    """Apply the policy's dispositions to a message already off its queue.

    :return: the dispositions applied, and whether its conversation was ended
    """
    park = next((d for d in policy.dispositions if isinstance(d, Park)), None)
    now = time.time()
    handle = str(message.conversation_handle)
    if park is not None and hist.cycles < park.max_cycles:
        _keep(session, message, "PARKED", hist, "park", now, redeliver_at=now + park.delay)
        _record(session, message, "PARKED", None, None)
        session.deadline(now + park.delay)
        session.tally(counters.POISON, message.queue_name, park.kind)
        log.warning(
            "poison message %s/%s parked for %s s (cycle %s of %s) after %s failures",
            handle,
            message.message_sequence_number,
            park.delay,
            hist.cycles + 1,
            park.max_cycles,
            hist.failures,
        )
        return (park.kind,), False
    rest = [d for d in policy.dispositions if not isinstance(d, Park)] or [Log()]
    names = ",".join(d.kind for d in rest)
    poison_id = None
    ended = False
    if any(isinstance(d, Log) for d in rest):
        poison_id = _keep(session, message, "LOGGED", hist, names, now)
    for d in rest:
        if isinstance(d, Notify):
            _notify(session, message, d, hist, poison_id, now)
        elif isinstance(d, EndConversation):
            ended = _end_with_error(session, message, d, hist)
    for d in rest:
        session.tally(counters.POISON, message.queue_name, d.kind)
    log.warning(
        "poison message %s/%s (%s) routed to %s after %s failures: %s",
        handle,
        message.message_sequence_number,
        message.message_type_name,
        names,
        hist.failures,
        hist.last_error,
    )
    return tuple(d.kind for d in rest), ended


def _notify(
    session: sessions.Session,
    message: models.Message,
    d: Notify,
    hist: History,
    poison_id: int | None,
    now: float,
) -> None:
    """Post the event and call the callback, each in a savepoint: a broken subscriber or
    callback is logged and does not hold the routing up (a routing that failed would be
    retried, and fail again, for ever)."""
    handle = str(message.conversation_handle)
    seq = message.message_sequence_number
    if d.event:
        try:
            with session.savepoint():
                events.post(
                    session,
                    message.queue_name,
                    events.POISON_MESSAGE,
                    {
                        "ConversationHandle": handle,
                        "MessageSequenceNumber": seq,
                        "MessageTypeName": message.message_type_name,
                        "Failures": hist.failures,
                        "LastError": hist.last_error,
                        "PoisonId": poison_id,
                    },
                    now=now,
                )
        except Exception:
            log.exception("posting POISON_MESSAGE for %s/%s failed", handle, seq)
    if d.callback is not None:
        try:
            with session.savepoint():
                callback = d.callback
                if isinstance(callback, str):
                    callback = checks.resolve(callback, "Notify callback")
                callback(
                    PoisonEvent(
                        session.front,
                        message,
                        hist.failures,
                        hist.cycles,
                        hist.last_error,
                        poison_id,
                    )
                )
        except Exception:
            log.exception(
                "poison callback %r for %s/%s failed; the message was routed anyway",
                d.callback,
                handle,
                seq,
            )


def _keep(
    session: sessions.Session,
    message: models.Message,
    state: str,
    hist: History,
    dispositions: str,
    now: float,
    *,
    redeliver_at: float | None = None,
) -> int:
    poison_id = session.scalar(
        "poison_message_insert",
        state=state,
        queue=message.queue_name,
        group_id=str(message.conversation_group_id),
        handle=str(message.conversation_handle),
        seq=message.message_sequence_number,
        message_type=message.message_type_name,
        body=message.body,
        priority=message.priority,
        service=message.service_name,
        contract=message.service_contract_name,
        enqueued_at=message.enqueued_at,
        failures=hist.failures,
        cycles=hist.cycles + (1 if state == "PARKED" else 0),
        last_error=hist.last_error,
        dispositions=dispositions,
        now=now,
        redeliver_at=redeliver_at,
    )
    session.mark_written()
    return int(poison_id)


def _end_with_error(
    session: sessions.Session, message: models.Message, disposition: EndConversation, hist: History
) -> bool:
    description = disposition.description or (
        f"message {message.message_sequence_number} ({message.message_type_name}) on queue "
        f"{message.queue_name!r} failed {hist.failures} times and was taken off as a poison "
        f"message; last error: {hist.last_error or 'unknown'}"
    )
    try:
        conversations.end_conversation(
            session,
            message.conversation_handle,
            error=disposition.code,
            description=description[:4000],
        )
    except (exceptions.ConversationNotFound, exceptions.ConversationStateError):
        return False  # already ended: the partner was told then
    return True


def requeue(
    session: sessions.Session, message: models.Message, endpoint: models.ConversationEndpoint
) -> None:
    """Put a message back on its conversation's queue, with its sequence number."""
    sending.enqueue_at(
        session,
        endpoint,
        message.message_sequence_number,
        message.message_type_name,
        message.body,
    )


def fail_leased(
    session: sessions.Session, row: Mapping[str, Any], kind: str, error: str | None
) -> str:
    """A leased message failed (abandoned, or its heartbeat ran out): count it, then
    retry it or route it per the queue's policy."""
    session.execute("lease_delete", lease_id=row["lease_id"])
    message = message_of(row)
    _record(session, message, kind, error, row["worker"])
    hist = history(session, message)
    policy = policy_for(session, message.queue_name)
    endpoint = session.one("endpoint_get", handle=row["conversation_handle"])
    if hist.failures < policy.threshold and endpoint is not None:
        requeue(session, message, models.ConversationEndpoint.from_row(endpoint))
        log.warning(
            "message %s/%s requeued after failure %s of %s: %s",
            row["conversation_handle"],
            row["message_sequence_number"],
            hist.failures,
            policy.threshold,
            error,
        )
        return "requeued"
    route(session, message, policy, hist)
    return "routed"


def redeliver_parked(session: sessions.Session, now: float, limit: int = 100) -> int:
    """Parked messages whose delay is over go back on their conversation's queue."""
    returned = 0
    for row in session.all("parked_due", now=now, limit=limit):
        endpoint = session.one("endpoint_get", handle=row["conversation_handle"])
        if endpoint is None:
            # The conversation ended while the message was parked: keep it for an operator.
            session.execute(
                "poison_message_to_log",
                poison_id=row["poison_id"],
                last_error="its conversation ended while it was parked",
                dispositions="park,log",
            )
        else:
            session.execute("poison_message_delete", poison_id=row["poison_id"])
            requeue(session, message_of(row), models.ConversationEndpoint.from_row(endpoint))
        session.mark_written()
        returned += 1
    return returned
