"""Catalog operations of both fronts: message types, contracts, queues, services, event
notifications, priorities. :class:`~scheduler_lib.broker.transaction.Transaction` runs them
in the caller's transaction and :class:`~scheduler_lib.broker.broker.Broker` in one of
their own; each is one line into :mod:`scheduler_lib.broker.ops.catalog`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from scheduler_lib.broker import models
from scheduler_lib.broker.db import session
from scheduler_lib.broker.ops import catalog


class CatalogOperations:
    """CREATE / ALTER / DROP of the broker's catalog objects."""

    def _operation(self) -> contextlib.AbstractContextManager[session.InTransaction]:
        raise NotImplementedError

    def create_message_type(
        self, name: str, validation: models.Validation | str = models.Validation.NONE
    ) -> None:
        """CREATE MESSAGE TYPE.

        :param name: the message type's name
        :param validation: NONE, EMPTY, WELL_FORMED_XML or JSON
        :raises AlreadyExists: if the name is taken (system message types included)
        """
        with self._operation() as tx:
            catalog.create_message_type(tx.session, name, validation)

    def alter_message_type(self, name: str, validation: models.Validation | str) -> None:
        """ALTER MESSAGE TYPE ... VALIDATION.

        :raises MessageTypeNotFound: for an unknown name
        """
        with self._operation() as tx:
            catalog.alter_message_type(tx.session, name, validation)

    def drop_message_type(self, name: str) -> None:
        """DROP MESSAGE TYPE.

        :raises MessageTypeNotFound: for an unknown name
        :raises InUse: while a contract lists it
        """
        with self._operation() as tx:
            catalog.drop_message_type(tx.session, name)

    def message_types(self) -> dict[str, models.Validation]:
        """Every message type with its validation (``sys.service_message_types``)."""
        with self._operation() as tx:
            return catalog.message_types(tx.session)

    def create_contract(self, name: str, message_types: Mapping[str, models.SentBy | str]) -> None:
        """CREATE CONTRACT.

        :param name: the contract's name
        :param message_types: each message type with who sends it: INITIATOR, TARGET or ANY
        :raises AlreadyExists: if the name is taken
        :raises MessageTypeNotFound: for an unknown message type
        """
        with self._operation() as tx:
            catalog.create_contract(tx.session, name, message_types)

    def contract(self, name: str) -> dict[str, models.SentBy]:
        """A contract's message types and who sends each.

        :raises ContractNotFound: for an unknown name
        """
        with self._operation() as tx:
            return catalog.contract(tx.session, name)

    def drop_contract(self, name: str) -> None:
        """DROP CONTRACT.

        :raises ContractNotFound: for an unknown name
        :raises InUse: while a service accepts it or a conversation uses it
        """
        with self._operation() as tx:
            catalog.drop_contract(tx.session, name)

    def create_queue(
        self,
        name: str,
        *,
        status: bool = True,
        retention: bool = False,
        activation_status: bool = False,
        activation_procedure: str | None = None,
        max_queue_readers: int = 0,
        execute_as: str | None = None,
        poison_message_handling: bool = True,
        receive_aging: float | None = None,
        fair_share: float | None = None,
        eager_activation: bool = False,
    ) -> None:
        """CREATE QUEUE.

        Activation settings are stored here and acted on by activation runtimes; poison
        message handling is acted on by every transaction that receives from the queue.

        :param status: whether messages can be received (off: receivers get QueueDisabled)
        :param retention: keep the messages its endpoints receive (status 0) and send
            (status 3) until their conversation ends
        :param activation_status: whether the queue activates readers
        :param activation_procedure: dotted path of the reader callable
        :param max_queue_readers: most readers activated at once
        :param execute_as: identity recorded for activated readers
        :param poison_message_handling: turn the queue off after five consecutive rollbacks
            of transactions that received from it, and post ``BROKER_QUEUE_DISABLED``
        :param receive_aging: seconds after which a waiting message is served ahead of
            higher priority levels (oldest first); ``None`` (the default) turns aging off
        :param fair_share: serve conversations in turn rather than in arrival order: each
            message costs its conversation this many seconds of virtual time, so bursts
            of several conversations interleave (docs/broker.md, "Fair share"); ``None`` (the
            default) keeps arrival order
        :param eager_activation: start a reader per ready message at once (up to
            ``max_queue_readers``) instead of seed 000's gradual rule — for readers that
            take messages under leases (``take``), which run the messages of one
            conversation side by side: the task scheduler's targets (docs/broker.md,
            "Which rule a queue follows")
        :raises AlreadyExists: if the name is taken
        """
        with self._operation() as tx:
            catalog.create_queue(
                tx.session,
                name,
                status=status,
                retention=retention,
                activation_status=activation_status,
                activation_procedure=activation_procedure,
                max_queue_readers=max_queue_readers,
                execute_as=execute_as,
                poison_message_handling=poison_message_handling,
                receive_aging=receive_aging,
                fair_share=fair_share,
                eager_activation=eager_activation,
            )

    def alter_queue(
        self,
        name: str,
        *,
        status: bool = catalog.UNSET,
        retention: bool = catalog.UNSET,
        activation_status: bool = catalog.UNSET,
        activation_procedure: str | None = catalog.UNSET,
        max_queue_readers: int = catalog.UNSET,
        execute_as: str | None = catalog.UNSET,
        poison_message_handling: bool = catalog.UNSET,
        receive_aging: float | None = catalog.UNSET,
        fair_share: float | None = catalog.UNSET,
        eager_activation: bool = catalog.UNSET,
    ) -> models.QueueInfo:
        """ALTER QUEUE: change the given settings, keep the others.

        Turning ``status`` on delivers the messages that waited for the queue in the
        transmission queue, and is how a queue that poison message handling turned off
        comes back (its rollback count starts again from zero).

        :return: the queue's settings after the change
        :raises QueueNotFound: for an unknown name
        """
        with self._operation() as tx:
            return catalog.alter_queue(
                tx.session,
                name,
                status=status,
                retention=retention,
                activation_status=activation_status,
                activation_procedure=activation_procedure,
                max_queue_readers=max_queue_readers,
                execute_as=execute_as,
                poison_message_handling=poison_message_handling,
                receive_aging=receive_aging,
                fair_share=fair_share,
                eager_activation=eager_activation,
            )

    def queue(self, name: str) -> models.QueueInfo:
        """A queue's settings.

        :raises QueueNotFound: for an unknown name
        """
        with self._operation() as tx:
            return catalog.queue(tx.session, name)

    def queues(self) -> list[models.QueueInfo]:
        """Every queue (``sys.service_queues``)."""
        with self._operation() as tx:
            return catalog.queues(tx.session)

    def drop_queue(self, name: str) -> None:
        """DROP QUEUE.

        :raises QueueNotFound: for an unknown name
        :raises InUse: while a service is bound to it
        """
        with self._operation() as tx:
            catalog.drop_queue(tx.session, name)

    def create_service(
        self, name: str, queue: str, contracts: list[str] | tuple[str, ...] = ()
    ) -> None:
        """CREATE SERVICE ... ON QUEUE ... (contracts).

        :param contracts: contracts the service accepts as a target; an initiator-only
            service lists none
        :raises AlreadyExists: if the name is taken
        :raises QueueNotFound: for an unknown queue
        :raises ContractNotFound: for an unknown contract
        """
        with self._operation() as tx:
            catalog.create_service(tx.session, name, queue, contracts)

    def alter_service(
        self,
        name: str,
        *,
        queue: str | None = None,
        add_contracts: list[str] | tuple[str, ...] = (),
        drop_contracts: list[str] | tuple[str, ...] = (),
    ) -> None:
        """ALTER SERVICE: move it to another queue (its conversations and messages follow)
        and/or add and drop accepted contracts.

        :raises ServiceNotFound, QueueNotFound, ContractNotFound: for unknown names
        """
        with self._operation() as tx:
            catalog.alter_service(
                tx.session,
                name,
                queue=queue,
                add_contracts=add_contracts,
                drop_contracts=drop_contracts,
            )

    def service(self, name: str) -> dict[str, Any]:
        """A service: its queue and the contracts it accepts.

        :raises ServiceNotFound: for an unknown name
        """
        with self._operation() as tx:
            return catalog.service(tx.session, name)

    def services(self) -> list[Mapping[str, Any]]:
        """Every service with its queue."""
        with self._operation() as tx:
            return catalog.services(tx.session)

    def drop_service(self, name: str) -> None:
        """DROP SERVICE.

        :raises ServiceNotFound: for an unknown name
        :raises InUse: while conversations of the service exist
        """
        with self._operation() as tx:
            catalog.drop_service(tx.session, name)

    def create_event_notification(
        self, name: str, queue: str, to_service: str, event_type: str = "QUEUE_ACTIVATION"
    ) -> None:
        """CREATE EVENT NOTIFICATION name ON QUEUE queue FOR event_type TO SERVICE to_service.

        Events arrive as ``EventNotification`` messages (a JSON body with ``EventType``,
        ``PostTime``, ``DatabaseName``, ``ObjectName``) on a dialog of contract
        ``PostEventNotification``, which ``to_service`` must accept.

        :param event_type: ``QUEUE_ACTIVATION`` (the queue needs a reader),
            ``BROKER_QUEUE_DISABLED`` (poison message handling turned the queue off) or
            ``POISON_MESSAGE`` (a poison policy with ``Notify`` routed a message)
        :raises AlreadyExists: for a taken name
        :raises QueueNotFound, ServiceNotFound: for unknown names
        :raises ServiceContractMismatch: when ``to_service`` does not accept the contract
        """
        with self._operation() as tx:
            catalog.create_event_notification(tx.session, name, queue, to_service, event_type)

    def drop_event_notification(self, name: str) -> None:
        """DROP EVENT NOTIFICATION.

        :raises NotFound: for an unknown name
        """
        with self._operation() as tx:
            catalog.drop_event_notification(tx.session, name)

    def event_notifications(self) -> list[Mapping[str, Any]]:
        """Every event notification."""
        with self._operation() as tx:
            return catalog.event_notifications(tx.session)

    def activated_tasks(self) -> list[Mapping[str, Any]]:
        """Readers running now (``sys.dm_broker_activated_tasks``)."""
        with self._operation() as tx:
            return catalog.activated_tasks(tx.session)

    def queue_monitors(self) -> list[Mapping[str, Any]]:
        """Queue monitors with their state, last empty RECEIVE, readers running and
        messages ready (``sys.dm_broker_queue_monitors``)."""
        with self._operation() as tx:
            return catalog.queue_monitors(tx.session)

    def create_priority(
        self,
        name: str,
        *,
        contract: str | None = models.ANY,
        local_service: str | None = models.ANY,
        remote_service: str | None = models.ANY,
        level: int = catalog.DEFAULT_PRIORITY_LEVEL,
    ) -> None:
        """CREATE BROKER PRIORITY.

        An endpoint takes its level when it is created, from the most specific priority
        that matches it (contract+local+remote, contract+local, contract+remote,
        contract, local+remote, local, remote), else 5. Local and remote are from that
        endpoint's side: for the initiator endpoint the local service is the initiator.

        :param contract: a contract, or ``ANY`` (``None``)
        :param local_service: a service of this broker, or ``ANY``
        :param remote_service: the far service's name (it may live on another broker), or
            ``ANY``
        :param level: 1 (lowest) to 10 (highest)
        :raises AlreadyExists: for a taken name, or a priority with the same three names
        """
        with self._operation() as tx:
            catalog.create_priority(
                tx.session,
                name,
                contract=contract,
                local_service=local_service,
                remote_service=remote_service,
                level=level,
            )

    def alter_priority(
        self,
        name: str,
        *,
        contract: str | None = catalog.UNSET,
        local_service: str | None = catalog.UNSET,
        remote_service: str | None = catalog.UNSET,
        level: int = catalog.UNSET,
    ) -> models.ConversationPriority:
        """ALTER BROKER PRIORITY: change what is given (``None`` sets ``ANY``). Existing
        endpoints keep their level; only endpoints created afterwards see the change.

        :raises NotFound: for an unknown name
        """
        with self._operation() as tx:
            return catalog.alter_priority(
                tx.session,
                name,
                contract=contract,
                local_service=local_service,
                remote_service=remote_service,
                level=level,
            )

    def drop_priority(self, name: str) -> None:
        """DROP BROKER PRIORITY (existing endpoints keep their level).

        :raises NotFound: for an unknown name
        """
        with self._operation() as tx:
            catalog.drop_priority(tx.session, name)

    def conversation_priorities(self) -> list[models.ConversationPriority]:
        """Every priority (``sys.conversation_priorities``)."""
        with self._operation() as tx:
            return catalog.conversation_priorities(tx.session)

    def set_honor_broker_priority(self, honor: bool) -> None:
        """ALTER DATABASE ... SET HONOR_BROKER_PRIORITY: whether the transmission queue
        sends higher levels first (RECEIVE always honours levels)."""
        with self._operation() as tx:
            catalog.set_honor_broker_priority(tx.session, honor)

    def honor_broker_priority(self) -> bool:
        """Whether the transmission queue honours priority levels."""
        with self._operation() as tx:
            return catalog.honor_broker_priority(tx.session)
