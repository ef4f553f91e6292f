"""Shared fixtures: a broker on SQLite and on PostgreSQL for every integration test.

PostgreSQL tests make their own uniquely named database and drop it afterwards. Locally
they skip when no server is reachable; under ``CI`` an unreachable server is a failure.

A test that uses the ``broker`` fixture gets a copy of a database migrated once per test
process (PostgreSQL's ``CREATE DATABASE ... TEMPLATE``, a file copy on SQLite) rather than
one migrated for it: the migrations cost about a second per test and some 480 tests use
it. Every other test's database starts empty, as a user's does before the first
``Broker`` or ``scheduler-lib init`` (the migrations' own tests among them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from scheduler_lib.broker import Broker

POSTGRES_ADMIN_URL = os.environ.get(
    "SCHEDULER_LIB_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _postgres_available() -> str | None:
    engine = sa.create_engine(POSTGRES_ADMIN_URL, connect_args={"connect_timeout": 3})
    try:
        with engine.connect():
            return None
    except Exception as exc:  # any failure to connect means "no server here"
        return str(exc).splitlines()[0]
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def postgres_server() -> str:
    """The admin URL of a reachable PostgreSQL server (fails under CI when unreachable)."""
    problem = _postgres_available()
    if problem is not None:
        if IN_CI:
            pytest.fail(f"PostgreSQL is mandatory under CI but unreachable: {problem}")
        pytest.skip(f"PostgreSQL unreachable: {problem}")
    return POSTGRES_ADMIN_URL


@contextlib.contextmanager
def _database(postgres_server: str, template: str | None = None) -> Iterator[str]:
    """A uniquely named PostgreSQL database (a copy of ``template``, else empty) for the
    block; dropped afterwards."""
    name = f"scheduler_lib_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        copied = f' TEMPLATE "{template}"' if template else ""
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"{copied}')
    try:
        yield sa.make_url(postgres_server).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test; dropped afterwards."""
    with _database(postgres_server) as url:
        yield url


@pytest.fixture(scope="session")
def migrated_postgres(postgres_server: str) -> Iterator[str]:
    """The name of a PostgreSQL database migrated once per test process, that no one
    connects to: the template of the ``broker`` fixture's databases."""
    with _database(postgres_server) as url:
        Broker(url, timers=False).close()  # migrated, and every connection closed
        yield str(sa.make_url(url).database)


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The path of a SQLite file migrated once per test process (closed, so no WAL file
    is beside it): the ``broker`` fixture's databases are copies of it."""
    path = tmp_path_factory.mktemp("migrated") / "broker.db"
    Broker(f"sqlite:///{path}", timers=False).close()
    assert not os.path.exists(f"{path}-wal"), "the migrated SQLite file kept a WAL file"
    return str(path)


@pytest.fixture
def sqlite_url(tmp_path: os.PathLike[str]) -> str:
    """A fresh SQLite database file for one test."""
    return f"sqlite:///{os.path.join(tmp_path, 'broker.db')}"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """The URL of a fresh database, once per backend: empty, or, for a test that uses
    the ``broker`` fixture (which would migrate it first thing), already migrated."""
    migrated = "broker" in request.fixturenames
    if request.param == "sqlite":
        url = str(request.getfixturevalue("sqlite_url"))
        if migrated:
            template = request.getfixturevalue("migrated_sqlite")
            shutil.copyfile(template, str(sa.make_url(url).database))
        yield url
    elif migrated:
        server = request.getfixturevalue("postgres_server")
        with _database(server, template=request.getfixturevalue("migrated_postgres")) as url:
            yield url
    else:
        yield str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def broker(db_url: str) -> Iterator[Broker]:
    """A migrated broker on a fresh database, once per backend."""
    b = Broker(db_url)
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def pg_scheduler_broker(postgres_url: str) -> Iterator[Broker]:
    """A broker on a fresh PostgreSQL database with the task scheduler's catalog (its
    default target, activation off), no timer thread: for tests of the statements the
    scheduler's hot paths run."""
    from scheduler_lib.scheduler import Target, init

    b = Broker(postgres_url, timers=False)
    try:
        init(b, targets=[Target(activation=False)])
        yield b
    finally:
        b.close()


@pytest.fixture
def scheduler_catalog(broker: Broker) -> Broker:
    """The blog's catalog: AsyncSent / AsyncDone on AsyncContract between an initiator
    service on InitiatorQueue and a target service on TargetQueue."""
    broker.create_message_type("AsyncSent", "NONE")
    broker.create_message_type("AsyncDone", "NONE")
    broker.create_contract("AsyncContract", {"AsyncSent": "INITIATOR", "AsyncDone": "TARGET"})
    broker.create_queue("InitiatorQueue")
    broker.create_queue("TargetQueue")
    broker.create_service("InitiatorService", "InitiatorQueue")
    broker.create_service("TargetService", "TargetQueue", ["AsyncContract"])
    return broker
