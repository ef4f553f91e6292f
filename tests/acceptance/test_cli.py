"""The scheduler-lib command, run as a user would: in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import sqlalchemy as sa

from scheduler_lib.broker import Broker, engine, schema


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scheduler_lib.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_init_creates_the_schema_then_is_idempotent(db_url: str) -> None:
    # Given an empty database
    # When init runs twice
    first = _cli("init", "--db", db_url)
    second = _cli("init", "--db", db_url)
    # Then the first creates the schema, the second changes nothing, both succeed
    assert first.returncode == 0, first.stderr
    assert "upgraded from empty to" in first.stdout
    assert second.returncode == 0, second.stderr
    assert "already at revision" in second.stdout
    eng = engine.create_engine(db_url)
    try:
        assert schema.current(eng) == schema.head()
    finally:
        eng.dispose()
    # And the broker works on it without migrating again
    with Broker(db_url, migrate=False, timers=False) as broker:
        assert "DEFAULT" in broker.message_types()


def test_init_reads_the_url_from_the_environment(sqlite_url: str) -> None:
    # Given SCHEDULER_LIB_DB set and no --db
    result = _cli("init", env={"SCHEDULER_LIB_DB": sqlite_url})
    # Then that database is initialised
    assert result.returncode == 0, result.stderr
    eng = sa.create_engine(sqlite_url)
    try:
        assert "queue_messages" in sa.inspect(eng).get_table_names()
    finally:
        eng.dispose()


def test_init_with_a_bad_url_names_the_problem() -> None:
    # Given a URL of a backend the broker does not support
    result = _cli("init", "--db", "mysql://localhost/x")
    # Then the command fails with a clear message and no traceback
    assert result.returncode == 2
    assert "unsupported database backend 'mysql'" in result.stderr
    assert "Traceback" not in result.stderr
