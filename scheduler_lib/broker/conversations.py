"""Conversation operations: BEGIN DIALOG, SEND, RECEIVE, END CONVERSATION and friends.

Written once as a mixin, like the catalog: run inside the caller's transaction by
:class:`~scheduler_lib.broker.transaction.Transaction`, in their own by
:class:`~scheduler_lib.broker.broker.Broker`.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from scheduler_lib.broker import exceptions
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.models import (
    DEFAULT,
    END_DIALOG,
    ERROR,
    ERROR_SEQUENCE,
    SYSTEM_MESSAGE_TYPES,
    ConversationEndpoint,
    EndpointState,
    Message,
)
from scheduler_lib.broker.ops import endpoints, receiving, routes, sending

if TYPE_CHECKING:
    from scheduler_lib.broker.leases import Lease
    from scheduler_lib.broker.transaction import Transaction


class ConversationOperations:
    """Conversations between services, with Service Broker's guarantees."""

    def _operation(self) -> contextlib.AbstractContextManager[Transaction]:
        raise NotImplementedError

    def _single_statement(self) -> contextlib.AbstractContextManager[Transaction]:
        """Where one statement does the whole operation (the fast paths): the caller's
        transaction, or on the broker an autocommit one that saves BEGIN and COMMIT."""
        return self._operation()

    def begin_dialog(
        self,
        from_service: str,
        to_service: str,
        contract: str = DEFAULT,
        *,
        lifetime: float | None = None,
        related_conversation: uuid.UUID | str | None = None,
        related_group: uuid.UUID | str | None = None,
    ) -> uuid.UUID:
        """BEGIN DIALOG CONVERSATION.

        Creates the initiator endpoint now; the target endpoint appears with the first
        message.

        :param from_service: the initiating service
        :param to_service: the target service; it must accept ``contract``
        :param contract: the contract the conversation follows
        :param lifetime: seconds after which both sides get an ``Error`` and sends fail
        :param related_conversation: join that conversation's group
        :param related_group: join (or create) the group with this id
        :return: the initiator's conversation handle
        """
        if related_conversation is not None and related_group is not None:
            raise exceptions.InvalidArgument("give related_conversation or related_group, not both")
        if lifetime is not None:
            lifetime = checks.timeout(lifetime, "lifetime")
            if lifetime == 0:
                raise exceptions.InvalidArgument("lifetime must be greater than 0 seconds")
        with self._operation() as tx:
            initiator = endpoints.service(tx.session, from_service)
            # A service this broker hosts is local; another broker's is reached by route.
            is_remote = tx.session.one("service_get", name=to_service) is None
            if is_remote and routes.remote_route(tx.session, to_service) is None:
                raise exceptions.ServiceNotFound(
                    f"service {to_service!r} does not exist here and no route leads to it",
                    hint=f"create_route('...', {to_service!r}, 'tcp://host:port')",
                )
            if not tx.session.one("contract_exists", name=contract):
                raise exceptions.ContractNotFound(f"contract {contract!r} does not exist")
            # A remote service's contracts are the far broker's to check, on arrival.
            if not is_remote and not tx.session.one(
                "service_accepts", name=to_service, contract=contract
            ):
                raise exceptions.ServiceContractMismatch(
                    f"service {to_service!r} does not accept contract {contract!r}",
                    hint=f"alter_service({to_service!r}, add_contracts=[{contract!r}])",
                )
            queue = initiator["queue_name"]
            now = time.time()
            if related_conversation is not None:
                related = endpoints.endpoint(
                    tx.session, checks.handle(related_conversation, "related_conversation")
                )
                if related.queue_name != queue:
                    raise exceptions.InvalidArgument(
                        f"related conversation {related.conversation_handle} is on queue "
                        f"{related.queue_name!r}, not {queue!r}"
                    )
                group_id = str(related.conversation_group_id)
            elif related_group is not None:
                group_id = checks.handle(related_group, "related_group")
                existing = tx.session.one("group_get", group_id=group_id)
                if existing and existing["queue_name"] != queue:
                    raise exceptions.InvalidArgument(
                        f"conversation group {group_id} belongs to queue "
                        f"{existing['queue_name']!r}, not {queue!r}"
                    )
            else:
                group_id = str(uuid.uuid4())
            tx.session.execute("group_insert", group_id=group_id, queue=queue, now=now)
            handle = uuid.uuid4()
            tx.session.execute(
                "endpoint_insert",
                handle=str(handle),
                conversation_id=str(uuid.uuid4()),
                is_initiator=True,
                service=from_service,
                far_service=to_service,
                contract=contract,
                queue=queue,
                group_id=group_id,
                state=EndpointState.STARTED_OUTBOUND.value,
                lifetime_expires_at=None if lifetime is None else now + lifetime,
                now=now,
                is_remote=is_remote,
            )
            tx.session.mark_written()
            return handle

    def send(
        self,
        conversation_handle: uuid.UUID | str,
        message_type: str = DEFAULT,
        body: checks.Body = None,
        *,
        completing: Lease | None = None,
        before: tuple[str, Mapping[str, Any]] | None = None,
    ) -> int:
        """SEND ON CONVERSATION.

        :param conversation_handle: the sending endpoint's handle
        :param message_type: a message type of the conversation's contract that this side
            may send
        :param body: bytes, str (sent as UTF-8) or None
        :param completing: a lease this message answers: it ends with the SEND, as
            :meth:`complete` would, atomically (one statement on PostgreSQL)
        :param before: a named statement (of :meth:`Broker.use_queries`) and its binds to
            run first, in the same transaction — on PostgreSQL in the same round trip as
            the SEND: the row a layer above records with what it sends
        :return: the message's sequence number in the conversation
        :raises LeaseLost: when ``completing`` expired or ended meanwhile (roll back)
        :raises ConversationNotFound: for an unknown handle
        :raises ContractViolation: for a type the contract lacks or this side may not send
        :raises ConversationStateError: when the conversation was ended or is in error
        :raises InvalidMessageBody: when the body fails the type's validation
        :raises MessageTooLarge: when the body exceeds the broker's limit
        """
        handle = checks.handle(conversation_handle)
        message_type = checks.name(message_type, "message type")
        if message_type in SYSTEM_MESSAGE_TYPES:
            raise exceptions.InvalidArgument(
                f"{message_type!r} is a system message type",
                hint="end_conversation() sends EndDialog and Error",
            )
        if completing is not None or before is not None:
            # A transaction: a lost lease must undo the SEND, and the row goes with it
            with self._operation() as tx:
                data = checks.body_bytes(body, tx.broker.max_message_size)
                lease_id = None if completing is None else completing.lease_id
                seq, ran = sending.fast(tx.session, handle, message_type, data, lease_id, before)
                if before is not None and not ran:
                    tx.run(before[0], **before[1])
                if seq is not None:
                    return seq
                if completing is not None:
                    tx.complete(completing)
                return sending.checked(tx.session, handle, message_type, data)
        with self._single_statement() as tx:
            data = checks.body_bytes(body, tx.broker.max_message_size)
            seq, _ = sending.fast(tx.session, handle, message_type, data)
            if seq is not None:
                return seq
        with self._operation() as tx:
            return sending.checked(tx.session, handle, message_type, data)

    def send_many(
        self,
        conversation_handle: uuid.UUID | str,
        message_type: str,
        bodies: Sequence[checks.Body],
        *,
        before: tuple[str, Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """SEND several messages of one type on one conversation, in order and atomically
        (one statement on PostgreSQL once both endpoints exist).

        :param before: a named statement (of :meth:`Broker.use_queries`) and its binds to
            run first, in the same transaction — on PostgreSQL in the same round trip as
            the SEND: the rows a layer above records with what it sends
        :return: their sequence numbers
        :raises: as :meth:`send`, for the first message that cannot be sent (then none is)
        """
        handle = checks.handle(conversation_handle)
        message_type = checks.name(message_type, "message type")
        if message_type in SYSTEM_MESSAGE_TYPES:
            raise exceptions.InvalidArgument(f"{message_type!r} is a system message type")
        if isinstance(bodies, str | bytes) or not isinstance(bodies, Sequence):
            raise exceptions.InvalidArgument(f"bodies must be a list, got {type(bodies).__name__}")
        if not bodies:
            return []
        with self._operation() as tx:
            data = [checks.body_bytes(b, tx.broker.max_message_size) for b in bodies]
            first, ran = sending.many_fast(tx.session, handle, message_type, data, before)
            if before is not None and not ran:
                tx.run(before[0], **before[1])
            if first is not None:
                return list(range(first, first + len(data)))
            # The checked path for the first message: it names what is wrong, or creates
            # the target endpoint, after which the rest usually go in one statement.
            sent = [sending.checked(tx.session, handle, message_type, data[0])]
            rest = data[1:]
            if rest and endpoints.endpoint(tx.session, handle).is_remote:
                # To another broker: one sequence-number update, one batch of inserts.
                return sent + sending.remote_many(tx.session, handle, message_type, rest)
            following = (
                sending.many_fast(tx.session, handle, message_type, rest)[0] if rest else None
            )
            if following is not None:
                return sent + list(range(following, following + len(rest)))
            return sent + [sending.checked(tx.session, handle, message_type, d) for d in rest]

    def receive(
        self,
        queue: str,
        top: int = 1,
        timeout: float | None = None,
        *,
        conversation: uuid.UUID | str | None = None,
        group: uuid.UUID | str | None = None,
    ) -> list[Message]:
        """WAITFOR (RECEIVE TOP (n) ... FROM queue), TIMEOUT t.

        Returns messages of one conversation group, locked until the transaction ends:
        without a filter the highest-priority group nobody else holds; inside it,
        conversations by priority, then sequence order.

        :param queue: the queue to receive from
        :param top: most messages to return
        :param timeout: seconds to wait for messages; ``None`` waits forever, 0 not at all
        :param conversation: only this conversation's messages
        :param group: only this conversation group's messages
        :return: the messages, or ``[]`` when the timeout passed
        :raises QueueNotFound: for an unknown queue
        :raises QueueDisabled: when the queue is off, also while waiting
        """
        top = checks.positive_int(top, "top")
        wait = checks.timeout(timeout)
        if conversation is not None and group is not None:
            raise exceptions.InvalidArgument("give conversation or group, not both")
        handle = None if conversation is None else checks.handle(conversation)
        group_id = None if group is None else checks.handle(group, "conversation group id")
        looked = None
        if group_id is None:
            with self._single_statement() as tx:
                seen = tx.broker._wakeups.generation(queue)
                try:
                    found = receiving.fast(tx.session, queue, top, handle)
                except exceptions.ConnectionLost as exc:
                    if not tx.session.autocommit or not tx.session.connected:
                        raise  # not connected: it took nothing, and is run again
                    # In autocommit the RECEIVE commits as it runs: lost before its reply,
                    # it may have taken messages, which only the caller can find again.
                    raise exceptions.ConnectionLost(str(exc), committing=True) from exc
                if found:
                    tx.session.received_from(queue)
                    return found
                if tx.session.store.features.one_statement_receive:
                    looked = seen  # that look ran: the wait need not repeat it
        with self._operation() as tx:
            return receiving.wait_for(
                tx.session,
                queue,
                wait,
                lambda: receiving.look(tx.session, queue, top, handle, group_id),
                [],
                unfiltered=handle is None and group_id is None,
                looked=None
                if looked is None
                else (
                    looked,
                    lambda: receiving.look(tx.session, queue, top, handle, None, fast_looked=True),
                ),
            )

    def get_conversation_group(self, queue: str, timeout: float | None = None) -> uuid.UUID | None:
        """WAITFOR (GET CONVERSATION GROUP ... FROM queue): lock the next group with
        messages until the transaction ends.

        :return: the group id, or ``None`` when the timeout passed
        """
        wait = checks.timeout(timeout)
        with self._operation() as tx:
            return receiving.wait_for(
                tx.session, queue, wait, lambda: receiving.group_once(tx.session, queue), None
            )

    def move_conversation(
        self, conversation_handle: uuid.UUID | str, group: uuid.UUID | str
    ) -> None:
        """MOVE CONVERSATION ... TO group (within the endpoint's queue).

        :raises ConversationGroupNotFound: when the group is not a group of that queue
        """
        handle = checks.handle(conversation_handle)
        group_id = checks.handle(group, "conversation group id")
        with self._operation() as tx:
            endpoint = endpoints.endpoint(tx.session, handle)
            target = tx.session.one("group_get", group_id=group_id)
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
                    if tx.session.scalar("group_lock", group_id=group_to_lock) is not None:
                        locked.add(group_to_lock)
                    elif group_to_lock == group_id:  # emptied and dropped while we waited
                        raise exceptions.ConversationGroupNotFound(
                            f"conversation group {group_id} no longer exists"
                        )
                endpoint = endpoints.endpoint(tx.session, handle)
                if str(endpoint.conversation_group_id) == old:
                    break
            tx.session.execute("endpoint_move", handle=handle, group_id=group_id)
            tx.session.execute("messages_move", handle=handle, group_id=group_id)
            tx.session.execute("group_delete_if_empty", group_id=old)
            tx.session.mark_written()

    def end_conversation(
        self,
        conversation_handle: uuid.UUID | str,
        error: int | None = None,
        description: str | None = None,
        *,
        cleanup: bool = False,
    ) -> None:
        """END CONVERSATION [WITH ERROR = code DESCRIPTION = text | WITH CLEANUP].

        Removes the conversation's messages from the local queue and tells the far side
        with ``EndDialog`` (or ``Error``); the far side must end its endpoint too. With
        ``cleanup`` the local endpoint just disappears and nobody is told.

        :raises ConversationNotFound: for an unknown (or already closed) handle
        :raises ConversationStateError: when this side already ended it
        """
        handle = checks.handle(conversation_handle)
        if error is not None:
            if isinstance(error, bool) or not isinstance(error, int) or error <= 0:
                raise exceptions.InvalidArgument(f"error must be a positive integer, got {error!r}")
            if not isinstance(description, str) or not description:
                raise exceptions.InvalidArgument("an error needs a non-empty description")
        elif description is not None:
            raise exceptions.InvalidArgument("description is only allowed with an error code")
        with self._operation() as tx:
            tx.session.mark_written()
            endpoint, far = lock_for_end(tx, handle, cleanup=cleanup)
            if cleanup:
                endpoints.close(tx.session, endpoint, cleanup=True)
                return
            state = endpoint.state
            if state in (EndpointState.DISCONNECTED_OUTBOUND, EndpointState.CLOSED):
                raise endpoints.state_error(endpoint, "end")
            # END cancels the endpoint's conversation timer: an ended conversation can
            # receive nothing more, so no DialogTimer may arrive for it (an endpoint
            # waiting in DISCONNECTED_OUTBOUND for the far side's END stays a while).
            tx.session.execute("timer_clear", handle=handle)
            if endpoint.is_remote:
                sending.end_remote(tx.session, endpoint, error, description)
                return
            if state in (EndpointState.DISCONNECTED_INBOUND, EndpointState.ERROR) or far is None:
                # The far side already ended (or never existed): we are the last to leave.
                endpoints.close(tx.session, endpoint)
                if far is not None and far.state is EndpointState.DISCONNECTED_OUTBOUND:
                    endpoints.close(tx.session, far)
                return
            tx.session.execute("messages_delete_conversation", handle=handle)
            tx.session.execute("transmission_delete_conversation", handle=handle)
            if far.state is EndpointState.DISCONNECTED_OUTBOUND:
                endpoints.close(tx.session, far)
                endpoints.close(tx.session, endpoint)
                return
            seq = tx.session.scalar("endpoint_take_system_sequence", handle=handle)
            if error is None:
                sending.enqueue_at(tx.session, far, int(seq), END_DIALOG, None)
                far_state = EndpointState.DISCONNECTED_INBOUND
            else:
                body = json.dumps({"code": error, "description": description}).encode()
                # Received before the far side's messages still queued, as SQL Server
                # receives an Error (they stay receivable after it): see ERROR_SEQUENCE.
                sending.enqueue_at(tx.session, far, ERROR_SEQUENCE, ERROR, body)
                far_state = EndpointState.ERROR
            tx.session.execute(
                "endpoint_set_state", handle=str(far.conversation_handle), state=far_state.value
            )
            tx.session.execute(
                "endpoint_set_state", handle=handle, state=EndpointState.DISCONNECTED_OUTBOUND.value
            )

    def begin_conversation_timer(
        self, conversation_handle: uuid.UUID | str, timeout: float
    ) -> None:
        """BEGIN CONVERSATION TIMER: a ``DialogTimer`` message arrives on the local queue
        after ``timeout`` seconds, whether or not anybody is waiting. A new call replaces
        the endpoint's timer.
        """
        handle = checks.handle(conversation_handle)
        seconds = checks.timeout(timeout)
        if seconds is None:
            raise exceptions.InvalidArgument("a conversation timer needs a timeout in seconds")
        with self._operation() as tx:
            endpoint = endpoints.endpoint(tx.session, handle)
            if endpoint.state in (EndpointState.CLOSED, EndpointState.DISCONNECTED_OUTBOUND):
                raise endpoints.state_error(endpoint, "set a timer on")
            due = time.time() + seconds
            tx.session.execute("endpoint_set_timer", handle=handle, due=due)
            tx.session.deadline(due)
            tx.session.mark_written()

    def conversation_endpoint(self, conversation_handle: uuid.UUID | str) -> ConversationEndpoint:
        """One endpoint (a row of ``sys.conversation_endpoints``).

        :raises ConversationNotFound: for an unknown handle
        """
        handle = checks.handle(conversation_handle)
        with self._operation() as tx:
            return endpoints.endpoint(tx.session, handle)

    def conversation_endpoints(self) -> list[ConversationEndpoint]:
        """Every endpoint (``sys.conversation_endpoints``)."""
        with self._operation() as tx:
            return [ConversationEndpoint.from_row(r) for r in tx.session.all("endpoint_list")]

    def peek(self, queue: str) -> list[Message]:
        """The queue's rows without receiving them (``SELECT * FROM queue``)."""
        with self._operation() as tx:
            endpoints.queue(tx.session, queue)
            return [Message.from_row(r) for r in tx.session.all("queue_peek", name=queue)]

    def transmission_queue(self) -> list[Mapping[str, Any]]:
        """Messages waiting to be delivered (``sys.transmission_queue``)."""
        with self._operation() as tx:
            return tx.session.all("transmission_list")


class _LockAgain(Exception):
    """An endpoint moved, or the far side ended, while END waited for its locks."""


def lock_for_end(
    tx: Transaction, handle: str, *, cleanup: bool = False
) -> tuple[ConversationEndpoint, ConversationEndpoint | None]:
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
    endpoint = endpoints.endpoint(tx.session, handle)
    while True:
        far = None if endpoint.is_remote else endpoints.far(tx.session, endpoint, create=False)
        for group_id in sorted(_groups_to_lock(endpoint, far, cleanup) - locked):
            tx.session.execute("group_lock", group_id=group_id)  # gone: the re-read below tells
            locked.add(group_id)
        try:
            with tx.savepoint():
                tx.session.execute("endpoints_lock", conversation_id=str(endpoint.conversation_id))
                endpoint = endpoints.endpoint(tx.session, handle)
                far = (
                    None
                    if endpoint.is_remote
                    else endpoints.far(tx.session, endpoint, create=False)
                )
                if not _groups_to_lock(endpoint, far, cleanup) <= locked:
                    raise _LockAgain
        except _LockAgain:
            endpoint = endpoints.endpoint(tx.session, handle)
            continue
        return endpoint, far


def _groups_to_lock(
    endpoint: ConversationEndpoint, far: ConversationEndpoint | None, cleanup: bool
) -> set[str]:
    groups = {str(endpoint.conversation_group_id)}
    if not cleanup and far is not None and far.state is EndpointState.DISCONNECTED_OUTBOUND:
        groups.add(str(far.conversation_group_id))
    return groups
