"""Conversation operations of both fronts: BEGIN DIALOG, SEND, RECEIVE, END CONVERSATION
and friends. :class:`~scheduler_lib.broker.transaction.Transaction` runs them inside the
caller's transaction, :class:`~scheduler_lib.broker.broker.Broker` in their own. Each is
one line into :mod:`scheduler_lib.broker.ops.conversations`, except SEND and RECEIVE: they
choose the transaction too (one autocommit statement where the dialect has one, else a
transaction), then call :mod:`.ops.sending` and :mod:`.ops.receiving`.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from scheduler_lib.broker import exceptions, models
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.db import session as sessions
from scheduler_lib.broker.ops import conversations, leases, receiving, sending


class ConversationOperations:
    """Conversations between services, with Service Broker's guarantees."""

    def _operation(self) -> contextlib.AbstractContextManager[sessions.InTransaction]:
        raise NotImplementedError

    def _single_statement(self) -> contextlib.AbstractContextManager[sessions.InTransaction]:
        """Where one statement does the whole operation (the fast paths): the caller's
        transaction, or on the broker an autocommit one that saves BEGIN and COMMIT."""
        return self._operation()

    def _unflushed(self) -> contextlib.AbstractContextManager[sessions.InTransaction]:
        """As :meth:`_single_statement`, on the broker itself on connections whose commits
        do not wait for the WAL flush."""
        return self._single_statement()

    def begin_dialog(
        self,
        from_service: str,
        to_service: str,
        contract: str = models.DEFAULT,
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
        with self._operation() as tx:
            return conversations.begin_dialog(
                tx.session,
                from_service,
                to_service,
                contract,
                lifetime=lifetime,
                related_conversation=related_conversation,
                related_group=related_group,
            )

    def send(
        self,
        conversation_handle: uuid.UUID | str,
        message_type: str = models.DEFAULT,
        body: checks.Body = None,
        *,
        completing: leases.Lease | None = None,
        before: tuple[str, Mapping[str, Any]] | None = None,
        after: sending.SendAfter | None = None,
        durable: bool = True,
    ) -> int:
        """SEND ON CONVERSATION.

        :param conversation_handle: the sending endpoint's handle
        :param message_type: a message type of the conversation's contract that this side
            may send
        :param body: bytes, str (sent as UTF-8) or None
        :param completing: a lease this message answers: it ends with the SEND, as
            :meth:`complete` would, atomically (one statement on PostgreSQL)
        :param before: a named statement (of :meth:`Broker.use_queries`) and its binds:
            the row a layer above records with what it sends, written with the message
            or not at all. On PostgreSQL an ``INSERT ... SELECT ...`` without a FROM rides
            inside the SEND's own statement (on the broker itself a transaction of its
            own in one round trip: a connection lost before the reply raises
            :class:`ConnectionLost` with ``committing`` set, as the row can tell whether
            it went); another statement runs first in the same round trip, in a
            transaction
        :param after: with ``before``, a named ``UPDATE`` that rides at the end of that one
            statement too, written only with the message; ``after.rows`` is then the rows
            it changed, and stays ``None`` where it did not run (not on the broker itself,
            another dialect, a statement that cannot ride, the checked path): the caller
            runs it
        :param durable: ``False``: with ``before`` riding, on the broker itself, the
            statement commits without waiting for the WAL flush (the conversation's
            endpoint, whose sequence number it takes, is unlocked at once: a wave's
            answers stop queueing behind each other's flushes). A database crash may
            then lose it, with its row, within three times ``wal_writer_delay``; a
            durable commit after it (of anyone's) flushes it too, the WAL being written
            in order. Ignored where ``before`` does not ride.
        :return: the message's sequence number in the conversation
        :raises LeaseLost: when ``completing`` expired or ended meanwhile (roll back)
        :raises ConnectionLost: with ``committing`` set, when on the broker itself (not in
            a transaction) the connection was lost before the reply of a SEND that commits
            as it runs (one statement on PostgreSQL): it may have gone, and it is not sent
            again blindly (twice); a connection lost before the SEND is tried again
        :raises ConversationNotFound: for an unknown handle
        :raises ContractViolation: for a type the contract lacks or this side may not send
        :raises ConversationStateError: when the conversation was ended or is in error
        :raises InvalidMessageBody: when the body fails the type's validation
        :raises MessageTooLarge: when the body exceeds the broker's limit
        """
        handle = checks.handle(conversation_handle)
        message_type = checks.name(message_type, "message type")
        if message_type in models.SYSTEM_MESSAGE_TYPES:
            raise exceptions.InvalidArgument(
                f"{message_type!r} is a system message type",
                hint="end_conversation() sends EndDialog and Error",
            )
        if before is not None:
            # ``before`` inside the SEND's one statement, where it can ride there: a
            # transaction of its own, in one round trip (with the lease's end: a lost
            # lease writes nothing, and the transaction's way below says so)
            seq = self._send_riding(handle, message_type, body, before, completing, after, durable)
            if seq is not None:
                return seq
        if completing is not None or before is not None:
            # A transaction: a lost lease must undo the SEND, and the row goes with it
            with self._operation() as tx:
                session = tx.session
                data = checks.body_bytes(body, session.shared.max_message_size)
                lease_id = None if completing is None else completing.lease_id
                seq, ran = sending.fast(session, handle, message_type, data, lease_id, before)
                if before is not None and not ran:
                    session.mark_written()
                    session.count(before[0], **before[1])
                if seq is not None:
                    return seq
                if completing is not None:
                    leases.complete(session, completing)
                return sending.checked(session, handle, message_type, data)
        with self._single_statement() as tx:
            session = tx.session
            data = checks.body_bytes(body, session.shared.max_message_size)
            first = session.autocommit and handle in session.shared.unsent
            if session.autocommit and not first:
                session.connection()  # a refused connection did nothing: tried again
                sending.known_validation(session, message_type)  # a read: tried again too
            try:
                # a conversation's first message makes the target endpoint: not in
                # autocommit (the transaction below, still in one round trip)
                seq = None if first else sending.fast(session, handle, message_type, data)[0]
            except exceptions.ConnectionLost as exc:
                if not session.autocommit:
                    raise  # it sent nothing that committed: run again
                # lost before its reply, the message may be there: a SEND run again
                # would send it twice
                raise _may_have_gone(exc) from exc
            if seq is not None:
                return seq
        with self._operation() as tx:
            if first:
                return sending.send(tx.session, handle, message_type, data)
            return sending.checked(tx.session, handle, message_type, data)

    def _send_riding(
        self,
        handle: str,
        message_type: str,
        body: checks.Body,
        before: sending.Before,
        completing: leases.Lease | None,
        after: sending.SendAfter | None = None,
        durable: bool = True,
    ) -> int | None:
        """SEND with ``before`` inside its one statement (``Store.riding``), in autocommit
        on the broker itself, ending ``completing`` with it; ``None``: nothing was
        written, take the transaction's way (inside a transaction, another dialect, a
        statement that cannot ride, the checked path, a lost lease). Not ``durable``: on
        a connection whose commits do not wait for the WAL flush (:meth:`send`)."""
        with self._single_statement() if durable else self._unflushed() as tx:
            session = tx.session
            if not session.autocommit or handle in session.shared.unsent:
                return None  # (a first message makes the target endpoint: a transaction)
            data = checks.body_bytes(body, session.shared.max_message_size)
            session.connection()  # a refused connection did nothing: tried again
            sending.known_validation(session, message_type)  # a read: tried again too
            try:
                lease_id = None if completing is None else completing.lease_id
                seq, _ = sending.fast(session, handle, message_type, data, lease_id, before, after)
            except exceptions.ConnectionLost as exc:
                # the message and the row may both be there: the caller can tell (by
                # the row)
                raise _may_have_gone(exc) from exc
            return seq

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
        with self._operation() as tx:
            return conversations.send_many(
                tx.session, conversation_handle, message_type, bodies, before=before
            )

    def receive(
        self,
        queue: str,
        top: int = 1,
        timeout: float | None = None,
        *,
        conversation: uuid.UUID | str | None = None,
        group: uuid.UUID | str | None = None,
    ) -> list[models.Message]:
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
                try:
                    found, looked = receiving.first_look(tx.session, queue, top, handle)
                except exceptions.ConnectionLost as exc:
                    if not tx.session.autocommit or not tx.session.connected:
                        raise  # not connected: it took nothing, and is run again
                    # In autocommit the RECEIVE commits as it runs: lost before its reply,
                    # it may have taken messages, which only the caller can find again.
                    raise exceptions.ConnectionLost(str(exc), committing=True) from exc
                if found:
                    return found
        with self._operation() as tx:
            return receiving.receive(tx.session, queue, top, wait, handle, group_id, looked=looked)

    def get_conversation_group(self, queue: str, timeout: float | None = None) -> uuid.UUID | None:
        """WAITFOR (GET CONVERSATION GROUP ... FROM queue): lock the next group with
        messages until the transaction ends.

        :return: the group id, or ``None`` when the timeout passed
        """
        with self._operation() as tx:
            return conversations.get_conversation_group(tx.session, queue, timeout)

    def move_conversation(
        self, conversation_handle: uuid.UUID | str, group: uuid.UUID | str
    ) -> None:
        """MOVE CONVERSATION ... TO group (within the endpoint's queue).

        :raises ConversationGroupNotFound: when the group is not a group of that queue
        """
        with self._operation() as tx:
            conversations.move_conversation(tx.session, conversation_handle, group)

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
        with self._operation() as tx:
            conversations.end_conversation(
                tx.session, conversation_handle, error, description, cleanup=cleanup
            )

    def begin_conversation_timer(
        self, conversation_handle: uuid.UUID | str, timeout: float
    ) -> None:
        """BEGIN CONVERSATION TIMER: a ``DialogTimer`` message arrives on the local queue
        after ``timeout`` seconds, whether or not anybody is waiting. A new call replaces
        the endpoint's timer.
        """
        with self._operation() as tx:
            conversations.begin_conversation_timer(tx.session, conversation_handle, timeout)

    def conversation_endpoint(
        self, conversation_handle: uuid.UUID | str
    ) -> models.ConversationEndpoint:
        """One endpoint (a row of ``sys.conversation_endpoints``).

        :raises ConversationNotFound: for an unknown handle
        """
        with self._operation() as tx:
            return conversations.conversation_endpoint(tx.session, conversation_handle)

    def conversation_endpoints(self) -> list[models.ConversationEndpoint]:
        """Every endpoint (``sys.conversation_endpoints``)."""
        with self._operation() as tx:
            return conversations.conversation_endpoints(tx.session)

    def peek(self, queue: str) -> list[models.Message]:
        """The queue's rows without receiving them (``SELECT * FROM queue``)."""
        with self._operation() as tx:
            return conversations.peek(tx.session, queue)

    def transmission_queue(self) -> list[Mapping[str, Any]]:
        """Messages waiting to be delivered (``sys.transmission_queue``)."""
        with self._operation() as tx:
            return conversations.transmission_queue(tx.session)


def _may_have_gone(exc: exceptions.ConnectionLost) -> exceptions.ConnectionLost:
    """A connection lost on a SEND that commits as it runs (autocommit, one statement):
    it may have happened, so it is not run again blindly."""
    return exceptions.ConnectionLost(
        f"{exc} (the SEND commits as it runs: it may have happened)", committing=True
    )
