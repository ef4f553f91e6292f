"""The rows the broker's operations stand on — a queue, a service, a conversation
endpoint and its far side — read or refused with the right NotFound; a target endpoint
made with a conversation's first message; an endpoint closed."""

from __future__ import annotations

import time
import uuid
from typing import Literal, overload

from scheduler_lib.broker import exceptions, models
from scheduler_lib.broker.db import session as sessions
from scheduler_lib.broker.db import store

# An endpoint in these states may SEND; so must the far side it sends to.
SENDABLE_STATES = frozenset({"SO", "SI", "CO"})


def queue(session: sessions.Session, name: str) -> models.QueueInfo:
    row = session.one("queue_get", name=name)
    if row is None:
        raise exceptions.QueueNotFound(f"queue {name!r} does not exist")
    return models.QueueInfo.from_row(row)


def service(session: sessions.Session, name: str) -> store.Row:
    row = session.one("service_get", name=name)
    if row is None:
        raise exceptions.ServiceNotFound(f"service {name!r} does not exist")
    return row


def endpoint(session: sessions.Session, handle: str) -> models.ConversationEndpoint:
    row = session.one("endpoint_get", handle=handle)
    if row is None:
        raise exceptions.ConversationNotFound(
            f"conversation handle {handle} does not exist (never began, or already closed)"
        )
    return models.ConversationEndpoint.from_row(row)


@overload
def far(
    session: sessions.Session, near: models.ConversationEndpoint, *, create: Literal[True]
) -> models.ConversationEndpoint: ...


@overload
def far(
    session: sessions.Session, near: models.ConversationEndpoint, *, create: bool
) -> models.ConversationEndpoint | None: ...


def far(
    session: sessions.Session, near: models.ConversationEndpoint, *, create: bool
) -> models.ConversationEndpoint | None:
    """The other side's endpoint; with ``create`` (a SEND), the target's made with the
    conversation's first message.

    :raises ConversationStateError: with ``create``, when the other side existed and
        was removed WITH CLEANUP (never brought back)
    """
    ids = {"conversation_id": str(near.conversation_id), "is_initiator": near.is_initiator}
    row = session.one("endpoint_far", **ids)
    if row is None and create:
        # Two first SENDs at once (threads on one conversation) would both make the target:
        # the second waits for the first's lock on the sending endpoint (the SEND takes it
        # anyway), then reads both sides again.
        session.execute("endpoint_lock", handle=str(near.conversation_handle))
        session.mark_written()
        near = endpoint(session, str(near.conversation_handle))
        row = session.one("endpoint_far", **ids)
    if row is not None:
        return models.ConversationEndpoint.from_row(row)
    if not create:
        return None
    if not near.is_initiator or near.send_sequence > 0:
        # The other side existed and was removed WITH CLEANUP: never bring it back.
        side = "target" if near.is_initiator else "initiator"
        raise exceptions.ConversationStateError(
            f"cannot send on conversation {near.conversation_handle}: the {side} "
            "endpoint no longer exists (it was ended with cleanup); end it here too"
        )
    # The target endpoint comes into being with the conversation's first message.
    return create_target(
        session,
        conversation_id=str(near.conversation_id),
        service_name=near.far_service_name,
        far_service=near.service_name,
        contract=near.contract_name,
        lifetime_expires_at=near.lifetime_expires_at,
        is_remote=False,
    )


def create_target(
    session: sessions.Session,
    *,
    conversation_id: str,
    service_name: str,
    far_service: str,
    contract: str,
    lifetime_expires_at: float | None,
    is_remote: bool,
) -> models.ConversationEndpoint:
    """A conversation's target endpoint, in a new group of its service's queue (its
    initiator is here, or on another broker when ``is_remote``)."""
    target = service(session, service_name)
    now = time.time()
    handle, group_id = str(uuid.uuid4()), str(uuid.uuid4())
    session.execute("group_insert", group_id=group_id, queue=target["queue_name"], now=now)
    session.execute(
        "endpoint_insert",
        handle=handle,
        conversation_id=conversation_id,
        is_initiator=False,
        service=service_name,
        far_service=far_service,
        contract=contract,
        queue=target["queue_name"],
        group_id=group_id,
        state=models.EndpointState.STARTED_INBOUND.value,
        lifetime_expires_at=lifetime_expires_at,
        now=now,
        is_remote=is_remote,
    )
    session.mark_written()
    return endpoint(session, handle)


def close(
    session: sessions.Session, closing: models.ConversationEndpoint, *, cleanup: bool = False
) -> None:
    """Remove an endpoint, its messages and, once empty, its group. A remote
    conversation's endpoint stays as a tombstone (state ``CD``) for a while: late
    copies of its messages must be recognised, not open a new conversation; and its
    outgoing messages still go (the far side needs their numbers to take what
    follows, its EndDialog), unless this is a cleanup."""
    handle = str(closing.conversation_handle)
    session.execute("messages_delete_conversation", handle=handle)
    if closing.is_remote and not cleanup:
        session.execute("transmission_delete_held", handle=handle)
    else:
        session.execute("transmission_delete_conversation", handle=handle)
    session.execute("leases_delete_conversation", handle=handle)
    session.execute("poison_history_delete_conversation", handle=handle)
    session.mark_written()
    if closing.is_remote:
        session.execute(
            "fragments_delete_conversation",
            conversation_id=str(closing.conversation_id),
            is_initiator=not closing.is_initiator,
        )
        session.execute("endpoint_tombstone", handle=handle, now=time.time())
        return
    session.execute("endpoint_delete", handle=handle)
    session.execute("group_delete_if_empty", group_id=str(closing.conversation_group_id))


def state_error(of: models.ConversationEndpoint, action: str) -> exceptions.ConversationStateError:
    """Why ``action`` cannot be done on endpoint ``of`` in its state."""
    state = models.EndpointState
    reasons = {
        state.DISCONNECTED_INBOUND: "the far side ended it; end it here too",
        state.DISCONNECTED_OUTBOUND: "this side already ended it",
        state.ERROR: "it is in error (an Error message arrived or its lifetime expired)",
        state.CLOSED: "it is closed",
    }
    reason = reasons.get(of.state, f"its state is {of.state.name}")
    return exceptions.ConversationStateError(
        f"cannot {action} conversation {of.conversation_handle}: {reason}"
    )
