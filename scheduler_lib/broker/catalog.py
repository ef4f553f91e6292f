"""Catalog operations: message types, contracts, queues, services.

Written once as a mixin; :class:`~scheduler_lib.broker.transaction.Transaction` runs them
in the caller's transaction and :class:`~scheduler_lib.broker.broker.Broker` in one of
their own.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from scheduler_lib.broker import arrival, exceptions
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.models import (
    ANY,
    SYSTEM_MESSAGE_TYPES,
    ConversationPriority,
    QueueInfo,
    SentBy,
    Validation,
)
from scheduler_lib.broker.ops import endpoints

if TYPE_CHECKING:
    from scheduler_lib.broker.transaction import Transaction

_UNSET: Any = object()
DEFAULT_PRIORITY_LEVEL = 5  # level of an endpoint no priority matches
EVENT_MESSAGE_TYPE = "EventNotification"  # what event notifications travel as
EVENT_CONTRACT = "PostEventNotification"
EVENT_SERVICE = "EventNotificationService"  # the broker's end of event dialogs
EVENT_QUEUE = "EventNotificationQueue"
EVENT_TYPES = ("QUEUE_ACTIVATION", "BROKER_QUEUE_DISABLED", "POISON_MESSAGE")


def _enum(enum_type: Any, value: Any, what: str) -> Any:
    try:
        return enum_type(value.upper() if isinstance(value, str) else value)
    except ValueError:
        allowed = ", ".join(member.value for member in enum_type)
        raise exceptions.InvalidArgument(
            f"{what} must be one of {allowed}; got {value!r}"
        ) from None


class CatalogOperations:
    """CREATE / ALTER / DROP of the broker's catalog objects."""

    def _operation(self) -> contextlib.AbstractContextManager[Transaction]:
        raise NotImplementedError

    # --- message types ---------------------------------------------------------------

    def create_message_type(
        self, name: str, validation: Validation | str = Validation.NONE
    ) -> None:
        """CREATE MESSAGE TYPE.

        :param name: the message type's name
        :param validation: NONE, EMPTY, WELL_FORMED_XML or JSON
        :raises AlreadyExists: if the name is taken (system message types included)
        """
        name = checks.name(name, "message type name")
        checked = _enum(Validation, validation, "validation")
        if name in SYSTEM_MESSAGE_TYPES:
            raise exceptions.AlreadyExists(f"{name!r} is a system message type")
        with self._operation() as tx:
            if tx.session.one("message_type_get", name=name):
                raise exceptions.AlreadyExists(f"message type {name!r} already exists")
            tx.session.execute(
                "message_type_insert", name=name, validation=checked.value, now=time.time()
            )

    def alter_message_type(self, name: str, validation: Validation | str) -> None:
        """ALTER MESSAGE TYPE ... VALIDATION.

        :raises MessageTypeNotFound: for an unknown name
        """
        checked = _enum(Validation, validation, "validation")
        with self._operation() as tx:
            if (
                tx.session.count("message_type_set_validation", name=name, validation=checked.value)
                == 0
            ):
                raise exceptions.MessageTypeNotFound(f"message type {name!r} does not exist")

    def drop_message_type(self, name: str) -> None:
        """DROP MESSAGE TYPE.

        :raises MessageTypeNotFound: for an unknown name
        :raises InUse: while a contract lists it
        """
        with self._operation() as tx:
            if not tx.session.one("message_type_get", name=name):
                raise exceptions.MessageTypeNotFound(f"message type {name!r} does not exist")
            users = [
                r["contract_name"] for r in tx.session.all("message_type_contracts", name=name)
            ]
            if users:
                raise exceptions.InUse(
                    f"message type {name!r} is used by contracts {users}", hint="drop them first"
                )
            tx.session.execute("message_type_delete", name=name)

    def message_types(self) -> dict[str, Validation]:
        """Every message type with its validation (``sys.service_message_types``)."""
        with self._operation() as tx:
            return {
                r["message_type_name"]: Validation(r["validation"])
                for r in tx.session.all("message_type_list")
            }

    # --- contracts -------------------------------------------------------------------

    def create_contract(self, name: str, message_types: Mapping[str, SentBy | str]) -> None:
        """CREATE CONTRACT.

        :param name: the contract's name
        :param message_types: each message type with who sends it: INITIATOR, TARGET or ANY
        :raises AlreadyExists: if the name is taken
        :raises MessageTypeNotFound: for an unknown message type
        """
        name = checks.name(name, "contract name")
        if not isinstance(message_types, Mapping):
            raise exceptions.InvalidArgument(
                f"contract {name!r}: message_types must map each message type to who sends it "
                f"(INITIATOR, TARGET or ANY), got {type(message_types).__name__}"
            )
        if not message_types:
            raise exceptions.InvalidArgument(f"contract {name!r} needs at least one message type")
        checked = {
            checks.name(mt, "message type name"): _enum(SentBy, by, f"sent_by of {mt!r}")
            for mt, by in message_types.items()
        }
        with self._operation() as tx:
            if tx.session.one("contract_exists", name=name):
                raise exceptions.AlreadyExists(f"contract {name!r} already exists")
            for mt in checked:
                if mt in SYSTEM_MESSAGE_TYPES:
                    raise exceptions.InvalidArgument(
                        f"system message type {mt!r} cannot be listed in a contract"
                    )
                if not tx.session.one("message_type_get", name=mt):
                    raise exceptions.MessageTypeNotFound(
                        f"contract {name!r} names message type {mt!r}, which does not exist"
                    )
            tx.session.execute("contract_insert", name=name, now=time.time())
            for mt, by in checked.items():
                tx.session.execute(
                    "contract_message_type_insert", contract=name, message_type=mt, sent_by=by.value
                )

    def contract(self, name: str) -> dict[str, SentBy]:
        """A contract's message types and who sends each.

        :raises ContractNotFound: for an unknown name
        """
        with self._operation() as tx:
            if not tx.session.one("contract_exists", name=name):
                raise exceptions.ContractNotFound(f"contract {name!r} does not exist")
            return {
                r["message_type_name"]: SentBy(r["sent_by"])
                for r in tx.session.all("contract_message_types", name=name)
            }

    def drop_contract(self, name: str) -> None:
        """DROP CONTRACT.

        :raises ContractNotFound: for an unknown name
        :raises InUse: while a service accepts it or a conversation uses it
        """
        with self._operation() as tx:
            if not tx.session.one("contract_exists", name=name):
                raise exceptions.ContractNotFound(f"contract {name!r} does not exist")
            services = [r["service_name"] for r in tx.session.all("contract_services", name=name)]
            if services:
                raise exceptions.InUse(f"contract {name!r} is accepted by services {services}")
            if tx.session.scalar("contract_endpoint_count", name=name):
                raise exceptions.InUse(
                    f"contract {name!r} is used by open conversations", hint="end them first"
                )
            tx.session.execute("contract_delete", name=name)

    # --- queues ----------------------------------------------------------------------

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
        settings = _queue_settings(
            name=checks.name(name, "queue name"),
            status=status,
            retention=retention,
            activation_status=activation_status,
            activation_procedure=activation_procedure,
            max_readers=max_queue_readers,
            execute_as=execute_as,
            poison_message_handling=poison_message_handling,
            receive_aging=receive_aging,
            fair_share=fair_share,
            eager_activation=eager_activation,
        )
        with self._operation() as tx:
            if tx.session.one("queue_get", name=name):
                raise exceptions.AlreadyExists(f"queue {name!r} already exists")
            tx.session.execute("queue_insert", now=time.time(), **settings)
            tx.session.catalog_changed()

    def alter_queue(
        self,
        name: str,
        *,
        status: bool = _UNSET,
        retention: bool = _UNSET,
        activation_status: bool = _UNSET,
        activation_procedure: str | None = _UNSET,
        max_queue_readers: int = _UNSET,
        execute_as: str | None = _UNSET,
        poison_message_handling: bool = _UNSET,
        receive_aging: float | None = _UNSET,
        fair_share: float | None = _UNSET,
        eager_activation: bool = _UNSET,
    ) -> QueueInfo:
        """ALTER QUEUE: change the given settings, keep the others.

        Turning ``status`` on delivers the messages that waited for the queue in the
        transmission queue, and is how a queue that poison message handling turned off
        comes back (its rollback count starts again from zero).

        :return: the queue's settings after the change
        :raises QueueNotFound: for an unknown name
        """
        with self._operation() as tx:
            current = endpoints.queue(tx.session, name)
            changes = {
                "status": status,
                "retention": retention,
                "activation_status": activation_status,
                "activation_procedure": activation_procedure,
                "max_readers": max_queue_readers,
                "execute_as": execute_as,
                "poison_message_handling": poison_message_handling,
                "receive_aging": receive_aging,
                "fair_share": fair_share,
                "eager_activation": eager_activation,
            }
            merged = {
                "status": current.is_receive_enabled,
                "retention": current.is_retention_enabled,
                "activation_status": current.is_activation_enabled,
                "activation_procedure": current.activation_procedure,
                "max_readers": current.max_readers,
                "execute_as": current.execute_as,
                "poison_message_handling": current.is_poison_message_handling_enabled,
                "receive_aging": current.receive_aging_seconds,
                "fair_share": current.fair_share_quantum,
                "eager_activation": current.is_activation_eager,
            }
            merged.update({k: v for k, v in changes.items() if v is not _UNSET})
            settings = _queue_settings(name=name, **merged)
            now = time.time()
            if settings["status"]:
                disabled_reason, disabled_at = None, None
            elif current.is_receive_enabled:
                disabled_reason, disabled_at = "turned off by alter_queue", now
            else:
                disabled_reason, disabled_at = current.disabled_reason, current.disabled_at
            tx.session.execute(
                "queue_update",
                now=now,
                disabled_reason=disabled_reason,
                disabled_at=disabled_at,
                **settings,
            )
            if settings["status"] and not current.is_receive_enabled:
                arrival.release_held(tx, name)
            tx.session.touched(name)  # waiting receivers and the monitor look again
            tx.session.catalog_changed()
            return endpoints.queue(tx.session, name)

    def queue(self, name: str) -> QueueInfo:
        """A queue's settings.

        :raises QueueNotFound: for an unknown name
        """
        with self._operation() as tx:
            return endpoints.queue(tx.session, name)

    def queues(self) -> list[QueueInfo]:
        """Every queue (``sys.service_queues``)."""
        with self._operation() as tx:
            return [QueueInfo.from_row(r) for r in tx.session.all("queue_list")]

    def drop_queue(self, name: str) -> None:
        """DROP QUEUE.

        :raises QueueNotFound: for an unknown name
        :raises InUse: while a service is bound to it
        """
        with self._operation() as tx:
            endpoints.queue(tx.session, name)
            services = [r["service_name"] for r in tx.session.all("queue_services", name=name)]
            if services:
                raise exceptions.InUse(
                    f"queue {name!r} is used by services {services}", hint="drop them first"
                )
            tx.session.execute("queue_delete", name=name)

    # --- services --------------------------------------------------------------------

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
        name = checks.name(name, "service name")
        with self._operation() as tx:
            if tx.session.one("service_get", name=name):
                raise exceptions.AlreadyExists(f"service {name!r} already exists")
            endpoints.queue(tx.session, queue)
            for contract in dict.fromkeys(contracts):
                if not tx.session.one("contract_exists", name=contract):
                    raise exceptions.ContractNotFound(
                        f"service {name!r} names contract {contract!r}, which does not exist"
                    )
            tx.session.execute("service_insert", name=name, queue=queue, now=time.time())
            for contract in dict.fromkeys(contracts):
                tx.session.execute("service_contract_insert", name=name, contract=contract)

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
            service = endpoints.service(tx.session, name)
            accepted = {r["contract_name"] for r in tx.session.all("service_contracts", name=name)}
            for contract in add_contracts:
                if not tx.session.one("contract_exists", name=contract):
                    raise exceptions.ContractNotFound(f"contract {contract!r} does not exist")
            for contract in drop_contracts:
                if contract not in accepted:
                    raise exceptions.ContractNotFound(
                        f"service {name!r} does not accept contract {contract!r}"
                    )
            if queue is not None and queue != service["queue_name"]:
                endpoints.queue(tx.session, queue)
                tx.session.execute("service_set_queue", name=name, queue=queue)
                tx.session.execute("service_move_groups", name=name, queue=queue)
                tx.session.execute("service_move_endpoints", name=name, queue=queue)
                tx.session.execute("service_move_messages", name=name, queue=queue)
                tx.session.execute("service_move_held", name=name, queue=queue)
                if endpoints.queue(tx.session, queue).is_receive_enabled:
                    arrival.release_held(tx, queue)
                tx.session.touched(queue)
            for contract in dict.fromkeys(add_contracts):
                if contract not in accepted:
                    tx.session.execute("service_contract_insert", name=name, contract=contract)
            for contract in dict.fromkeys(drop_contracts):
                tx.session.execute("service_contract_delete", name=name, contract=contract)

    def service(self, name: str) -> dict[str, Any]:
        """A service: its queue and the contracts it accepts.

        :raises ServiceNotFound: for an unknown name
        """
        with self._operation() as tx:
            row = endpoints.service(tx.session, name)
            contracts = [r["contract_name"] for r in tx.session.all("service_contracts", name=name)]
            return {"service_name": name, "queue_name": row["queue_name"], "contracts": contracts}

    def services(self) -> list[Mapping[str, Any]]:
        """Every service with its queue."""
        with self._operation() as tx:
            return tx.session.all("service_list")

    def drop_service(self, name: str) -> None:
        """DROP SERVICE.

        :raises ServiceNotFound: for an unknown name
        :raises InUse: while conversations of the service exist
        """
        with self._operation() as tx:
            endpoints.service(tx.session, name)
            if tx.session.scalar("service_endpoint_count", name=name):
                raise exceptions.InUse(
                    f"service {name!r} still has conversations", hint="end them first"
                )
            tx.session.execute("service_delete", name=name)

    # --- event notifications -----------------------------------------------------------

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
        name = checks.name(name, "event notification name")
        if event_type not in EVENT_TYPES:
            raise exceptions.InvalidArgument(
                f"event_type must be one of {', '.join(EVENT_TYPES)}, got {event_type!r}"
            )
        with self._operation() as tx:
            if tx.session.one("event_notification_get", name=name):
                raise exceptions.AlreadyExists(f"event notification {name!r} already exists")
            endpoints.queue(tx.session, queue)
            _ensure_event_catalog(tx)
            endpoints.service(tx.session, to_service)
            if not tx.session.one("service_accepts", name=to_service, contract=EVENT_CONTRACT):
                raise exceptions.ServiceContractMismatch(
                    f"service {to_service!r} does not accept contract {EVENT_CONTRACT!r}",
                    hint=f"alter_service({to_service!r}, add_contracts=[{EVENT_CONTRACT!r}])",
                )
            tx.session.execute(
                "event_notification_insert",
                name=name,
                queue=queue,
                event_type=event_type,
                to_service=to_service,
                now=time.time(),
            )
            tx.session.touched(queue)
            tx.session.catalog_changed()

    def drop_event_notification(self, name: str) -> None:
        """DROP EVENT NOTIFICATION.

        :raises NotFound: for an unknown name
        """
        with self._operation() as tx:
            if not tx.session.one("event_notification_get", name=name):
                raise exceptions.NotFound(f"event notification {name!r} does not exist")
            tx.session.execute("event_notification_delete", name=name)
            tx.session.catalog_changed()

    def event_notifications(self) -> list[Mapping[str, Any]]:
        """Every event notification."""
        with self._operation() as tx:
            return tx.session.all("event_notification_list")

    def activated_tasks(self) -> list[Mapping[str, Any]]:
        """Readers running now (``sys.dm_broker_activated_tasks``)."""
        with self._operation() as tx:
            return tx.session.all("task_list")

    def queue_monitors(self) -> list[Mapping[str, Any]]:
        """Queue monitors with their state, last empty RECEIVE, readers running and
        messages ready (``sys.dm_broker_queue_monitors``)."""
        with self._operation() as tx:
            return tx.session.all("monitor_list")

    # --- priorities ------------------------------------------------------------------

    def create_priority(
        self,
        name: str,
        *,
        contract: str | None = ANY,
        local_service: str | None = ANY,
        remote_service: str | None = ANY,
        level: int = DEFAULT_PRIORITY_LEVEL,
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
        name = checks.name(name, "priority name")
        with self._operation() as tx:
            if tx.session.one("priority_get", name=name):
                raise exceptions.AlreadyExists(f"priority {name!r} already exists")
            fields = _priority_fields(tx, name, contract, local_service, remote_service, level)
            tx.session.execute("priority_insert", name=name, now=time.time(), **fields)

    def alter_priority(
        self,
        name: str,
        *,
        contract: str | None = _UNSET,
        local_service: str | None = _UNSET,
        remote_service: str | None = _UNSET,
        level: int = _UNSET,
    ) -> ConversationPriority:
        """ALTER BROKER PRIORITY: change what is given (``None`` sets ``ANY``). Existing
        endpoints keep their level; only endpoints created afterwards see the change.

        :raises NotFound: for an unknown name
        """
        with self._operation() as tx:
            current = _priority(tx, name)
            fields = _priority_fields(
                tx,
                name,
                current.contract_name if contract is _UNSET else contract,
                current.local_service_name if local_service is _UNSET else local_service,
                current.remote_service_name if remote_service is _UNSET else remote_service,
                current.priority_level if level is _UNSET else level,
            )
            tx.session.execute("priority_update", name=name, **fields)
            return _priority(tx, name)

    def drop_priority(self, name: str) -> None:
        """DROP BROKER PRIORITY (existing endpoints keep their level).

        :raises NotFound: for an unknown name
        """
        with self._operation() as tx:
            _priority(tx, name)
            tx.session.execute("priority_delete", name=name)

    def conversation_priorities(self) -> list[ConversationPriority]:
        """Every priority (``sys.conversation_priorities``)."""
        with self._operation() as tx:
            return [ConversationPriority.from_row(r) for r in tx.session.all("priority_list")]

    def set_honor_broker_priority(self, honor: bool) -> None:
        """ALTER DATABASE ... SET HONOR_BROKER_PRIORITY: whether the transmission queue
        sends higher levels first (RECEIVE always honours levels)."""
        if not isinstance(honor, bool):
            raise exceptions.InvalidArgument(f"honor must be True or False, got {honor!r}")
        with self._operation() as tx:
            tx.session.execute(
                "setting_set", name="honor_broker_priority", value="true" if honor else "false"
            )

    def honor_broker_priority(self) -> bool:
        """Whether the transmission queue honours priority levels."""
        with self._operation() as tx:
            return tx.session.scalar("setting_get", name="honor_broker_priority") == "true"


def _ensure_event_catalog(tx: Transaction) -> None:
    """The broker's own initiator service for event dialogs, made on first use:
    ``EventNotificationService`` on ``EventNotificationQueue`` (the ``EventNotification``
    message type and ``PostEventNotification`` contract exist in every broker)."""
    now = time.time()
    if not tx.session.one("queue_get", name=EVENT_QUEUE):
        tx.session.execute(
            "queue_insert",
            now=now,
            **_queue_settings(
                name=EVENT_QUEUE,
                status=True,
                retention=False,
                activation_status=False,
                activation_procedure=None,
                max_readers=0,
                execute_as=None,
                poison_message_handling=False,
                receive_aging=None,
                fair_share=None,
                eager_activation=False,
            ),
        )
    if not tx.session.one("service_get", name=EVENT_SERVICE):
        tx.session.execute("service_insert", name=EVENT_SERVICE, queue=EVENT_QUEUE, now=now)


def _priority(tx: Transaction, name: str) -> ConversationPriority:
    row = tx.session.one("priority_get", name=name)
    if row is None:
        raise exceptions.NotFound(f"priority {name!r} does not exist")
    return ConversationPriority.from_row(row)


def _priority_fields(
    tx: Transaction,
    name: str,
    contract: str | None,
    local_service: str | None,
    remote_service: str | None,
    level: Any,
) -> dict[str, Any]:
    if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= 10:
        raise exceptions.InvalidArgument(
            f"priority {name!r}: level must be an integer from 1 to 10, got {level!r}"
        )
    if contract is not None and not tx.session.one("contract_exists", name=contract):
        raise exceptions.ContractNotFound(
            f"priority {name!r} names contract {contract!r}, which does not exist"
        )
    if local_service is not None:
        endpoints.service(tx.session, local_service)
    if remote_service is not None:
        checks.name(remote_service, "remote service name")
    clash = tx.session.scalar(
        "priority_same_match",
        name=name,
        contract=contract,
        local_service=local_service,
        remote_service=remote_service,
    )
    if clash is not None:
        raise exceptions.AlreadyExists(
            f"priority {clash!r} already matches contract={contract or 'ANY'}, "
            f"local_service={local_service or 'ANY'}, remote_service={remote_service or 'ANY'}"
        )
    return {
        "contract": contract,
        "local_service": local_service,
        "remote_service": remote_service,
        "level": level,
    }


def _queue_settings(**settings: Any) -> dict[str, Any]:
    flags = ("status", "retention", "activation_status", "poison_message_handling")
    for flag in (*flags, "eager_activation"):
        if not isinstance(settings[flag], bool):
            raise exceptions.InvalidArgument(
                f"queue {flag} must be True or False, got {settings[flag]!r}"
            )
    checks.bounded_int(settings["max_readers"], "max_queue_readers")
    procedure = settings["activation_procedure"]
    if procedure is not None and (not isinstance(procedure, str) or not procedure.strip()):
        raise exceptions.InvalidArgument(
            f"activation_procedure must be a dotted path or None, got {procedure!r}"
        )
    for option in ("receive_aging", "fair_share"):  # seconds > 0, or None: off
        seconds = settings[option]
        if seconds is not None:
            seconds = checks.timeout(seconds, option)
            if seconds == 0:
                raise exceptions.InvalidArgument(f"{option} must be greater than 0 (or None: off)")
            settings[option] = seconds
    if settings["activation_status"] and not procedure:
        raise exceptions.InvalidArgument("activation needs an activation_procedure")
    return settings
