"""Fixtures for tests that stop, restart and kill a PostgreSQL server.

They never touch the shared server on 127.0.0.1:5432: ``private_postgres`` is a private
cluster (see ``private_postgres.py``) on a free port, made once per session and removed at
the end, and ``private_db_url`` is a fresh database on it for one test.

Mark the tests that use them ``@pytest.mark.postgres``, like every test that needs
PostgreSQL. Where the server binaries are missing they skip locally and fail under ``CI``,
as ``tests/conftest.py`` does for an unreachable shared server.

A test may leave the private server stopped or killed: before each test that uses it, and
before its database is dropped, the server is started again if it is down.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # multiproc: poll

from private_postgres import PrivatePostgres, unavailable_reason

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def private_postgres_available() -> None:
    """Skip (locally) or fail (under CI) when a private cluster cannot run here; for a
    test that makes its own ``PrivatePostgres``."""
    problem = unavailable_reason()
    if problem is not None:
        if IN_CI:
            pytest.fail(f"a private PostgreSQL server is mandatory under CI: {problem}")
        pytest.skip(f"no private PostgreSQL server: {problem}")


@pytest.fixture(scope="session")
def private_postgres(private_postgres_available: None) -> Iterator[PrivatePostgres]:
    """A started private PostgreSQL cluster for the session; removed at the end."""
    server = PrivatePostgres()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(autouse=True)
def _private_postgres_up(request: pytest.FixtureRequest) -> None:
    """Start the private server before a test that uses it if an earlier test left it
    down (stopped, killed, or failed half-way through an outage)."""
    if "private_postgres" in request.fixturenames:
        server: PrivatePostgres = request.getfixturevalue("private_postgres")
        if not server.is_accepting():
            server.start()


@pytest.fixture
def private_db_url(private_postgres: PrivatePostgres) -> Iterator[str]:
    """A fresh, uniquely named database on the private server; dropped afterwards."""
    name = f"resilience_{uuid.uuid4().hex[:12]}"
    url = private_postgres.create_database(name)
    try:
        yield url
    finally:
        if not private_postgres.is_accepting():
            private_postgres.start()
        private_postgres.drop_database(name)


@pytest.fixture
def slow_wal_writer(private_postgres: PrivatePostgres) -> Iterator[None]:
    """``wal_writer_delay`` 10 s on the private server for one test: what no commit
    flushed stays unwritten until a crash, as it may on a busy server."""

    def setting(value: str | None) -> None:
        with psycopg.connect(private_postgres.url, autocommit=True) as conn:
            if value is None:
                conn.execute("ALTER SYSTEM RESET wal_writer_delay")
            else:
                conn.execute(f"ALTER SYSTEM SET wal_writer_delay = '{value}'")
            conn.execute("SELECT pg_reload_conf()")

    setting("10s")
    try:
        yield
    finally:
        if not private_postgres.is_accepting():
            private_postgres.start()
        setting(None)
