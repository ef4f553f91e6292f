"""Event notifications: posting an event to the services subscribed to it on a queue.

Each subscription keeps one dialog from the broker's ``EventNotificationService``; events
travel on it as ``EventNotification`` messages with a JSON body (``EventType``,
``PostTime``, ``DatabaseName``, ``ObjectName`` and the event's own fields).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping
from typing import Any

from scheduler_lib.broker import exceptions, models
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.db import session as sessions
from scheduler_lib.broker.ops import catalog, conversations, sending

QUEUE_ACTIVATION = "QUEUE_ACTIVATION"
BROKER_QUEUE_DISABLED = "BROKER_QUEUE_DISABLED"
POISON_MESSAGE = "POISON_MESSAGE"
SENDABLE = (
    models.EndpointState.STARTED_OUTBOUND,
    models.EndpointState.STARTED_INBOUND,
    models.EndpointState.CONVERSING,
)
assert set(catalog.EVENT_TYPES) == {QUEUE_ACTIVATION, BROKER_QUEUE_DISABLED, POISON_MESSAGE}


def post(
    session: sessions.Session,
    queue: str,
    event_type: str,
    fields: Mapping[str, Any] | None = None,
    *,
    now: float | None = None,
) -> int:
    """Post ``event_type`` on ``queue`` to every subscriber, in ``session``'s transaction.

    :return: how many subscribers it was posted to
    """
    subscribers = session.all("event_notifications_for", queue=queue, event_type=event_type)
    if not subscribers:
        return 0
    body = json.dumps(
        {
            "EventType": event_type,
            "PostTime": time.time() if now is None else now,
            "DatabaseName": session.shared.url.database,
            "ObjectName": queue,
            **(fields or {}),
        }
    )
    data = checks.body_bytes(body, session.shared.max_message_size)
    for subscriber in subscribers:
        handle = subscriber["conversation_handle"]
        row = None if handle is None else session.one("endpoint_get", handle=handle)
        if row is not None and models.ConversationEndpoint.from_row(row).state not in SENDABLE:
            # The subscriber ended the dialog (or it failed): leave it and open a new one.
            with contextlib.suppress(exceptions.BrokerError):
                conversations.end_conversation(session, handle)
            row = None
        if row is None:
            handle = str(
                conversations.begin_dialog(
                    session,
                    catalog.EVENT_SERVICE,
                    subscriber["to_service_name"],
                    catalog.EVENT_CONTRACT,
                )
            )
            session.execute(
                "event_notification_set_dialog",
                name=subscriber["notification_name"],
                handle=handle,
            )
        sending.send(session, handle, catalog.EVENT_MESSAGE_TYPE, data)
    return len(subscribers)
