"""Conversation timers and lifetimes that fall due: ``DialogTimer`` and lifetime
``Error`` messages put on their queues."""

from __future__ import annotations

import json

from scheduler_lib.broker import models
from scheduler_lib.broker.db import session as sessions
from scheduler_lib.broker.ops import endpoints, sending

LIFETIME_EXPIRED_CODE = -8489  # SQL Server's code for "the dialog has exceeded its LIFETIME"
LIFETIME_RETRY = 1.0  # seconds before expiry looks again at an ended endpoint whose group is held


def next_deadline(session: sessions.Session) -> float | None:
    """The soonest instant (epoch seconds) a timer, a lifetime, a lease or a parked
    poison message falls due; ``None``: nothing is waiting."""
    deadline = session.scalar("next_deadline")
    return None if deadline is None else float(deadline)


def fire_due(session: sessions.Session, now: float, limit: int = 100) -> int:
    """Put ``DialogTimer`` and lifetime ``Error`` messages on their queues; how many."""
    fired = 0
    for row in session.all("timers_due", now=now, limit=limit):
        session.execute("timer_clear", handle=row["conversation_handle"])
        sending.enqueue(
            session,
            row,
            row["conversation_handle"],
            models.DIALOG_TIMER_SEQUENCE,
            models.DIALOG_TIMER,
            None,
        )
        fired += 1
    for row in session.all("lifetimes_due", now=now, limit=limit):
        if row["state"] == models.EndpointState.DISCONNECTED_OUTBOUND.value:
            # This side already ended: the lifetime bounds its wait for the far side's
            # END. It closes; nobody is told (its application has left the conversation).
            if session.one("group_try_lock", group_id=row["conversation_group_id"]) is None:
                retry_at = now + LIFETIME_RETRY
                session.execute(
                    "lifetime_retry", handle=row["conversation_handle"], retry_at=retry_at
                )
                session.deadline(retry_at)
                session.mark_written()
                continue
            endpoints.close(session, models.ConversationEndpoint.from_row(row))
            fired += 1
            continue
        session.execute("lifetime_expire", handle=row["conversation_handle"])
        body = json.dumps(
            {"code": LIFETIME_EXPIRED_CODE, "description": "The dialog has exceeded its lifetime."}
        ).encode()
        sending.enqueue(
            session, row, row["conversation_handle"], models.ERROR_SEQUENCE, models.ERROR, body
        )
        fired += 1
    if fired > 0:
        session.mark_written()
    return fired
