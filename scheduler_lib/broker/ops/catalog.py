"""The broker's catalog: message types, contracts, queues, services, event notifications
and priorities — CREATE / ALTER / DROP and their views, as plain functions over a session.
The fronts' :class:`~scheduler_lib.broker.catalog.CatalogOperations` documents each."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from scheduler_lib.broker import exceptions, models
from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.db import session as sessions
from scheduler_lib.broker.ops import arrival, endpoints

UNSET: Any = object()  # an ALTER argument not given: the setting stays
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


def create_message_type(
    session: sessions.Session,
    name: str,
    validation: models.Validation | str = models.Validation.NONE,
) -> None:
    """CREATE MESSAGE TYPE."""
    name = checks.name(name, "message type name")
    checked = _enum(models.Validation, validation, "validation")
    if name in models.SYSTEM_MESSAGE_TYPES:
        raise exceptions.AlreadyExists(f"{name!r} is a system message type")
    if session.one("message_type_get", name=name):
        raise exceptions.AlreadyExists(f"message type {name!r} already exists")
    session.execute("message_type_insert", name=name, validation=checked.value, now=time.time())


def alter_message_type(
    session: sessions.Session, name: str, validation: models.Validation | str
) -> None:
    """ALTER MESSAGE TYPE ... VALIDATION."""
    checked = _enum(models.Validation, validation, "validation")
    if session.count("message_type_set_validation", name=name, validation=checked.value) == 0:
        raise exceptions.MessageTypeNotFound(f"message type {name!r} does not exist")


def drop_message_type(session: sessions.Session, name: str) -> None:
    """DROP MESSAGE TYPE."""
    if not session.one("message_type_get", name=name):
        raise exceptions.MessageTypeNotFound(f"message type {name!r} does not exist")
    users = [r["contract_name"] for r in session.all("message_type_contracts", name=name)]
    if users:
        raise exceptions.InUse(
            f"message type {name!r} is used by contracts {users}", hint="drop them first"
        )
    session.execute("message_type_delete", name=name)


def message_types(session: sessions.Session) -> dict[str, models.Validation]:
    """Every message type with its validation (``sys.service_message_types``)."""
    return {
        r["message_type_name"]: models.Validation(r["validation"])
        for r in session.all("message_type_list")
    }


def create_contract(
    session: sessions.Session, name: str, message_types: Mapping[str, models.SentBy | str]
) -> None:
    """CREATE CONTRACT."""
    name = checks.name(name, "contract name")
    if not isinstance(message_types, Mapping):
        raise exceptions.InvalidArgument(
            f"contract {name!r}: message_types must map each message type to who sends it "
            f"(INITIATOR, TARGET or ANY), got {type(message_types).__name__}"
        )
    if not message_types:
        raise exceptions.InvalidArgument(f"contract {name!r} needs at least one message type")
    checked = {
        checks.name(mt, "message type name"): _enum(models.SentBy, by, f"sent_by of {mt!r}")
        for mt, by in message_types.items()
    }
    if session.one("contract_exists", name=name):
        raise exceptions.AlreadyExists(f"contract {name!r} already exists")
    for mt in checked:
        if mt in models.SYSTEM_MESSAGE_TYPES:
            raise exceptions.InvalidArgument(
                f"system message type {mt!r} cannot be listed in a contract"
            )
        if not session.one("message_type_get", name=mt):
            raise exceptions.MessageTypeNotFound(
                f"contract {name!r} names message type {mt!r}, which does not exist"
            )
    session.execute("contract_insert", name=name, now=time.time())
    for mt, by in checked.items():
        session.execute(
            "contract_message_type_insert", contract=name, message_type=mt, sent_by=by.value
        )


def contract(session: sessions.Session, name: str) -> dict[str, models.SentBy]:
    """A contract's message types and who sends each."""
    if not session.one("contract_exists", name=name):
        raise exceptions.ContractNotFound(f"contract {name!r} does not exist")
    return {
        r["message_type_name"]: models.SentBy(r["sent_by"])
        for r in session.all("contract_message_types", name=name)
    }


