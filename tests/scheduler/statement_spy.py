"""A spy on the broker's store: the named statements it runs, through each of its doors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from scheduler_lib.broker.db.store import Store


def statements(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The named statements the store runs from now on, through each of its doors (a
    statement on a connection in autocommit, a transaction of its own, marked so)."""
    ran: list[str] = []
    on_driver, pipeline, execute = Store._on_driver, Store.pipeline, Store.execute

    def spied_on_driver(self: Store, conn: Any, query: str, params: Mapping[str, Any]) -> Any:
        alone = conn.connection.driver_connection.autocommit
        ran.append(f"{query} (autocommit)" if alone else query)
        return on_driver(self, conn, query, params)

    def spied_pipeline(self: Store, conn: Any, statements: Any) -> Any:
        ran.append("pipeline:" + "+".join(q for q, _ in statements))
        return pipeline(self, conn, statements)

    def spied_execute(self: Store, conn: Any, query: str, /, **params: Any) -> Any:
        ran.append(query)
        return execute(self, conn, query, **params)

    monkeypatch.setattr(Store, "_on_driver", spied_on_driver)
    monkeypatch.setattr(Store, "pipeline", spied_pipeline)
    monkeypatch.setattr(Store, "execute", spied_execute)
    return ran
