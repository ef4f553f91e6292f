"""Poison policies, failure records and the poison-message log: the operations of both
fronts (``Broker``, ``Transaction``), each one line into
:mod:`scheduler_lib.broker.ops.poison`. The policy types and the seed's detector are
:mod:`scheduler_lib.broker.poison` (a client of the fronts, as activation is)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from scheduler_lib.broker import models
from scheduler_lib.broker.db import session
from scheduler_lib.broker.ops import poison as poisoning

__all__ = ["PoisonOperations"]


class PoisonOperations:
    """Poison policies, the poison-message log and failure records: each one line into
    :mod:`scheduler_lib.broker.ops.poison`."""

    def _operation(self) -> contextlib.AbstractContextManager[session.InTransaction]:
        raise NotImplementedError

    def set_poison_policy(self, queue: str, policy: poisoning.PoisonPolicy | None) -> None:
        """Store the queue's poison policy (``None``: back to the default); every process
        that handles the queue's failures reads it.

        :raises QueueNotFound: for an unknown queue
        :raises InvalidArgument: for a Notify callback that is not a dotted path
        """
        with self._operation() as tx:
            poisoning.set_poison_policy(tx.session, queue, policy)

    def poison_policy(self, queue: str) -> poisoning.PoisonPolicy:
        """The queue's poison policy (the default when none is stored).

        :raises QueueNotFound: for an unknown queue
        """
        with self._operation() as tx:
            return poisoning.poison_policy(tx.session, queue)

    def record_failure(
        self,
        message: models.Message,
        error: BaseException | str | None = None,
        *,
        worker: str | None = None,
    ) -> poisoning.History:
        """Record that handling ``message`` failed. Call it *after* the failed transaction
        rolled back (the record must outlive it), as the seed does.

        :return: the message's history including this failure
        """
        with self._operation() as tx:
            return poisoning.record_failure(tx.session, message, error, worker=worker)

    def failure_history(self, message: models.Message) -> poisoning.History:
        """How often ``message`` failed since it last came back from the holding queue."""
        with self._operation() as tx:
            return poisoning.failure_history(tx.session, message)

    def forget_failures(self, message: models.Message) -> int:
        """Delete ``message``'s failure records (a hand-written loop calls it once the
        message was handled; the detector does it itself).

        :return: how many records were deleted
        """
        with self._operation() as tx:
            return poisoning.forget_failures(tx.session, message)

    def poison_incidents(
        self, conversation_handle: uuid.UUID | str, message_sequence_number: int
    ) -> list[Mapping[str, Any]]:
        """Every failure and parking recorded for one message, oldest first."""
        with self._operation() as tx:
            return poisoning.poison_incidents(
                tx.session, conversation_handle, message_sequence_number
            )

    def poison_messages(
        self, queue: str | None = None, state: str | None = None
    ) -> list[poisoning.PoisonMessage]:
        """Poison messages LOGGED for an operator or PARKED in the holding queue."""
        with self._operation() as tx:
            return poisoning.poison_messages(tx.session, queue, state)

    def poison_message(self, poison_id: int) -> poisoning.PoisonMessage:
        """One poison message.

        :raises NotFound: for an unknown id
        """
        with self._operation() as tx:
            return poisoning.poison_message(tx.session, poison_id)

    def replay_poison_messages(self, poison_ids: Iterable[int]) -> int:
        """Put exactly these poison messages back on their queues, on their conversations,
        with their sequence numbers, and forget their failures. All or none.

        :return: how many were re-queued
        :raises NotFound: for an unknown id
        :raises ConversationNotFound: when a message's conversation has ended
        """
        with self._operation() as tx:
            return poisoning.replay_poison_messages(tx.session, poison_ids)

    def drop_poison_messages(self, poison_ids: Iterable[int]) -> int:
        """Delete exactly these poison messages for good, with their failure records.
        All or none.

        :raises NotFound: for an unknown id
        """
        with self._operation() as tx:
            return poisoning.drop_poison_messages(tx.session, poison_ids)
