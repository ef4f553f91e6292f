"""A database whose tables are gone under a running process (emptied for a restore) is
said once, as an outage that names its cure, not traced by every loop each turn."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy as sa

from scheduler_lib.broker import Broker, DatabaseError
from scheduler_lib.broker.db import connections


def test_a_missing_table_is_said_once_with_its_cure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    broker = Broker(url, timers=False)
    try:
        # Given the broker's tables dropped under it (as a restore into it would start)
        with sqlite3.connect(tmp_path / "broker.db") as db:
            db.execute("PRAGMA foreign_keys=OFF")
            db.execute("DROP TABLE conversation_endpoints")
        with pytest.raises(DatabaseError) as raised:
            broker.fire_timers()
        assert connections.is_schema_missing(raised.value)
        # When two loops of a serve report it, turn after turn
        caplog.set_level(logging.WARNING)
        for _ in range(3):
            broker.availability.report(logging.getLogger("a loop"), "firing failed", raised.value)
        # Then one line says it, without a trace, and what to do
        said = [r for r in caplog.records if "schema is missing" in r.getMessage()]
        assert len(said) == 1 and said[0].exc_info is None, caplog.text
        assert "scheduler-lib init" in said[0].getMessage()
        assert not broker.availability.available
        # And an error that is no missing table is still traced
        other = DatabaseError("something else")
        assert not connections.is_schema_missing(other)
        broker.availability.report(logging.getLogger("a loop"), "firing failed", other)
        assert next(r for r in caplog.records if r.getMessage() == "firing failed").exc_info
    finally:
        broker.close()


def test_a_database_file_it_cannot_look_at_is_no_change(tmp_path: Path) -> None:
    # Given a SQLite path in a directory this process may not search (as root: chmod
    # does not stop it, so an unreadable path is staged as a name that is too long)
    path = tmp_path / ("x" * 300) / "broker.db"
    # When it is watched, Then it is neither a crash nor a change
    watched = connections.DatabaseFile(sa.make_url(f"sqlite:///{path}"))
    assert not watched.moved()
