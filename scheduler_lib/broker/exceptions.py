"""Every error the broker raises.

Each class's docstring is its default message. Driver errors never escape the store: they
are wrapped there and re-raised as one of these.
"""

from __future__ import annotations


class BrokerError(Exception):
    """The broker could not complete the operation."""

    def __init__(self, message: str | None = None, *, hint: str | None = None) -> None:
        text = message or (self.__doc__ or "").strip()
        if hint:
            text = f"{text} (hint: {hint})"
        super().__init__(text)
        self.hint = hint


class InvalidArgument(BrokerError, ValueError):
    """An argument has a value the operation does not accept."""


# --- catalog -------------------------------------------------------------------------


class NotFound(BrokerError, LookupError):
    """The named object does not exist."""


class MessageTypeNotFound(NotFound):
    """No message type has that name."""


class ContractNotFound(NotFound):
    """No contract has that name."""


class QueueNotFound(NotFound):
    """No queue has that name."""


class ServiceNotFound(NotFound):
    """No service has that name."""


class ConversationNotFound(NotFound):
    """No conversation endpoint has that handle (it never existed or has been closed)."""


class ConversationGroupNotFound(NotFound):
    """No conversation group has that id in that queue."""


class AlreadyExists(BrokerError):
    """An object with that name already exists."""


class InUse(BrokerError):
    """The object is still used by others; dropping it would orphan them."""


# --- conversations -------------------------------------------------------------------


class ContractViolation(BrokerError):
    """The message is not allowed by the conversation's contract."""


class ServiceContractMismatch(BrokerError):
    """The target service does not accept that contract."""


class ConversationStateError(BrokerError):
    """The conversation endpoint is not in a state that allows this operation."""


class InvalidMessageBody(BrokerError):
    """The message body does not pass its message type's validation."""


class MessageTooLarge(BrokerError):
    """The message body is larger than the broker accepts."""


class QueueDisabled(BrokerError):
    """The queue is disabled (status off): nothing can be received from it."""


class LeaseLost(BrokerError):
    """The lease is gone: its heartbeat ran out (the message went back to its queue or to
    its poison disposition), or it was already completed or abandoned."""


class TransactionError(BrokerError):
    """The transaction is not usable for this operation."""


class SchemaNotCurrent(BrokerError):
    """A layer's schema is missing or at another revision, and the caller may not
    migrate it (a role without DDL rights, ``migrate=False``)."""


class DatabaseError(BrokerError):
    """The database reported an error the broker did not expect."""


class ConnectionLost(DatabaseError):
    """The connection to the database was lost (a restart, a failover, a network blip, a
    terminated backend); the connection has been thrown away, try again."""

    def __init__(
        self, message: str | None = None, *, hint: str | None = None, committing: bool = False
    ) -> None:
        super().__init__(message, hint=hint)
        #: lost while a transaction that wrote was committing: it may or may not have
        #: committed, so only work that can tell (or that is safe to repeat) is retried
        self.committing = committing


class DatabaseUnavailable(DatabaseError):
    """The database could not be reached again within the reconnect deadline."""


class CannotConnect(DatabaseError):
    """The database refused the connection for a reason that waiting will not fix: a
    wrong password, a role or database that does not exist, an unknown host."""


class SchemaMissing(DatabaseError):
    """A table of the broker's schema is not in the database: one emptied under a running
    process (dropped and created again for a restore), or never initialized."""
