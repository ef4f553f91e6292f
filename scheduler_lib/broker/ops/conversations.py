"""Conversations: BEGIN DIALOG, SEND of several messages, GET CONVERSATION GROUP, MOVE,
END CONVERSATION (and the order it takes its locks in), conversation timers, and the views
of endpoints, queues and the transmission queue — as plain functions over a session. The
fronts' :class:`~scheduler_lib.broker.conversations.ConversationOperations` documents
each. SEND of one message and RECEIVE are :mod:`.sending` and :mod:`.receiving`."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from scheduler_lib.broker import exceptions, models
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.db import session as sessions
from scheduler_lib.broker.ops import endpoints, receiving, routes, sending


def begin_dialog(
    session: sessions.Session,
    from_service: str,
    to_service: str,
    contract: str = models.DEFAULT,
    *,
    lifetime: float | None = None,
    related_conversation: uuid.UUID | str | None = None,
    related_group: uuid.UUID | str | None = None,
) -> uuid.UUID:
    """BEGIN DIALOG CONVERSATION."""
    if related_conversation is not None and related_group is not None:
        raise exceptions.InvalidArgument("give related_conversation or related_group, not both")
    if lifetime is not None:
        lifetime = checks.timeout(lifetime, "lifetime")
        if lifetime == 0:
            raise exceptions.InvalidArgument("lifetime must be greater than 0 seconds")
    initiator = endpoints.service(session, from_service)
    # A service this broker hosts is local; another broker's is reached by route.
    is_remote = session.one("service_get", name=to_service) is None
    if is_remote and routes.remote_route(session, to_service) is None:
        raise exceptions.ServiceNotFound(
            f"service {to_service!r} does not exist here and no route leads to it",
            hint=f"create_route('...', {to_service!r}, 'tcp://host:port')",
        )
    if not session.one("contract_exists", name=contract):
        raise exceptions.ContractNotFound(f"contract {contract!r} does not exist")
    # A remote service's contracts are the far broker's to check, on arrival.
    if not is_remote and not session.one("service_accepts", name=to_service, contract=contract):
        raise exceptions.ServiceContractMismatch(
            f"service {to_service!r} does not accept contract {contract!r}",
            hint=f"alter_service({to_service!r}, add_contracts=[{contract!r}])",
        )
    queue = initiator["queue_name"]
    now = time.time()
    if related_conversation is not None:
        related = endpoints.endpoint(
            session, checks.handle(related_conversation, "related_conversation")
        )
        if related.queue_name != queue:
            raise exceptions.InvalidArgument(
                f"related conversation {related.conversation_handle} is on queue "
                f"{related.queue_name!r}, not {queue!r}"
            )
        group_id = str(related.conversation_group_id)
    elif related_group is not None:
        group_id = checks.handle(related_group, "related_group")
        existing = session.one("group_get", group_id=group_id)
        if existing and existing["queue_name"] != queue:
            raise exceptions.InvalidArgument(
                f"conversation group {group_id} belongs to queue "
                f"{existing['queue_name']!r}, not {queue!r}"
            )
    else:
        group_id = str(uuid.uuid4())
    session.execute("group_insert", group_id=group_id, queue=queue, now=now)
    handle = uuid.uuid4()
    session.execute(
        "endpoint_insert",
        handle=str(handle),
        conversation_id=str(uuid.uuid4()),
        is_initiator=True,
        service=from_service,
        far_service=to_service,
        contract=contract,
        queue=queue,
        group_id=group_id,
        state=models.EndpointState.STARTED_OUTBOUND.value,
        lifetime_expires_at=None if lifetime is None else now + lifetime,
        now=now,
        is_remote=is_remote,
    )
    session.mark_written()
    if not is_remote:
        sending.note_unsent(session, str(handle))
    return handle


def send_many(
    session: sessions.Session,
    conversation_handle: uuid.UUID | str,
    message_type: str,
    bodies: Sequence[checks.Body],
    *,
    before: tuple[str, Mapping[str, Any]] | None = None,
) -> list[int]:
    """SEND several messages of one type on one conversation, in order and atomically."""
    handle = checks.handle(conversation_handle)
    message_type = checks.name(message_type, "message type")
    if message_type in models.SYSTEM_MESSAGE_TYPES:
        raise exceptions.InvalidArgument(f"{message_type!r} is a system message type")
    if isinstance(bodies, str | bytes) or not isinstance(bodies, Sequence):
        raise exceptions.InvalidArgument(f"bodies must be a list, got {type(bodies).__name__}")
    if not bodies:
        return []
    data = [checks.body_bytes(b, session.shared.max_message_size) for b in bodies]
    first, ran = sending.many_fast(session, handle, message_type, data, before)
    if before is not None and not ran:
        session.mark_written()
        session.count(before[0], **before[1])
    if first is not None:
        return list(range(first, first + len(data)))
    # The checked path for the first message: it names what is wrong, or creates
    # the target endpoint, after which the rest usually go in one statement.
    sent = [sending.checked(session, handle, message_type, data[0])]
    rest = data[1:]
    if rest and endpoints.endpoint(session, handle).is_remote:
        # To another broker: one sequence-number update, one batch of inserts.
        return sent + sending.remote_many(session, handle, message_type, rest)
    following = sending.many_fast(session, handle, message_type, rest)[0] if rest else None
    if following is not None:
        return sent + list(range(following, following + len(rest)))
    return sent + [sending.checked(session, handle, message_type, d) for d in rest]


def get_conversation_group(
    session: sessions.Session, queue: str, timeout: float | None = None
) -> uuid.UUID | None:
    """WAITFOR (GET CONVERSATION GROUP ... FROM queue)."""
    wait = checks.timeout(timeout)
    return receiving.wait_for(
        session, queue, wait, lambda: receiving.group_once(session, queue), None
    )


def move_conversation(
    session: sessions.Session, conversation_handle: uuid.UUID | str, group: uuid.UUID | str
) -> None:
    """MOVE CONVERSATION ... TO group (within the endpoint's queue)."""
    handle = checks.handle(conversation_handle)
    group_id = checks.handle(group, "conversation group id")
    endpoint = endpoints.endpoint(session, handle)
    target = session.one("group_get", group_id=group_id)
    if target is None or target["queue_name"] != endpoint.queue_name:
        raise exceptions.ConversationGroupNotFound(
            f"conversation group {group_id} is not a group of queue {endpoint.queue_name!r}"
        )
    # Both groups' locks before any write, in group id order (two MOVEs between
    # the same groups wait for each other instead of deadlocking): a transaction
    # holding either group (RECEIVE, GET CONVERSATION GROUP) is waited for, as in
    # SQL Server. The endpoint is read again under them: it may have moved meanwhile.
    locked: set[str] = set()
    while True:
        old = str(endpoint.conversation_group_id)
        if old == group_id:
            return
        for group_to_lock in sorted({old, group_id} - locked):
            if session.scalar("group_lock", group_id=group_to_lock) is not None:
                locked.add(group_to_lock)
            elif group_to_lock == group_id:  # emptied and dropped while we waited
                raise exceptions.ConversationGroupNotFound(
                    f"conversation group {group_id} no longer exists"
                )
        endpoint = endpoints.endpoint(session, handle)
        if str(endpoint.conversation_group_id) == old:
            break
    session.execute("endpoint_move", handle=handle, group_id=group_id)
    session.execute("messages_move", handle=handle, group_id=group_id)
    session.execute("group_delete_if_empty", group_id=old)
    session.mark_written()


def end_conversation(
    session: sessions.Session,
    conversation_handle: uuid.UUID | str,
    error: int | None = None,
    description: str | None = None,
    *,
    cleanup: bool = False,
) -> None:
    """END CONVERSATION [WITH ERROR = code DESCRIPTION = text | WITH CLEANUP]."""
    handle = checks.handle(conversation_handle)
    if error is not None:
        if isinstance(error, bool) or not isinstance(error, int) or error <= 0:
            raise exceptions.InvalidArgument(f"error must be a positive integer, got {error!r}")
        if not isinstance(description, str) or not description:
            raise exceptions.InvalidArgument("an error needs a non-empty description")
    elif description is not None:
        raise exceptions.InvalidArgument("description is only allowed with an error code")
    session.mark_written()
    endpoint, far = lock_for_end(session, handle, cleanup=cleanup)
    if cleanup:
        endpoints.close(session, endpoint, cleanup=True)
        return
    state = endpoint.state
    if state in (models.EndpointState.DISCONNECTED_OUTBOUND, models.EndpointState.CLOSED):
        raise endpoints.state_error(endpoint, "end")
    # END cancels the endpoint's conversation timer: an ended conversation can
    # receive nothing more, so no DialogTimer may arrive for it (an endpoint
    # waiting in DISCONNECTED_OUTBOUND for the far side's END stays a while).
    session.execute("timer_clear", handle=handle)
    if endpoint.is_remote:
        sending.end_remote(session, endpoint, error, description)
        return
    if (
        state in (models.EndpointState.DISCONNECTED_INBOUND, models.EndpointState.ERROR)
        or far is None
    ):
        # The far side already ended (or never existed): we are the last to leave.
        endpoints.close(session, endpoint)
        if far is not None and far.state is models.EndpointState.DISCONNECTED_OUTBOUND:
            endpoints.close(session, far)
        return
    session.execute("messages_delete_conversation", handle=handle)
    session.execute("transmission_delete_conversation", handle=handle)
    if far.state is models.EndpointState.DISCONNECTED_OUTBOUND:
        endpoints.close(session, far)
        endpoints.close(session, endpoint)
        return
    seq = session.scalar("endpoint_take_system_sequence", handle=handle)
    if error is None:
        sending.enqueue_at(session, far, int(seq), models.END_DIALOG, None)
        far_state = models.EndpointState.DISCONNECTED_INBOUND
    else:
        body = json.dumps({"code": error, "description": description}).encode()
        # Received before the far side's messages still queued, as SQL Server
        # receives an Error (they stay receivable after it): see ERROR_SEQUENCE.
        sending.enqueue_at(session, far, models.ERROR_SEQUENCE, models.ERROR, body)
        far_state = models.EndpointState.ERROR
    session.execute(
        "endpoint_set_state", handle=str(far.conversation_handle), state=far_state.value
    )
    session.execute(
        "endpoint_set_state", handle=handle, state=models.EndpointState.DISCONNECTED_OUTBOUND.value
    )


def begin_conversation_timer(
    session: sessions.Session, conversation_handle: uuid.UUID | str, timeout: float
) -> None:
    """BEGIN CONVERSATION TIMER (a new call replaces the endpoint's timer)."""
    handle = checks.handle(conversation_handle)
    seconds = checks.timeout(timeout)
    if seconds is None:
        raise exceptions.InvalidArgument("a conversation timer needs a timeout in seconds")
    endpoint = endpoints.endpoint(session, handle)
    if endpoint.state in (models.EndpointState.CLOSED, models.EndpointState.DISCONNECTED_OUTBOUND):
        raise endpoints.state_error(endpoint, "set a timer on")
    due = time.time() + seconds
    session.execute("endpoint_set_timer", handle=handle, due=due)
    session.deadline(due)
    session.mark_written()


def conversation_endpoint(
    session: sessions.Session, conversation_handle: uuid.UUID | str
) -> models.ConversationEndpoint:
    """One endpoint (a row of ``sys.conversation_endpoints``)."""
    handle = checks.handle(conversation_handle)
    return endpoints.endpoint(session, handle)


def conversation_endpoints(session: sessions.Session) -> list[models.ConversationEndpoint]:
    """Every endpoint (``sys.conversation_endpoints``)."""
    return [models.ConversationEndpoint.from_row(r) for r in session.all("endpoint_list")]


def peek(session: sessions.Session, queue: str) -> list[models.Message]:
    """The queue's rows without receiving them (``SELECT * FROM queue``)."""
    endpoints.queue(session, queue)
    return [models.Message.from_row(r) for r in session.all("queue_peek", name=queue)]


def transmission_queue(session: sessions.Session) -> list[Mapping[str, Any]]:
    """Messages waiting to be delivered (``sys.transmission_queue``)."""
    return session.all("transmission_list")


class _LockAgain(Exception):
    """An endpoint moved, or the far side ended, while END waited for its locks."""


def lock_for_end(
    session: sessions.Session, handle: str, *, cleanup: bool = False
) -> tuple[models.ConversationEndpoint, models.ConversationEndpoint | None]:
    """Take END CONVERSATION's locks in the documented order and return the endpoint and
    its local far endpoint as read under them: the groups first — the endpoint's and, when
    END will close the far endpoint (it already ended), the far one's — in group id order,
    as RECEIVE and MOVE take groups; then both endpoint rows, initiator first. Taking a far
    group only after the endpoint rows made END deadlock with a second END of the far side
    (which holds that group and waits for the rows). When the endpoints changed meanwhile
    so that another group is needed, the row locks are given back (a savepoint) and the
    groups are locked again first. ``cleanup`` closes only this endpoint: its group only.
    """
    locked: set[str] = set()
    endpoint = endpoints.endpoint(session, handle)
    while True:
        far = None if endpoint.is_remote else endpoints.far(session, endpoint, create=False)
        for group_id in sorted(_groups_to_lock(endpoint, far, cleanup) - locked):
            session.execute("group_lock", group_id=group_id)  # gone: the re-read below tells
            locked.add(group_id)
        try:
            with session.savepoint():
                session.execute("endpoints_lock", conversation_id=str(endpoint.conversation_id))
                endpoint = endpoints.endpoint(session, handle)
                far = None if endpoint.is_remote else endpoints.far(session, endpoint, create=False)
                if not _groups_to_lock(endpoint, far, cleanup) <= locked:
                    raise _LockAgain
        except _LockAgain:
            endpoint = endpoints.endpoint(session, handle)
            continue
        return endpoint, far


def _groups_to_lock(
    endpoint: models.ConversationEndpoint, far: models.ConversationEndpoint | None, cleanup: bool
) -> set[str]:
    groups = {str(endpoint.conversation_group_id)}
    if not cleanup and far is not None and far.state is models.EndpointState.DISCONNECTED_OUTBOUND:
        groups.add(str(far.conversation_group_id))
    return groups
