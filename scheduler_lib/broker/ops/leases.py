"""Leases, as plain functions over a session: a message taken for long work waits under
its worker's heartbeat instead of in an open transaction (seed 004's recovery for workers
that die). Two takes: the checked one, inside the session's transaction (:func:`take`),
and the one-statement take of PostgreSQL (:func:`take_fast`), each look a transaction of
its own on a connection whose commits do not wait for the WAL flush, with its wait
(:func:`take_waiting`: RECEIVE's wait, in turns per queue) — ``Broker.take(durable=False)``
and ``Broker.take_recorded``. The heartbeat thread is
:class:`~scheduler_lib.broker.leases.LeaseKeeper`. The fronts' ``LeaseOperations``
documents each operation."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from scheduler_lib.broker import counters, exceptions, models
from scheduler_lib.broker.db import session as sessions
from scheduler_lib.broker.db import waiting as waits
from scheduler_lib.broker.ops import poison, receiving

log = logging.getLogger(__name__)

DEFAULT_LEASE = 60.0  # seconds a taken message is held without a heartbeat


@dataclasses.dataclass(frozen=True)
class Lease:
    """A message taken for long work. Renew it (:meth:`Broker.keep_alive`) while the work
    runs; complete it in the transaction that answers."""

    lease_id: str
    message: models.Message
    worker: str
    duration: float
    expires_at: float
    taken_at: float | None = None  # when its take committed (the one-statement take)


@dataclasses.dataclass(eq=False)
class Record:
    """A named statement run right after a one-statement take that got leases, in its
    round trip (``Broker.take_recorded``)."""

    query: str
    params: dict[str, Any]
    durable: bool = True  # whether its commit waits for the WAL flush
    #: what it returned; ``None`` when it did not run or its outcome is unknown
    rows: list[tuple[Any, ...]] | None = None


class NeedsCheckedTake(Exception):
    """The queue keeps what it delivers (retention) or ages its receives: the
    one-statement take leaves it to the checked take, in a transaction."""


def take(
    session: sessions.Session,
    queue: str,
    top: int,
    timeout: float | None,
    duration: float,
    holder: str,
    durable: bool,
) -> list[Lease]:
    """RECEIVE for long work, in the session's transaction: the messages leave the queue
    and wait under leases of ``duration`` seconds held by ``holder``. ``durable=False``:
    the transaction commits without waiting for the WAL flush."""
    if not durable:
        session.commit_without_flush()
    messages = receiving.receive(session, queue, top, timeout)
    now = time.time()
    leases = [Lease(str(uuid.uuid4()), m, holder, duration, now + duration) for m in messages]
    for held in leases:
        m = held.message
        session.execute(
            "lease_insert",
            lease_id=held.lease_id,
            queue_name=m.queue_name,
            conversation_group_id=str(m.conversation_group_id),
            conversation_handle=str(m.conversation_handle),
            message_sequence_number=m.message_sequence_number,
            message_type_name=m.message_type_name,
            message_body=m.body,
            priority=m.priority,
            service_name=m.service_name,
            service_contract_name=m.service_contract_name,
            enqueued_at=m.enqueued_at,
            worker=holder,
            now=now,
            expires_at=held.expires_at,
        )
    if leases:
        session.deadline(min(held.expires_at for held in leases))
    return leases


def renew(session: sessions.Session, lease: Lease) -> float:
    """The lease lasts another ``lease.duration`` seconds from now: the new expiry."""
    now = time.time()
    if not session.count(
        "lease_renew", lease_id=lease.lease_id, now=now, expires_at=now + lease.duration
    ):
        raise lost_error(lease)
    session.mark_written()
    return now + lease.duration


def complete(session: sessions.Session, lease: Lease) -> None:
    """End the lease: the work is done."""
    if not session.count("lease_delete", lease_id=lease.lease_id):
        raise lost_error(lease)
    session.mark_written()


def abandon(session: sessions.Session, lease: Lease, error: BaseException | str | None) -> str:
    """Give the message back as failed: ``"requeued"`` or ``"routed"``."""
    row = session.one("lease_get", lease_id=lease.lease_id)
    if row is None:
        raise lost_error(lease)
    return poison.fail_leased(session, row, "FAILED", poison.error_text(error))


def holds(session: sessions.Session, lease: Lease) -> bool:
    """Whether the lease still exists."""
    return session.one("lease_get", lease_id=lease.lease_id) is not None


def release(session: sessions.Session, lease: Lease) -> None:
    """Give the message back untouched (nothing counted)."""
    row = session.one("lease_get", lease_id=lease.lease_id)
    if row is None:
        raise lost_error(lease)
    session.execute("lease_delete", lease_id=lease.lease_id)
    endpoint = session.one("endpoint_get", handle=row["conversation_handle"])
    if endpoint is not None:
        poison.requeue(
            session, poison.message_of(row), models.ConversationEndpoint.from_row(endpoint)
        )


def listed(session: sessions.Session, queue: str | None) -> list[Mapping[str, Any]]:
    """Leases held now, oldest first (message bodies left out)."""
    return [
        {k: v for k, v in r.items() if k != "message_body"}
        for r in session.all("lease_list", queue=queue)
    ]


def lease_from_row(row: Sequence[Any], worker: str, duration: float, taken_at: float) -> Lease:
    """A lease from ``take_fast``'s row: the lease id, then the message's columns."""
    lease_id, *message = row
    taken = models.Message.from_values([*message, models.MessageStatus.READY])
    return Lease(str(lease_id), taken, worker, duration, taken_at + duration, taken_at)


def lost_error(lease: Lease) -> exceptions.LeaseLost:
    return exceptions.LeaseLost(
        f"lease {lease.lease_id} on message {lease.message.message_sequence_number} of "
        f"conversation {lease.message.conversation_handle} is gone: it expired (the "
        "message went back to its queue or to its poison disposition) or already ended"
    )


def expire_leases(
    session: sessions.Session, now: float, recovered_at: float = 0.0, limit: int = 100
) -> int:
    """Leases whose heartbeat ran out are silent failures — once their worker had a whole
    lease to renew them since the database came back (``recovered_at``, epoch seconds)."""
    expired = 0
    for row in session.all("leases_expired", now=now, recovered_at=recovered_at, limit=limit):
        silent = now - float(row["heartbeat_at"])
        poison.fail_leased(
            session,
            row,
            "EXPIRED",
            f"worker lost, lease expired: worker {row['worker']} stopped renewing it "
            f"(last heartbeat {silent:.1f} s ago)",
        )
        expired += 1
    return expired


# --- the one-statement take (PostgreSQL) -------------------------------------------------


def take_fast(
    session: sessions.Session,
    queue: str,
    top: int,
    duration: float,
    holder: str,
    now: float,
    record: Record | None = None,
) -> list[Lease]:
    """One look of the one-statement take, on an autocommit session whose commits do not
    wait for the WAL flush: the first ``top`` messages of the first group nobody holds,
    under leases of ``holder`` taken at ``now`` (``[]`` when nothing was there). With
    ``record``, its statement follows a take that got leases, in the same round trip.

    A reply lost on the way back may hide leases that exist: :func:`found_again` finds
    them by ``holder`` and ``now``."""
    take = {"queue": queue, "top": top, "worker": holder, "now": now, "expires_at": now + duration}
    if record is None:
        rows = session.rows("take_fast", **take)
    else:
        record.rows = None  # unknown until this round trip's reply
        then = (record.query, {**record.params, "holder": holder, "taken_at": now})
        rows, recorded = session.take_then(("take_fast", take), then, durable=record.durable)
        if isinstance(recorded, Exception):
            log.warning("after a take on %s: %s", queue, recorded)
        else:
            record.rows = recorded
    return _taken(session, queue, rows, holder, duration, now)


def found_again(
    session: sessions.Session, queue: str, holder: str, duration: float, now: float
) -> list[Lease]:
    """The leases a :func:`take_fast` of ``holder`` at ``now`` made, when its reply was
    lost (else they would expire, and count as a lost worker's)."""
    rows = session.rows("leases_taken", worker=holder, now=now)
    return _taken(session, queue, rows, holder, duration, now)


def _taken(
    session: sessions.Session,
    queue: str,
    rows: Sequence[Sequence[Any]],
    holder: str,
    duration: float,
    now: float,
) -> list[Lease]:
    leases = [lease_from_row(row, holder, duration, now) for row in rows]
    if leases:  # its monitor looks again; the timer thread learns the expiry
        session.tally(counters.RECEIVED, queue, n=len(leases))
        session.received_from(queue)
        session.deadline(now + duration)
    return leases


def take_waiting(
    waiting: waits.Waiting,
    queue: str,
    timeout: float | None,
    look: Callable[[], list[Lease]],
    settings: Callable[[], models.QueueInfo],
) -> list[Lease] | None:
    """:func:`take_fast` with WAITFOR: ``look`` (one take, a transaction of its own) until
    it gets leases or ``timeout`` passes, in RECEIVE's wait, in turns with this process's
    other takers of ``queue``. ``None`` when the queue needs the checked take (its
    ``settings`` say: retention, receive aging); an unknown or disabled queue raises as
    RECEIVE does."""
    checked = False

    def attempt() -> list[Lease]:
        nonlocal checked
        leases = look()
        if leases or checked:
            return leases
        # unknown or off: say so, as RECEIVE does (settings read as RECEIVE's: cached)
        info = receiving.queue_settings(waiting, queue, settings)
        if not info.is_receive_enabled:
            raise info.disabled_error()
        if info.is_retention_enabled or info.receive_aging_seconds is not None:
            # take_fast leaves these queues to the checked take (its "no row" did not
            # mean "nothing there")
            raise NeedsCheckedTake(queue)
        checked = True
        return leases

    nothing: list[Lease] = []
    try:
        return receiving.wait_for(
            None, queue, timeout, attempt, nothing, waiting=waiting, in_turns=True
        )
    except NeedsCheckedTake:
        return None
