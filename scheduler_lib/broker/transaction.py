"""A broker transaction: every operation inside it commits or rolls back together."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from scheduler_lib.broker.catalog import CatalogOperations
from scheduler_lib.broker.conversations import ConversationOperations
from scheduler_lib.broker.db.session import Session
from scheduler_lib.broker.db.store import Row
from scheduler_lib.broker.leases import LeaseOperations
from scheduler_lib.broker.poison import PoisonOperations
from scheduler_lib.broker.routes import RouteOperations

if TYPE_CHECKING:
    from scheduler_lib.broker.broker import Broker


class Transaction(
    CatalogOperations, ConversationOperations, LeaseOperations, PoisonOperations, RouteOperations
):
    """One database transaction. Use as a context manager: it commits on a clean exit and
    rolls back on an exception, and received messages then return to their queue.

    The connection is taken at the first operation. On SQLite that first statement takes
    the write lock (``BEGIN IMMEDIATE``); a RECEIVE that waits before the transaction wrote
    anything gives the lock back while it waits, so senders are never blocked by a waiting
    receiver.
    """

    def __init__(
        self, broker: Broker, *, autocommit: bool = False, engine: sa.Engine | None = None
    ) -> None:
        self._broker = broker
        #: the connection and what this transaction's operations did (the broker's own
        #: operations use it; a layer above uses the named-query methods below)
        self.session = Session(broker, autocommit=autocommit, engine=engine)
        self.session.serves(self)

    # --- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.session.finished:
            return
        if exc_type is None:
            self.session.commit()
            return
        self.session.end_on(exc)

    def commit(self) -> None:
        """Commit, then wake local waiters on the queues that got messages."""
        self.session.commit()

    def rollback(self) -> None:
        """Roll back: nothing this transaction did remains; received messages are back."""
        self.session.rollback()

    def savepoint(self) -> contextlib.AbstractContextManager[None]:
        """A part of the transaction that can fail alone (SAVEPOINT): on an exception
        only what it did is undone, and the exception goes on."""
        return self.session.savepoint()

    @contextlib.contextmanager
    def _operation(self) -> Iterator[Transaction]:
        self.session.check_open()
        yield self

    # --- named queries of the layers above (Broker.use_queries) ------------------------

    @property
    def broker(self) -> Broker:
        """The broker this transaction belongs to."""
        return self._broker

    def run(self, query: str, /, **params: Any) -> int:
        """Run a named statement in this transaction; how many rows it changed."""
        self.session.mark_written()
        return self.session.count(query, **params)

    def fetch(self, query: str, /, **params: Any) -> list[Row]:
        """Every row of a named query, as mappings."""
        return self.session.all(query, **params)

    def fetch_one(self, query: str, /, **params: Any) -> Row | None:
        """The first row of a named query, or ``None``."""
        return self.session.one(query, **params)

    def fetch_value(self, query: str, /, **params: Any) -> Any:
        """The first column of the first row of a named query, or ``None``."""
        return self.session.scalar(query, **params)
