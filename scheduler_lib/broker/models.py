"""Frozen values the broker hands out, and the enums that name its states."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import sys
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from scheduler_lib.broker import exceptions

if sys.version_info >= (3, 11):
    StrEnum = enum.StrEnum
else:  # Python 3.10 (Airflow 3.1 supports it): the same behaviour, as 3.11 defines it

    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str(self.value)


class Validation(StrEnum):
    """How a message type's bodies are checked on SEND."""

    NONE = "NONE"
    EMPTY = "EMPTY"
    WELL_FORMED_XML = "WELL_FORMED_XML"
    JSON = "JSON"


class SentBy(StrEnum):
    """Which side of a conversation may send a message type under a contract."""

    INITIATOR = "INITIATOR"
    TARGET = "TARGET"
    ANY = "ANY"


class EndpointState(StrEnum):
    """Conversation endpoint states, with SQL Server's two-letter codes."""

    STARTED_OUTBOUND = "SO"  # initiator: began, nothing received yet
    STARTED_INBOUND = "SI"  # target: first message arrived, nothing sent yet
    CONVERSING = "CO"
    DISCONNECTED_INBOUND = "DI"  # the far side ended; this side must end too
    DISCONNECTED_OUTBOUND = "DO"  # this side ended; waiting for the far side
    ERROR = "ER"
    CLOSED = "CD"


class MessageStatus(enum.IntEnum):
    """Status of a row in a queue (values as in SQL Server's queue views)."""

    RECEIVED = 0  # kept by RETENTION after it was received
    READY = 1
    RETAINED_SENT = 3  # kept by RETENTION on the sending side


# System message types, as SQL Server names them (without the schema URI prefix).
END_DIALOG = "EndDialog"
ERROR = "Error"
DIALOG_TIMER = "DialogTimer"
SYSTEM_MESSAGE_TYPES = frozenset({END_DIALOG, ERROR, DIALOG_TIMER})
# Where RECEIVE finds an Error and a DialogTimer in their conversation: ahead of its
# messages (numbered from 0), the timer first, then the Error — whatever order they
# arrived in. An Error takes ERROR_SEQUENCE whether the broker made it (lifetime, a
# message that failed validation) or the far side ended WITH ERROR ("Broker System
# Messages", ms166088); the far side's number for it still orders it on the wire.
DIALOG_TIMER_SEQUENCE = -2
ERROR_SEQUENCE = -1

DEFAULT = "DEFAULT"  # the DEFAULT message type and contract every broker has
ANY = None  # wildcard in priority matching: the priority applies to every name


# The columns of a received message, in the order the fast paths return them.
MESSAGE_COLUMNS = (
    "queue_name",
    "conversation_group_id",
    "conversation_handle",
    "message_sequence_number",
    "message_type_name",
    "message_body",
    "priority",
    "service_name",
    "service_contract_name",
    "enqueued_at",
    "status",
)


# Ids as the database gives them (text) -> UUID: a process meets the same few conversations
# and groups message after message, and parsing each anew is Python work on every one.
UUID_CACHE = 4096


@functools.lru_cache(maxsize=UUID_CACHE)
def _uuid(text: str) -> uuid.UUID:
    return uuid.UUID(text)


_STATUSES = {status.value: status for status in MessageStatus}


@dataclasses.dataclass(frozen=True)
class Message:
    """One received message."""

    queue_name: str
    conversation_group_id: uuid.UUID
    conversation_handle: uuid.UUID
    message_sequence_number: int
    message_type_name: str
    body: bytes | None
    priority: int
    service_name: str
    service_contract_name: str
    enqueued_at: float  # seconds since the epoch, UTC
    status: MessageStatus = MessageStatus.READY

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Message:
        return cls.from_values([row[column] for column in MESSAGE_COLUMNS])

    @classmethod
    def from_values(cls, values: Sequence[Any]) -> Message:
        """From a row's values in :data:`MESSAGE_COLUMNS` order (a fast path's row as it
        comes, no mapping built per message)."""
        queue, group, handle, sequence, kind, body, priority, service, contract, at, status = values
        return cls(
            queue,
            _uuid(group),
            _uuid(handle),
            int(sequence),
            kind,
            bytes(body) if body is not None else None,
            int(priority),
            service,
            contract,
            float(at),
            _STATUSES[int(status)],
        )

    @property
    def text(self) -> str | None:
        """The body decoded as UTF-8."""
        return None if self.body is None else self.body.decode("utf-8")

    def json(self) -> Any:
        """The body parsed as JSON."""
        return None if self.body is None else json.loads(self.body)

    @property
    def is_system(self) -> bool:
        return self.message_type_name in SYSTEM_MESSAGE_TYPES

    @property
    def error(self) -> tuple[int, str] | None:
        """``(code, description)`` of an ``Error`` message, else ``None``."""
        if self.message_type_name != ERROR or self.body is None:
            return None
        data = json.loads(self.body)
        return int(data["code"]), str(data["description"])


