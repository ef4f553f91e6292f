"""What happens when messages held for a queue that was off reach it (seed 001, issue 22).

A SEND to a local service whose queue is off holds the message in the transmission queue
(so does a message arriving from another broker for such a queue); turning the queue on,
or moving the service to a queue that is on, releases what was held, in arrival order.
The message *arrives* then, and two rules of arrival apply at that moment:

- **The target endpoint's level.** SQL Server creates the target endpoint, and gives it
  its level, when the conversation's first message is put on the target queue. Our
  target endpoint row exists from the SEND (its sequence numbers and state need it), but
  when that first message (number 0) is among the rows released, the endpoint's level is
  computed again from the priorities that exist at release, and its released messages
  carry that level. An endpoint that already had a message arrive keeps its level.
- **Validation on arrival.** SEND checks a body against its message type's validation
  (the friendlier, early check); SQL Server checks on arrival. A held body that no longer
  passes — its type was altered meanwhile — is not delivered, nor is anything of its
  conversation held after it: the conversation fails with an ``Error`` (code -9617, the
  reason naming the message type), as a message from another broker that fails its
  check does (:mod:`.transport.delivery`).

The normal release stays set-based (four statements whatever the number of messages):
bodies are read into Python only when some held message is of a type whose validation
is not ``NONE``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from scheduler_lib.broker import exceptions, models
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.db import session as sessions
from scheduler_lib.broker.ops import endpoints, sending

if TYPE_CHECKING:
    from scheduler_lib.broker.db import store

_SENDABLE = (
    models.EndpointState.STARTED_OUTBOUND,
    models.EndpointState.STARTED_INBOUND,
    models.EndpointState.CONVERSING,
)


def release_held(session: sessions.Session, queue: str) -> None:
    """Deliver the messages held for ``queue`` (which is on now), in arrival order."""
    session.mark_written()
    refused: list[tuple[str, int, str]] = []  # (receiving handle, its number, why)
    failed: set[str] = set()
    for row in session.all("held_to_check", queue=queue):
        handle = str(row["conversation_handle"])
        if handle in failed:
            continue
        reason = _refusal(row)
        if reason is None:
            continue
        failed.add(handle)
        # It and everything of its conversation held after it stay out of the queue.
        session.execute("held_drop_from", handle=handle, message_id=row["message_id"])
        refused.append((handle, int(row["message_sequence_number"]), reason))
    session.execute("held_reprioritize", queue=queue)
    session.execute("transmission_release", queue=queue)
    session.execute("transmission_delete_queue", queue=queue)
    session.touched(queue)
    for handle, seq, reason in refused:
        _fail(session, handle, seq, reason)


def _refusal(row: store.Row) -> str | None:
    """Why a held message may not arrive now, or ``None``."""
    message_type = row["message_type_name"]
    if row["validation"] is None:
        # Cannot happen while the conversation is open (a type leaves only with every
        # contract that lists it, a contract only once no endpoint uses it): defensive.
        return f"message type {message_type!r} does not exist on this broker"
    try:
        checks.check_body(message_type, models.Validation(row["validation"]), row["message_body"])
    except exceptions.InvalidMessageBody as exc:
        return str(exc)
    return None


def _fail(session: sessions.Session, handle: str, seq: int, reason: str) -> None:
    """Message ``seq`` held for endpoint ``handle`` failed its check on arrival: both
    sides of a local conversation get an ``Error`` and go to ``ER`` (the sender's
    answer is SQL Server's; the receiving side's is what delivery does for a message from
    another broker), each at ERROR_SEQUENCE: received ahead of the messages still on its
    queue, as every Error. A target endpoint whose FIRST message it was never came to be
    (SQL Server creates it when that message reaches the queue): it closes. A side whose
    application already ended (``DO``) closes instead of being told."""
    row = session.one("endpoint_get", handle=handle)
    if row is None:
        return
    receiver = models.ConversationEndpoint.from_row(row)
    sender = None if receiver.is_remote else endpoints.far(session, receiver, create=False)
    body = json.dumps({"code": checks.INVALID_MESSAGE_CODE, "description": reason}).encode()
    if sender is not None:
        if sender.state is models.EndpointState.DISCONNECTED_OUTBOUND:
            # Its END was held behind the message: nobody left to tell.
            endpoints.close(session, sender)
        elif sender.state in _SENDABLE:
            # The answer is the receiving side's next message; like every Error it is
            # received ahead of what the sender's queue still holds (ERROR_SEQUENCE).
            session.scalar("endpoint_take_system_sequence", handle=handle)
            sending.enqueue_at(session, sender, models.ERROR_SEQUENCE, models.ERROR, body)
            session.execute(
                "endpoint_set_state",
                handle=str(sender.conversation_handle),
                state=models.EndpointState.ERROR.value,
            )
    never_arrived = not receiver.is_initiator and not receiver.is_remote and seq == 0
    if never_arrived or receiver.state is models.EndpointState.DISCONNECTED_OUTBOUND:
        endpoints.close(session, receiver)
    elif receiver.state is not models.EndpointState.CLOSED:
        sending.enqueue_at(session, receiver, models.ERROR_SEQUENCE, models.ERROR, body)
        session.execute("endpoint_set_state", handle=handle, state=models.EndpointState.ERROR.value)
