"""RECEIVE and GET CONVERSATION GROUP: one look (the one-statement look where the dialect
has one, else the checked look that locks a group and takes its conversations in order),
and the wait of ``WAITFOR`` around it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from scheduler_lib.broker import counters, models
from scheduler_lib.broker.db import session as sessions
from scheduler_lib.broker.db import store
from scheduler_lib.broker.db import waiting as waits
from scheduler_lib.broker.ops import endpoints

T = TypeVar("T")

QUEUE_RECHECK = 1.0  # seconds a waiting RECEIVE trusts the queue's settings


def receive(
    session: sessions.Session,
    queue: str,
    top: int,
    timeout: float | None,
    handle: str | None = None,
    group_id: str | None = None,
    *,
    looked: int | None = None,
) -> list[models.Message]:
    """WAITFOR (RECEIVE ...) in the session's transaction: the one-statement look where
    the dialect has one, then the wait of :func:`wait_for` around the checked look.

    :param looked: the caller has just made the one-statement look, in a transaction of
        its own, and found nothing: the wakeup generation it read before that look
    """
    if looked is None and group_id is None:
        found, looked = first_look(session, queue, top, handle)
        if found:
            return found
    return wait_for(
        session,
        queue,
        timeout,
        lambda: look(session, queue, top, handle, group_id),
        [],
        unfiltered=handle is None and group_id is None,
        looked=None
        if looked is None
        else (looked, lambda: look(session, queue, top, handle, None, fast_looked=True)),
    )


def first_look(
    session: sessions.Session, queue: str, top: int, handle: str | None
) -> tuple[list[models.Message], int | None]:
    """The one-statement look a RECEIVE makes first: what it got, and the wakeup
    generation read before it — for the wait that follows an empty look (``None`` where
    the dialect has no such look: the wait must look itself)."""
    seen = session.waiting.wakeups.generation(queue)
    found = fast(session, queue, top, handle)
    if found:
        session.received_from(queue)
    return found, seen if session.store.features.one_statement_receive else None


def look(
    session: sessions.Session,
    queue: str,
    top: int,
    handle: str | None,
    group_id: str | None,
    *,
    fast_looked: bool = False,
) -> list[models.Message]:
    """One look; ``fast_looked``: the caller has just made the one-statement look."""
    if not fast_looked and group_id is None:
        found = fast(session, queue, top, handle)
        if found:
            return found
    info = queue_settings(session.waiting, queue, lambda: endpoints.queue(session, queue))
    if not info.is_receive_enabled:
        raise info.disabled_error()
    fast_ran = session.store.features.one_statement_receive and group_id is None
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
        locked = session.scalar("receive_lock_conversation", queue=queue, handle=handle)
        if locked is None:
            return []
        conversations = [handle]
    else:
        if group_id is not None:
            locked = session.scalar("receive_lock_group", queue=queue, group_id=group_id)
        else:
            locked = pick_group(session, info)
        if locked is None:
            return []
        conversations = _arrival_order(
            session.all("receive_group_firsts", group_id=locked, top=top)
        )
    messages: list[models.Message] = []
    for conversation in conversations:
        rows = session.all(take, handle=conversation, top=top - len(messages))
        messages.extend(sorted(map(models.Message.from_row, rows), key=_sequence))
        if len(messages) >= top:
            break
    session.mark_written()
    if messages:
        session.tally(counters.RECEIVED, queue, n=len(messages))
        session.receipt(queue)
        # Inside this transaction: only a commit ends the queue's run of rollbacks.
        session.execute("queue_reset_rollbacks", name=queue)
    return messages


def pick_group(
    session: sessions.Session, queue: models.QueueInfo, query: str = "receive_pick_group"
) -> str | None:
    """Lock the group to serve next: with aging on, the group of the oldest message
    that waited past the bound, whatever its level; otherwise (or if none has) the
    group of the highest-level message, oldest first."""
    if queue.receive_aging_seconds is not None:
        cutoff = time.time() - queue.receive_aging_seconds
        aged = session.scalar("receive_pick_aged", queue=queue.name, cutoff=cutoff)
        if aged is not None:
            return str(aged)
    picked = session.scalar(query, queue=queue.name)
    return None if picked is None else str(picked)


def fast(
    session: sessions.Session, queue: str, top: int, handle: str | None = None
) -> list[models.Message]:
    """RECEIVE (of one conversation, with ``handle``) in one statement where the
    dialect has one; ``[]`` also when the queue needs the checked path (unknown,
    disabled, retention)."""
    if not session.store.features.one_statement_receive:
        return []
    params: dict[str, Any] = {"queue": queue}
    if handle is not None:
        query, params["handle"], params["top"] = "receive_fast_conversation", handle, top
    elif top == 1:
        query = "receive_fast_one"  # the same RECEIVE, lighter for one message
    else:
        query, params["top"] = "receive_fast", top
    rows = session.rows(query, **params)
    if not rows:
        return []
    session.mark_written()
    session.receipt(queue)  # the statement reset the rollback count itself
    session.tally(counters.RECEIVED, queue, n=len(rows))
    # The statement returns them in RECEIVE's order.
    return [models.Message.from_values(r) for r in rows]


def group_once(session: sessions.Session, queue: str) -> uuid.UUID | None:
    """One look of GET CONVERSATION GROUP: the group locked, or ``None``."""
    info = endpoints.queue(session, queue)
    if not info.is_receive_enabled:
        raise info.disabled_error()
    group_id = pick_group(session, info, query="get_group_pick")
    if group_id is None:
        return None
    session.mark_written()  # the group stays locked until the transaction ends
    return uuid.UUID(group_id)


def queue_settings(
    waiting: waits.Waiting, queue: str, read: Callable[[], models.QueueInfo]
) -> models.QueueInfo:
    """A queue's settings as an empty look checks them (RECEIVE's, the take's): re-read
    at most every ``QUEUE_RECHECK`` seconds per broker — a queue turned off elsewhere is
    noticed that soon, here at once (this process's catalog changes clear the cache) —
    so an empty look costs one statement, not two."""
    now = time.monotonic()
    cached = waiting.waited_queues.get(queue)
    if cached is None or now - cached[0] > QUEUE_RECHECK:
        cached = waiting.waited_queues[queue] = (now, read())
    return cached[1]


def wait_for(
    session: sessions.Session | None,
    queue: str,
    timeout: float | None,
    attempt: Callable[[], T],
    empty: T,
    *,
    waiting: waits.Waiting | None = None,
    unfiltered: bool = True,
    looked: tuple[int, Callable[[], T]] | None = None,
    in_turns: bool = False,
) -> T:
    """Run ``attempt`` until it finds something or ``timeout`` passes (WAITFOR): the one
    wait of RECEIVE, GET CONVERSATION GROUP and the take.

    :param session: the transaction the looks run in (RECEIVE), or ``None`` when each
        look is a transaction of its own (the one-statement take; give ``waiting``)
    :param looked: the caller has just looked (one statement) and found nothing: the
        wakeup generation it read before that look, and the rest of a first attempt
        after it — so an empty RECEIVE costs one look, not two
    :param in_turns: the threads of this process that wait on ``queue`` this way do it
        in turns: the one whose turn it is looks and waits for wakeups, the others look
        once per poll interval and wait for the turn. A message that arrives then wakes
        one of them, not every idle one (a herd whose looks all but one find nothing,
        and slow the one that matters); one that got something hands the turn on at
        once, so a backlog still goes to all of them.
    """
    state = session.waiting if session is not None else waiting
    assert state is not None, "a wait without a session needs the process's waiting"
    deadline = None if timeout is None else time.monotonic() + timeout
    poll = state.poll_interval
    turn = state.turn(queue) if in_turns else None
    waiter_registered = False
    try:
        while True:
            if turn is not None and not turn.acquire(blocking=False):
                # Another thread waits for wakeups; look anyway, once per poll interval (a
                # message can become available with no wakeup here: a group another
                # process held, a NOTIFY lost while LISTEN reconnects), then wait for the
                # turn.
                found = attempt()
                if found:
                    return _got(session, queue, found, None)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return empty
                if not turn.acquire(timeout=poll if remaining is None else min(poll, remaining)):
                    continue
            try:
                noted = None
                if looked is not None:
                    (seen, rest), looked = looked, None
                    found = rest()
                else:
                    seen = state.wakeups.generation(queue)
                    if session is not None and unfiltered and not session.in_gate:
                        noted = state.note_blocked_receiver(queue)
                    found = attempt()
                if found:
                    return _got(session, queue, found, noted)
                if session is not None:
                    session.release_while_idle()
                if unfiltered and (session is None or not session.wrote):
                    # Queue monitors read this as "a reader is here, waiting for work".
                    state.record_empty_receive(queue)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return empty
                state.watch_sqlite()
                if state.announced and not waiter_registered:
                    waiter_registered = True
                    if state.set_waiting(queue, +1):
                        # Senders NOTIFY only while somebody is registered: look once more
                        # after registering, so a message sent meanwhile is not missed.
                        continue
                state.wakeups.wait(queue, seen, poll if remaining is None else min(poll, remaining))
            finally:
                if turn is not None:
                    turn.release()
    finally:
        if waiter_registered:
            state.set_waiting(queue, -1)


def _got(
    session: sessions.Session | None, queue: str, found: T, noted: tuple[float | None, float] | None
) -> T:
    """What a wait that found something leaves for the queue's monitors."""
    if session is None:
        return found  # a look that is a transaction of its own said so itself
    group = _group_of(found)
    waiting = session.waiting
    # SQLite: a receiver that queued for the write lock and then got the group the
    # previous holder just let go of was waiting for that group (PostgreSQL's second
    # reader would have found it locked, and empty): its note stands. One that got
    # another group was a busy reader.
    if noted is not None and waiting.last_group_received.get(queue) != group:
        waiting.unnote_blocked_receiver(queue, noted)
    if group is not None:
        waiting.last_group_received[queue] = group
    session.received_from(queue)
    return found


def _arrival_order(firsts: list[store.Row]) -> list[str]:
    """RECEIVE's order of a group's conversations, from ``receive_group_firsts`` (rows by
    level, then arrival): each conversation where its oldest ready message first appears —
    by level, then by that message's arrival, never by the handle's text."""
    return list(dict.fromkeys(str(row["conversation_handle"]) for row in firsts))


def _sequence(message: models.Message) -> int:
    """A conversation's order (DELETE ... RETURNING promises no order of its own)."""
    return message.message_sequence_number


def _group_of(found: object) -> str | None:
    """The conversation group a RECEIVE (its messages) or GET CONVERSATION GROUP got."""
    if isinstance(found, uuid.UUID):
        return str(found)
    if isinstance(found, list) and found and isinstance(found[0], models.Message):
        return str(found[0].conversation_group_id)
    return None