@dataclasses.dataclass(frozen=True)
class ConversationEndpoint:
    """One side of a conversation, as ``sys.conversation_endpoints`` shows it."""

    conversation_handle: uuid.UUID
    conversation_id: uuid.UUID
    is_initiator: bool
    service_name: str
    far_service_name: str
    contract_name: str
    queue_name: str
    conversation_group_id: uuid.UUID
    state: EndpointState
    priority: int
    send_sequence: int
    receive_sequence: int
    lifetime_expires_at: float | None
    timer_due_at: float | None
    is_remote: bool = False  # the far endpoint lives on another broker
    closed_at: float | None = None  # a remote conversation's closed endpoint, kept a while

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> ConversationEndpoint:
        return cls(
            conversation_handle=uuid.UUID(row["conversation_handle"]),
            conversation_id=uuid.UUID(row["conversation_id"]),
            is_initiator=bool(row["is_initiator"]),
            service_name=row["service_name"],
            far_service_name=row["far_service_name"],
            contract_name=row["contract_name"],
            queue_name=row["queue_name"],
            conversation_group_id=uuid.UUID(row["conversation_group_id"]),
            state=EndpointState(row.get("effective_state") or row["state"]),
            priority=int(row["priority"]),
            send_sequence=int(row["send_sequence"]),
            receive_sequence=int(row["receive_sequence"]),
            lifetime_expires_at=row["lifetime_expires_at"],
            timer_due_at=row["timer_due_at"],
            is_remote=bool(row.get("is_remote", False)),
            closed_at=row.get("closed_at"),
        )


@dataclasses.dataclass(frozen=True)
class QueueInfo:
    """A queue's settings, as ``sys.service_queues`` shows them."""

    name: str
    is_receive_enabled: bool
    is_retention_enabled: bool
    is_activation_enabled: bool
    activation_procedure: str | None
    max_readers: int
    execute_as: str | None
    is_poison_message_handling_enabled: bool
    receive_aging_seconds: float | None  # None: aging off
    consecutive_rollbacks: int = 0  # of transactions that received from it, since a commit
    disabled_reason: str | None = None  # why it is off (poison message handling, ALTER)
    disabled_at: float | None = None
    fair_share_quantum: float | None = None  # None: arrival order across conversations
    is_activation_eager: bool = False  # a reader per ready message at once (leased work)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> QueueInfo:
        return cls(
            name=row["queue_name"],
            is_receive_enabled=bool(row["is_receive_enabled"]),
            is_retention_enabled=bool(row["is_retention_enabled"]),
            is_activation_enabled=bool(row["is_activation_enabled"]),
            activation_procedure=row["activation_procedure"],
            max_readers=int(row["max_readers"]),
            execute_as=row["execute_as"],
            is_poison_message_handling_enabled=bool(row["is_poison_message_handling_enabled"]),
            receive_aging_seconds=row["receive_aging_seconds"],
            consecutive_rollbacks=int(row.get("consecutive_rollbacks") or 0),
            disabled_reason=row.get("disabled_reason"),
            disabled_at=row.get("disabled_at"),
            fair_share_quantum=row.get("fair_share_quantum"),
            is_activation_eager=bool(row.get("is_activation_eager") or False),
        )

    def disabled_error(self) -> exceptions.QueueDisabled:
        """The error a RECEIVE on this (disabled) queue raises: it says why and how back."""
        reason = f": {self.disabled_reason}" if self.disabled_reason else ""
        return exceptions.QueueDisabled(
            f"queue {self.name!r} is disabled (status off){reason}",
            hint=f"turn it back on with alter_queue({self.name!r}, status=True)",
        )


@dataclasses.dataclass(frozen=True)
class ConversationPriority:
    """A broker priority, as ``sys.conversation_priorities`` shows it (``None`` = ANY)."""

    name: str
    contract_name: str | None
    local_service_name: str | None
    remote_service_name: str | None
    priority_level: int

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> ConversationPriority:
        return cls(
            name=row["priority_name"],
            contract_name=row["contract_name"],
            local_service_name=row["local_service_name"],
            remote_service_name=row["remote_service_name"],
            priority_level=int(row["priority_level"]),
        )
