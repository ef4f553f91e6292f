"""Creating the SQLAlchemy engine for a broker URL, with each backend's settings."""

from __future__ import annotations

import re
import select
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine, make_url

from scheduler_lib.broker import exceptions

DEFAULT_URL = "sqlite:///scheduler_lib.db"
SQLITE_BUSY_TIMEOUT = 60  # seconds a writer waits for SQLite's write lock
POOL_SIZE = 10  # connections kept per process on PostgreSQL
POSTGRESQL_CONNECT_TIMEOUT = 10  # seconds one connection attempt may take
# psycopg prepares a statement on a connection at its second execution, not its sixth (its
# default threshold, 5): the broker runs a small fixed set of named statements, each on
# every connection of every reader, and psycopg forgets them all at a ROLLBACK (a
# receive that waits, a failed transaction), so with the default the costly statements
# ran parsed and planned anew for most of a benchmark's first run. Not at the first: a
# string of several statements (a script) cannot be prepared, and psycopg learns that
# from its first execution, made unprepared.
PREPARE_THRESHOLD = 1


_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")


def mask_password(text: str) -> str:
    """``text`` with the password of any URL in it replaced by ``***`` (for a URL that
    did not parse, and so cannot be rendered without it)."""
    return _PASSWORD.sub(r"\1***@", text)


def normalize_url(url: str | URL) -> URL:
    """Parse a broker URL; ``postgresql://`` means psycopg 3.

    :param url: a SQLAlchemy URL
    :raises InvalidArgument: for an unparsable URL, an unsupported backend or an
        in-memory SQLite database (each connection would see a different one)
    """
    try:
        parsed = make_url(url)
    except Exception as exc:
        shown = mask_password(str(url))
        raise exceptions.InvalidArgument(
            f"not a database URL: {shown!r} ({mask_password(str(exc))})",
            hint="e.g. sqlite:///scheduler_lib.db or postgresql://user:password@host:5432/db",
        ) from None
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        if parsed.drivername == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg")
        elif parsed.drivername != "postgresql+psycopg":
            raise exceptions.InvalidArgument(
                f"unsupported PostgreSQL driver {parsed.drivername!r}",
                hint="use postgresql:// or postgresql+psycopg://",
            )
    elif backend == "sqlite":
        if parsed.database in (None, "", ":memory:") or (parsed.database or "").startswith(
            "file::memory:"
        ):
            raise exceptions.InvalidArgument(
                "an in-memory SQLite database cannot be shared by the broker's connections",
                hint="use a file, e.g. sqlite:///scheduler_lib.db",
            )
    else:
        raise exceptions.InvalidArgument(
            f"unsupported database backend {backend!r}", hint="use sqlite:/// or postgresql://"
        )
    return parsed


def create_engine(
    url: str | URL, *, read_only: bool = False, broker: bool = True, **kwargs: Any
) -> Engine:
    """An engine configured for the broker.

    SQLite: WAL, full fsync, foreign keys, and ``BEGIN IMMEDIATE`` for every transaction so
    a transaction holds the write lock from its first statement: SQLAlchemy renders no
    ``FOR UPDATE`` there, and this lock is what makes RECEIVE's group lock correct across
    processes.

    :param url: the database URL
    :param read_only: SQLite: transactions that only read (a plain ``BEGIN``: in WAL a
        reader sees one snapshot and neither waits for the writer nor holds it up)
    :param broker: PostgreSQL: for the broker's own statements, prepared at their second
        execution (:data:`PREPARE_THRESHOLD`); ``False`` (a user's database, the ``sql``
        tasks'): psycopg's default, their statements being theirs
    :param kwargs: passed to :func:`sqlalchemy.create_engine`
    """
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        connect_args = {"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT}
        engine = sa.create_engine(parsed, connect_args=connect_args, **kwargs)

        @sa.event.listens_for(engine, "connect")
        def _on_connect(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=FULL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT * 1000}")
            cursor.close()

        begin = "BEGIN" if read_only else "BEGIN IMMEDIATE"

        @sa.event.listens_for(engine, "begin")
        def _on_begin(connection: sa.Connection) -> None:
            connection.exec_driver_sql(begin)

        return engine
    kwargs.setdefault("pool_size", POOL_SIZE)
    kwargs.setdefault("max_overflow", POOL_SIZE)
    # A host that does not answer (no refusal) must not hold one attempt for minutes:
    # callers retry within their reconnect deadline (broker/connections.py).
    connect_args = dict(kwargs.pop("connect_args", None) or {})
    connect_args.setdefault("connect_timeout", POSTGRESQL_CONNECT_TIMEOUT)
    # No pool_pre_ping: it costs a round trip per transaction on the hot path. A lost
    # connection throws the pool's connections away, and the call runs again on a new one;
    # one the server closed while it sat in the pool is caught at checkout, for free.
    engine = sa.create_engine(parsed, connect_args=connect_args, **kwargs)
    sa.event.listen(engine, "checkout", _closed_while_idle)
    sa.event.listen(engine, "connect", _arrays_in_binary)
    if broker:
        sa.event.listen(engine, "connect", _prepared_at_once)
    return engine


def _prepared_at_once(dbapi_connection: Any, _record: Any) -> None:
    """Prepare every statement at its second execution (:data:`PREPARE_THRESHOLD`)."""
    dbapi_connection.prepare_threshold = PREPARE_THRESHOLD


def _arrays_in_binary(dbapi_connection: Any, _record: Any) -> None:
    """Send list parameters (a wave's task bodies, its log ids) as binary arrays: the
    text form escapes every element with a regular expression in Python, every quote of
    a JSON body a call of its own (4.3 ms of client CPU for a wave of 50 no-op tasks; the
    binary form 0.04 ms). Every array parameter of the broker's SQL has its type cast.
    (psycopg is imported here, with a connection: it needs libpq, SQLite users may not
    have it.)"""
    from psycopg.types.array import ListBinaryDumper

    dbapi_connection.adapters.register_dumper(list, ListBinaryDumper)


def _closed_while_idle(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
    """Throw away a pooled connection the server closed while it sat idle (a restart,
    ``pg_terminate_backend``, an idle timeout); the pool connects anew. So a statement
    that then fails on its connection was sent: a one-statement write in autocommit may
    have committed, and is not run again blindly."""
    if closed_by_server(dbapi_connection):
        raise sa.exc.DisconnectionError("the server closed this idle connection")


def closed_by_server(dbapi_connection: Any) -> bool:
    """Whether the server closed this idle psycopg connection: an idle connection has
    nothing to read unless the server said goodbye (its termination notice, then the end
    of the stream). One poll of the socket, no round trip."""
    if dbapi_connection.closed:
        return True
    try:
        # poll, not select: a process with many open files has sockets past select's
        # FD_SETSIZE (1024), and select refuses them
        poller = select.poll()
        poller.register(dbapi_connection.pgconn.socket, select.POLLIN)
        ready = poller.poll(0)
    except Exception:  # cannot tell: the statement will
        return False
    return bool(ready)
