"""A Service-Broker-style message broker on SQLAlchemy (SQLite embedded, PostgreSQL in
production): message types, contracts, queues, services, conversations with exactly-once
in-order delivery, conversation groups and their locks, timers and lifetimes.

Here: the broker and its transactions, what they return, and what they raise. The poison
message policies and their detector have their own namespace,
:mod:`scheduler_lib.broker.poison` (``from scheduler_lib.broker.poison import
PoisonPolicy, Park``).
"""

import warnings
from typing import Any

from scheduler_lib.broker import poison
from scheduler_lib.broker.broker import Broker, Transaction
from scheduler_lib.broker.exceptions import (
    AlreadyExists,
    BrokerError,
    CannotConnect,
    ConnectionLost,
    ContractNotFound,
    ContractViolation,
    ConversationGroupNotFound,
    ConversationNotFound,
    ConversationStateError,
    DatabaseError,
    DatabaseUnavailable,
    InUse,
    InvalidArgument,
    InvalidMessageBody,
    LeaseLost,
    MessageTooLarge,
    MessageTypeNotFound,
    NotFound,
    QueueDisabled,
    QueueNotFound,
    SchemaMissing,
    ServiceContractMismatch,
    ServiceNotFound,
    TransactionError,
)
from scheduler_lib.broker.leases import Lease
from scheduler_lib.broker.models import (
    ANY,
    DEFAULT,
    DIALOG_TIMER,
    END_DIALOG,
    ERROR,
    ConversationEndpoint,
    ConversationPriority,
    EndpointState,
    Message,
    MessageStatus,
    QueueInfo,
    SentBy,
    Validation,
)
from scheduler_lib.broker.ops.sending import SendAfter
from scheduler_lib.broker.routes import LOCAL, Route

__all__ = [
    "ANY",
    "DEFAULT",
    "DIALOG_TIMER",
    "END_DIALOG",
    "ERROR",
    "LOCAL",
    "AlreadyExists",
    "Broker",
    "BrokerError",
    "CannotConnect",
    "ConnectionLost",
    "ContractNotFound",
    "ContractViolation",
    "ConversationEndpoint",
    "ConversationGroupNotFound",
    "ConversationNotFound",
    "ConversationPriority",
    "ConversationStateError",
    "DatabaseError",
    "DatabaseUnavailable",
    "EndpointState",
    "InUse",
    "InvalidArgument",
    "InvalidMessageBody",
    "Lease",
    "LeaseLost",
    "Message",
    "MessageStatus",
    "MessageTooLarge",
    "MessageTypeNotFound",
    "NotFound",
    "QueueDisabled",
    "QueueInfo",
    "QueueNotFound",
    "Route",
    "SchemaMissing",
    "SendAfter",
    "SentBy",
    "ServiceContractMismatch",
    "ServiceNotFound",
    "Transaction",
    "TransactionError",
    "Validation",
    "poison",
]

# Exported here before they had a namespace of their own: still found, with a warning.
_MOVED_TO_POISON = frozenset(
    {
        "Drop",
        "EndConversation",
        "History",
        "Log",
        "Notify",
        "Outcome",
        "Park",
        "PoisonDetector",
        "PoisonEvent",
        "PoisonMessage",
        "PoisonPolicy",
    }
)


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_POISON:
        warnings.warn(
            f"import {name} from scheduler_lib.broker.poison (scheduler_lib.broker.{name} will go)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(poison, name)
    raise AttributeError(f"module 'scheduler_lib.broker' has no attribute {name!r}")