def drop_contract(session: sessions.Session, name: str) -> None:
    """DROP CONTRACT."""
    if not session.one("contract_exists", name=name):
        raise exceptions.ContractNotFound(f"contract {name!r} does not exist")
    services = [r["service_name"] for r in session.all("contract_services", name=name)]
    if services:
        raise exceptions.InUse(f"contract {name!r} is accepted by services {services}")
    if session.scalar("contract_endpoint_count", name=name):
        raise exceptions.InUse(
            f"contract {name!r} is used by open conversations", hint="end them first"
        )
    session.execute("contract_delete", name=name)


def create_queue(
    session: sessions.Session,
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
    """CREATE QUEUE."""
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
    if session.one("queue_get", name=name):
        raise exceptions.AlreadyExists(f"queue {name!r} already exists")
    session.execute("queue_insert", now=time.time(), **settings)
    session.catalog_changed()


def alter_queue(
    session: sessions.Session,
    name: str,
    *,
    status: bool = UNSET,
    retention: bool = UNSET,
    activation_status: bool = UNSET,
    activation_procedure: str | None = UNSET,
    max_queue_readers: int = UNSET,
    execute_as: str | None = UNSET,
    poison_message_handling: bool = UNSET,
    receive_aging: float | None = UNSET,
    fair_share: float | None = UNSET,
    eager_activation: bool = UNSET,
) -> models.QueueInfo:
    """ALTER QUEUE: change the given settings, keep the others."""
    current = endpoints.queue(session, name)
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
    merged.update({k: v for k, v in changes.items() if v is not UNSET})
    settings = _queue_settings(name=name, **merged)
    now = time.time()
    if settings["status"]:
        disabled_reason, disabled_at = None, None
    elif current.is_receive_enabled:
        disabled_reason, disabled_at = "turned off by alter_queue", now
    else:
        disabled_reason, disabled_at = current.disabled_reason, current.disabled_at
    session.execute(
        "queue_update",
        now=now,
        disabled_reason=disabled_reason,
        disabled_at=disabled_at,
        **settings,
    )
    if settings["status"] and not current.is_receive_enabled:
        arrival.release_held(session, name)
    session.touched(name)  # waiting receivers and the monitor look again
    session.catalog_changed()
    return endpoints.queue(session, name)


def queue(session: sessions.Session, name: str) -> models.QueueInfo:
    """A queue's settings."""
    return endpoints.queue(session, name)


def queues(session: sessions.Session) -> list[models.QueueInfo]:
    """Every queue (``sys.service_queues``)."""
    return [models.QueueInfo.from_row(r) for r in session.all("queue_list")]


def drop_queue(session: sessions.Session, name: str) -> None:
    """DROP QUEUE."""
    endpoints.queue(session, name)
    services = [r["service_name"] for r in session.all("queue_services", name=name)]
    if services:
        raise exceptions.InUse(
            f"queue {name!r} is used by services {services}", hint="drop them first"
        )
    session.execute("queue_delete", name=name)


def create_service(
    session: sessions.Session, name: str, queue: str, contracts: list[str] | tuple[str, ...] = ()
) -> None:
    """CREATE SERVICE ... ON QUEUE ... (contracts)."""
    name = checks.name(name, "service name")
    if session.one("service_get", name=name):
        raise exceptions.AlreadyExists(f"service {name!r} already exists")
    endpoints.queue(session, queue)
    for contract in dict.fromkeys(contracts):
        if not session.one("contract_exists", name=contract):
            raise exceptions.ContractNotFound(
                f"service {name!r} names contract {contract!r}, which does not exist"
            )
    session.execute("service_insert", name=name, queue=queue, now=time.time())
    for contract in dict.fromkeys(contracts):
        session.execute("service_contract_insert", name=name, contract=contract)


def alter_service(
    session: sessions.Session,
    name: str,
    *,
    queue: str | None = None,
    add_contracts: list[str] | tuple[str, ...] = (),
    drop_contracts: list[str] | tuple[str, ...] = (),
) -> None:
    """ALTER SERVICE: move it to another queue (its conversations and messages follow)"""
    service = endpoints.service(session, name)
    accepted = {r["contract_name"] for r in session.all("service_contracts", name=name)}
    for contract in add_contracts:
        if not session.one("contract_exists", name=contract):
            raise exceptions.ContractNotFound(f"contract {contract!r} does not exist")
    for contract in drop_contracts:
        if contract not in accepted:
            raise exceptions.ContractNotFound(
                f"service {name!r} does not accept contract {contract!r}"
            )
    if queue is not None and queue != service["queue_name"]:
        endpoints.queue(session, queue)
        session.execute("service_set_queue", name=name, queue=queue)
        session.execute("service_move_groups", name=name, queue=queue)
        session.execute("service_move_endpoints", name=name, queue=queue)
        session.execute("service_move_messages", name=name, queue=queue)
        session.execute("service_move_held", name=name, queue=queue)
        if endpoints.queue(session, queue).is_receive_enabled:
            arrival.release_held(session, queue)
        session.touched(queue)
    for contract in dict.fromkeys(add_contracts):
        if contract not in accepted:
            session.execute("service_contract_insert", name=name, contract=contract)
    for contract in dict.fromkeys(drop_contracts):
        session.execute("service_contract_delete", name=name, contract=contract)


def service(session: sessions.Session, name: str) -> dict[str, Any]:
    """A service: its queue and the contracts it accepts."""
    row = endpoints.service(session, name)
    contracts = [r["contract_name"] for r in session.all("service_contracts", name=name)]
    return {"service_name": name, "queue_name": row["queue_name"], "contracts": contracts}


def services(session: sessions.Session) -> list[Mapping[str, Any]]:
    """Every service with its queue."""
    return session.all("service_list")


def drop_service(session: sessions.Session, name: str) -> None:
    """DROP SERVICE."""
    endpoints.service(session, name)
    if session.scalar("service_endpoint_count", name=name):
        raise exceptions.InUse(f"service {name!r} still has conversations", hint="end them first")
    session.execute("service_delete", name=name)


def create_event_notification(
    session: sessions.Session,
    name: str,
    queue: str,
    to_service: str,
    event_type: str = "QUEUE_ACTIVATION",
) -> None:
    """CREATE EVENT NOTIFICATION name ON QUEUE queue FOR event_type TO SERVICE to_service."""
    name = checks.name(name, "event notification name")
    if event_type not in EVENT_TYPES:
        raise exceptions.InvalidArgument(
            f"event_type must be one of {', '.join(EVENT_TYPES)}, got {event_type!r}"
        )
    if session.one("event_notification_get", name=name):
        raise exceptions.AlreadyExists(f"event notification {name!r} already exists")
    endpoints.queue(session, queue)
    _ensure_event_catalog(session)
    endpoints.service(session, to_service)
    if not session.one("service_accepts", name=to_service, contract=EVENT_CONTRACT):
        raise exceptions.ServiceContractMismatch(
            f"service {to_service!r} does not accept contract {EVENT_CONTRACT!r}",
            hint=f"alter_service({to_service!r}, add_contracts=[{EVENT_CONTRACT!r}])",
        )
    session.execute(
        "event_notification_insert",
        name=name,
        queue=queue,
        event_type=event_type,
        to_service=to_service,
        now=time.time(),
    )
    session.touched(queue)
    session.catalog_changed()


def drop_event_notification(session: sessions.Session, name: str) -> None:
    """DROP EVENT NOTIFICATION."""
    if not session.one("event_notification_get", name=name):
        raise exceptions.NotFound(f"event notification {name!r} does not exist")
    session.execute("event_notification_delete", name=name)
    session.catalog_changed()


def event_notifications(session: sessions.Session) -> list[Mapping[str, Any]]:
    """Every event notification."""
    return session.all("event_notification_list")


def activated_tasks(session: sessions.Session) -> list[Mapping[str, Any]]:
    """Readers running now (``sys.dm_broker_activated_tasks``)."""
    return session.all("task_list")


def queue_monitors(session: sessions.Session) -> list[Mapping[str, Any]]:
    """Queue monitors (``sys.dm_broker_queue_monitors``)."""
    return session.all("monitor_list")


def create_priority(
    session: sessions.Session,
    name: str,
    *,
    contract: str | None = models.ANY,
    local_service: str | None = models.ANY,
    remote_service: str | None = models.ANY,
    level: int = DEFAULT_PRIORITY_LEVEL,
) -> None:
    """CREATE BROKER PRIORITY."""
    name = checks.name(name, "priority name")
    if session.one("priority_get", name=name):
        raise exceptions.AlreadyExists(f"priority {name!r} already exists")
    fields = _priority_fields(session, name, contract, local_service, remote_service, level)
    session.execute("priority_insert", name=name, now=time.time(), **fields)


def alter_priority(
    session: sessions.Session,
    name: str,
    *,
    contract: str | None = UNSET,
    local_service: str | None = UNSET,
    remote_service: str | None = UNSET,
    level: int = UNSET,
) -> models.ConversationPriority:
    """ALTER BROKER PRIORITY: change what is given (``None`` sets ``ANY``)."""
    current = _priority(session, name)
    fields = _priority_fields(
        session,
        name,
        current.contract_name if contract is UNSET else contract,
        current.local_service_name if local_service is UNSET else local_service,
        current.remote_service_name if remote_service is UNSET else remote_service,
        current.priority_level if level is UNSET else level,
    )
    session.execute("priority_update", name=name, **fields)
    return _priority(session, name)


def drop_priority(session: sessions.Session, name: str) -> None:
    """DROP BROKER PRIORITY (existing endpoints keep their level)."""
    _priority(session, name)
    session.execute("priority_delete", name=name)


def conversation_priorities(session: sessions.Session) -> list[models.ConversationPriority]:
    """Every priority (``sys.conversation_priorities``)."""
    return [models.ConversationPriority.from_row(r) for r in session.all("priority_list")]


def set_honor_broker_priority(session: sessions.Session, honor: bool) -> None:
    """ALTER DATABASE ... SET HONOR_BROKER_PRIORITY."""
    if not isinstance(honor, bool):
        raise exceptions.InvalidArgument(f"honor must be True or False, got {honor!r}")
    session.execute("setting_set", name="honor_broker_priority", value="true" if honor else "false")


def honor_broker_priority(session: sessions.Session) -> bool:
    """Whether the transmission queue honours priority levels."""
    return session.scalar("setting_get", name="honor_broker_priority") == "true"


def _ensure_event_catalog(session: sessions.Session) -> None:
    """The broker's own initiator service for event dialogs, made on first use:
    ``EventNotificationService`` on ``EventNotificationQueue`` (the ``EventNotification``
    message type and ``PostEventNotification`` contract exist in every broker)."""
    now = time.time()
    if not session.one("queue_get", name=EVENT_QUEUE):
        session.execute(
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
    if not session.one("service_get", name=EVENT_SERVICE):
        session.execute("service_insert", name=EVENT_SERVICE, queue=EVENT_QUEUE, now=now)


def _priority(session: sessions.Session, name: str) -> models.ConversationPriority:
    row = session.one("priority_get", name=name)
    if row is None:
        raise exceptions.NotFound(f"priority {name!r} does not exist")
    return models.ConversationPriority.from_row(row)


def _priority_fields(
    session: sessions.Session,
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
    if contract is not None and not session.one("contract_exists", name=contract):
        raise exceptions.ContractNotFound(
            f"priority {name!r} names contract {contract!r}, which does not exist"
        )
    if local_service is not None:
        endpoints.service(session, local_service)
    if remote_service is not None:
        checks.name(remote_service, "remote service name")
    clash = session.scalar(
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
