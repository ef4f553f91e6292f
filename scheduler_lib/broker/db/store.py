"""The one door to the database: named queries run on a connection, driver errors wrapped.

Only this module touches a SQLAlchemy ``Connection``'s execute; everything above it calls
named queries from ``sql/queries*.sql``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from scheduler_lib.broker import exceptions
from scheduler_lib.broker.db import connections, dialects, queries


class _PipelineExitAfterError(logging.Filter):
    """psycopg logs "error ignored terminating <Pipeline>" when leaving a pipeline block
    that a statement's error is already leaving: the same error again (the pipeline is
    aborted), while the first one goes on to the caller, who says it. A database emptied
    under a ``serve`` printed it at each look of each reader, thousands of lines a
    second; the error itself is still said, once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("error ignored terminating")


logging.getLogger("psycopg").addFilter(_PipelineExitAfterError())

TUPLES_OK = 2  # libpq's PGRES_TUPLES_OK: a statement that returned rows succeeded

Row = Mapping[str, Any]
BEFORE_PREFIX = "before_"  # a riding statement's binds, renamed apart from the SEND's
# Statements that can ride inside a SEND (Store.riding): INSERT ... SELECT without a FROM,
# and UPDATE ... SET ... WHERE ... without a FROM.
_RIDES = re.compile(
    r"\s*(INSERT\s+INTO\s.*?\)\s*SELECT\s(?:(?!\bFROM\b)[^;])*?)\s*;?\s*",
    re.DOTALL | re.IGNORECASE,
)
_RIDES_UPDATE = re.compile(
    r"\s*(UPDATE\s+\w+\s+SET\s(?:(?!\bFROM\b)[^;])*?)\s+(WHERE\s(?:(?!\bFROM\b)[^;])*?)\s*;?\s*",
    re.DOTALL | re.IGNORECASE,
)
# A statement that can ride after them (``after``): UPDATE ... SET ... (no FROM) then a WHERE
# at a line's start, whose subqueries may read other tables.
_RIDES_AFTER = re.compile(
    r"\s*(UPDATE\s+\w+\s+SET\s(?:(?!\bFROM\b)[^;])*?)\n(WHERE\s[^;]*?)\s*;?\s*",
    re.DOTALL | re.IGNORECASE,
)
AFTER_PREFIX = "after_"  # its binds'
_BIND = re.compile(r"(?<![:\w\\]):(\w+)(?!:)")  # a named bind, as sqlalchemy.text reads it


def before_binds(params: Mapping[str, Any]) -> dict[str, Any]:
    """A riding statement's binds under their names inside the SEND (:meth:`Store.riding`)."""
    return {f"{BEFORE_PREFIX}{k}": v for k, v in params.items()}


def after_binds(params: Mapping[str, Any]) -> dict[str, Any]:
    """The binds of the statement riding after (:meth:`Store.riding`'s ``after``)."""
    return {f"{AFTER_PREFIX}{k}": v for k, v in params.items()}


class Store:
    """Runs the broker's named queries for one dialect."""

    def __init__(self, dialect: sa.Dialect) -> None:
        self.dialect = dialect.name
        #: the broker's strategies on this database (fast paths, locking, wake-ups)
        self.features = dialects.of(dialect.name)
        self._dialect = dialect
        self._queries = dict(queries.for_dialect(dialect.name))
        self._driver_sql: dict[str, str] = {}
        self._columns: dict[str, list[str]] = {}  # query -> its result's column names
        self._packages: set[str] = set()
        self._not_riding: set[str] = set()  # send+before pairs riding() said no to

    def extend(self, package: str) -> None:
        """Add the named queries of a layer above the broker (its ``sql/queries*.sql``),
        so that its SQL, too, runs through this door. Idempotent per package.

        :raises ValueError: when one of its names is already taken
        """
        if package in self._packages:
            return
        added = queries.for_dialect(self.dialect, package)
        clash = sorted(set(added) & set(self._queries))
        if clash:
            raise ValueError(f"queries of {package} reuse names already taken: {clash}")
        self._queries.update(added)
        self._packages.add(package)

    def has(self, query: str) -> bool:
        """Whether this dialect has the named query (a layer above asks, for statements
        of its own that one dialect has; the broker asks :attr:`features`)."""
        return query in self._queries

    @property
    def is_postgresql(self) -> bool:
        return self.dialect == "postgresql"

    def execute(self, conn: sa.Connection, query: str, /, **params: Any) -> sa.CursorResult[Any]:
        """Run a named query.

        :param conn: the transaction's connection
        :param query: the query's name in ``sql/queries.sql``
        :param params: its binds
        :raises AlreadyExists: on a unique violation
        :raises DatabaseError: on any other driver error
        """
        try:
            return conn.execute(self._queries[query], params)
        except sa_exc.IntegrityError as exc:
            raise _integrity_error(query, exc) from exc
        except sa_exc.DBAPIError as exc:
            raise dbapi_error(conn, query, exc) from exc

    def one(self, conn: sa.Connection, query: str, /, **params: Any) -> Row | None:
        """The first row of a named query as a mapping, or ``None``."""
        if self.is_postgresql:
            names, rows, _ = self._on_driver(conn, query, params)
            return dict(zip(names, rows[0], strict=True)) if rows else None
        row = self.execute(conn, query, **params).mappings().first()
        return dict(row) if row is not None else None

    def all(self, conn: sa.Connection, query: str, /, **params: Any) -> list[Row]:
        """Every row of a named query as mappings."""
        if self.is_postgresql:
            names, rows, _ = self._on_driver(conn, query, params)
            return [dict(zip(names, row, strict=True)) for row in rows]
        return [dict(row) for row in self.execute(conn, query, **params).mappings()]

    def scalar(self, conn: sa.Connection, query: str, /, **params: Any) -> Any:
        """The first column of the first row, or ``None``."""
        if self.is_postgresql:
            _, rows, _ = self._on_driver(conn, query, params)
            return rows[0][0] if rows else None
        return self.execute(conn, query, **params).scalar()

    def count(self, conn: sa.Connection, query: str, /, **params: Any) -> int:
        """Rows changed by a named statement."""
        if self.is_postgresql:
            return self._on_driver(conn, query, params)[2]
        return int(self.execute(conn, query, **params).rowcount)

    def rows(self, conn: sa.Connection, query: str, /, **params: Any) -> list[tuple[Any, ...]]:
        """Run a named query on the driver's own cursor and return its rows as tuples."""
        return self._on_driver(conn, query, params)[1]

    def riding(self, send: str, before: str, after: str | None = None) -> str | None:
        """The name of one statement that is the one-statement SEND ``send`` with a layer's
        ``before`` statement inside it, written only with the message; ``None`` when
        ``before`` cannot ride there (it is neither an ``INSERT ... SELECT`` nor an
        ``UPDATE ... SET ... WHERE`` without a FROM).

        The SEND's ``sender`` CTE has one row when the message is sent and none
        otherwise (every check guards it): ``before`` becomes a CTE of its own that
        selects FROM it (an UPDATE: FROM it, as a one-row table of no column of its
        own), so the row and the message commit together or not at all, in one
        statement — in autocommit one round trip, where a pipeline needs BEGIN and
        COMMIT around it. Its binds are renamed ``before_<name>`` (:func:`before_binds`).

        ``after``, an ``UPDATE ... SET ...`` (no FROM) with its WHERE at a line's start,
        rides the same way, its binds renamed ``after_<name>`` (:func:`after_binds`); the
        statement's row gets one more column, last: the rows it changed. (The executor's
        next task's start in the answer of the task before it.)
        """
        if after is not None:
            return self._riding_after(send, before, after)
        name = f"{send}+{before}"
        if name in self._queries:
            return name
        if name in self._not_riding:
            return None
        text = self._queries[before].text
        head, sep, final = self._queries[send].text.rpartition("\nSELECT ")
        if not sep or "sender AS (" not in head:
            self._not_riding.add(name)
            return None
        if inner := _RIDES.fullmatch(text):
            riding = f"{inner.group(1)}\nFROM sender"
        elif inner := _RIDES_UPDATE.fullmatch(text):
            # the sender's columns kept out of the UPDATE's names
            sent = f"(SELECT 1 AS {BEFORE_PREFIX}sent FROM sender) AS {BEFORE_PREFIX}sent"
            riding = f"{inner.group(1)}\nFROM {sent}\n{inner.group(2)}"
        else:
            self._not_riding.add(name)
            return None
        renamed = _BIND.sub(lambda m: f":{BEFORE_PREFIX}{m.group(1)}", riding)
        self._queries[name] = sa.text(
            f"{head},\n{BEFORE_PREFIX}row AS (\n{renamed}\n)\nSELECT {final}"
        )
        return name

    def _riding_after(self, send: str, before: str, after: str) -> str | None:
        name = f"{send}+{before}+{after}"
        if name in self._queries:
            return name
        if name in self._not_riding:
            return None
        riding = self.riding(send, before)
        inner = _RIDES_AFTER.fullmatch(self._queries[after].text)
        if riding is None or inner is None:
            self._not_riding.add(name)
            return None
        head, _, final = self._queries[riding].text.rpartition("\nSELECT ")
        columns, sep, tables = final.partition("\nFROM ")
        if not sep:
            self._not_riding.add(name)
            return None
        sent = f"(SELECT 1 AS {AFTER_PREFIX}sent FROM sender) AS {AFTER_PREFIX}sent"
        update = f"{inner.group(1)}\nFROM {sent}\n{inner.group(2)}\nRETURNING 1"
        renamed = _BIND.sub(lambda m: f":{AFTER_PREFIX}{m.group(1)}", update)
        self._queries[name] = sa.text(
            f"{head},\n{AFTER_PREFIX}row AS (\n{renamed}\n)\nSELECT {columns},\n"
            f"    (SELECT count(*) FROM {AFTER_PREFIX}row) AS {AFTER_PREFIX}rows\nFROM {tables}"
        )
        return name

    def pipeline(
        self, conn: sa.Connection, statements: Sequence[tuple[str, Mapping[str, Any]]]
    ) -> list[list[tuple[Any, ...]]]:
        """Run several named statements in one round trip (PostgreSQL's pipeline mode),
        in order, inside ``conn``'s transaction (whose BEGIN goes with them); the rows of
        each. For statements that do not depend on each other's results: a SEND and the
        row it announces. If one fails, the transaction is aborted and this raises. (As
        :meth:`_on_driver`'s, the transaction is the driver's until SQLAlchemy runs one.)"""
        driver = driver_of(conn)
        cursors = []
        try:
            with driver.pipeline():
                for query, params in statements:
                    cursor = driver.cursor()
                    cursor.execute(self._driver_text(query), params)
                    cursors.append(cursor)
            # Leaving the block synced the pipeline: every result is here.
            return [list(c.fetchall()) if c.description is not None else [] for c in cursors]
        except Exception as exc:
            names = "+".join(query for query, _ in statements)
            raise _driver_error(conn, names, exc) from exc
        finally:
            for cursor in cursors:
                cursor.close()

    def take_then(
        self,
        conn: sa.Connection,
        take: tuple[str, Mapping[str, Any]],
        then: tuple[str, Mapping[str, Any]],
        *,
        durable: bool = True,
    ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]] | Exception]:
        """``take`` then ``then`` in one round trip (PostgreSQL's pipeline mode), on an
        autocommit connection whose commits do not wait for the WAL flush: ``take``
        commits as such (the locks it took go at once), then ``then`` runs in a
        transaction of its own that commits durably — which flushes the take's commit
        too, the WAL being written in order (``durable=False``: it does not wait for
        the flush either). The rows of each; for ``then``, the error it met instead when
        it failed (it wrote nothing; the take stands)."""
        driver = driver_of(conn)
        took = driver.cursor()
        recorded = driver.cursor()
        try:
            try:
                with driver.pipeline():
                    # Statements up to the pipeline's sync share one transaction unless
                    # told otherwise: the take's is a block of its own, ended here without
                    # the flush. (A COMMIT of the implicit one would do too, with a
                    # WARNING "there is no transaction in progress" in the server's log
                    # at every take.)
                    driver.execute("BEGIN")
                    took.execute(self._driver_text(take[0]), take[1])
                    driver.execute("COMMIT")
                    driver.execute("BEGIN")
                    if durable:
                        driver.execute("SET LOCAL synchronous_commit TO on")
                    recorded.execute(self._driver_text(then[0]), then[1])
                    driver.execute("COMMIT")
                return list(took.fetchall()), list(recorded.fetchall())
            except Exception as exc:
                error = _driver_error(conn, f"{take[0]}+{then[0]}", exc)
                result = took.pgresult
                if (
                    not isinstance(error, exceptions.DatabaseError)
                    or isinstance(error, exceptions.ConnectionLost)
                    or result is None
                    or result.status != TUPLES_OK
                ):
                    # (the take's block, failed, is ended by its session's rollback)
                    raise error from exc
            # The take committed; what follows it was undone: leave its transaction.
            try:
                driver.execute("ROLLBACK")
            except Exception as exc:
                raise _driver_error(conn, then[0], exc) from exc
            return list(took.fetchall()), error
        finally:
            took.close()
            recorded.close()

    def _driver_text(self, query: str) -> str:
        sql = self._driver_sql.get(query)
        if sql is None:
            sql = str(self._queries[query].compile(dialect=self._dialect))
            self._driver_sql[query] = sql
        return sql

    def _on_driver(
        self, conn: sa.Connection, query: str, params: Mapping[str, Any]
    ) -> tuple[list[str], list[tuple[Any, ...]], int]:
        """(column names, rows, rows changed) of a named query run on the driver's own
        cursor (PostgreSQL): SQLAlchemy's statement and result handling costs several
        times the round trip's client CPU on a small machine, and the hot path runs many
        short statements. It still runs on ``conn``'s connection, inside its
        transaction; the text is compiled once per query. Outside autocommit the driver
        begins that transaction itself, unknown to SQLAlchemy: :func:`commit` ends it
        (SQLAlchemy's begin and commit around it were about a fifth of a RECEIVE's client
        CPU: ``python -m bench.drain_cost``)."""
        sql = self._driver_text(query)
        try:
            with driver_of(conn).cursor() as cursor:
                cursor.execute(sql, params)
                result = cursor.pgresult
                if result is None or result.status != TUPLES_OK:
                    return [], [], cursor.rowcount
                # Read a query's column names once: psycopg builds the description's
                # objects anew on every look, a third of a RECEIVE's client CPU. Read
                # again if the count changed (a SELECT * across a migration).
                names = self._columns.get(query)
                if names is None or len(names) != result.nfields:
                    names = self._columns[query] = [c.name for c in cursor.description or ()]
                return names, list(cursor.fetchall()), cursor.rowcount
        except Exception as exc:
            raise _driver_error(conn, query, exc) from exc

    def execute_many(
        self, conn: sa.Connection, name: str, rows: Sequence[Mapping[str, Any]]
    ) -> None:
        """Run a named statement once per parameter set, in one call to the driver."""
        if rows:
            try:
                conn.execute(self._queries[name], list(rows))
            except sa_exc.IntegrityError as exc:
                raise _integrity_error(name, exc) from exc
            except sa_exc.DBAPIError as exc:
                raise dbapi_error(conn, name, exc) from exc


def dbapi_error(conn: sa.Connection, name: str, exc: sa_exc.DBAPIError) -> Exception:
    """A driver error SQLAlchemy wrapped: a lost connection (SQLAlchemy has invalidated
    it; the pool's older connections go with it) or any other database error."""
    if connections.is_lost(exc):
        connections.invalidate(conn, exc)
        return connections.lost(name, exc)
    return database_error(conn.engine, name, exc)


def database_error(
    engine: sa.Engine, name: str, exc: sa_exc.DBAPIError
) -> exceptions.DatabaseError:
    """A database error that is nobody's bug, said so that an operator knows what to do.
    SQLite's two that stop a run — a file another process holds locked past the busy
    timeout, a full disk — name the file and the way out; the transaction that met them
    rolled back whole (SQLite writes a transaction all or nothing)."""
    text = str(exc.orig).lower()
    if engine.dialect.name == "sqlite":
        path = engine.url.database
        if "database is locked" in text or "database table is locked" in text:
            return exceptions.DatabaseError(
                f"{name}: the SQLite database {path} stayed locked by another connection "
                "past the busy timeout; nothing of this transaction was written",
                hint="find the process holding a long transaction on it, or use "
                "PostgreSQL when many processes write",
            )
        if "disk is full" in text or "disk i/o error" in text:
            return exceptions.DatabaseError(
                f"{name}: the SQLite database {path} could not be written ({exc.orig}); "
                "nothing of this transaction was written",
                hint="free space on its disk, then try again",
            )
    return _server_error(name, exc.orig)


def _server_error(name: str, error: BaseException | None) -> exceptions.DatabaseError:
    """A server error as the broker's: a table of its schema missing (a database emptied
    for a restore under a running ``serve``) says how to make it; any other, what it is."""
    if connections.is_schema_missing(error):
        return exceptions.SchemaMissing(
            f"{name}: {one_line(error)}",
            hint="its scheduler_lib schema is missing (a restore under way?): restore it, "
            "or create it with scheduler-lib init --db URL",
        )
    return exceptions.DatabaseError(f"{name}: {one_line(error)}")


def one_line(error: object) -> str:
    """A driver's error as one line: PostgreSQL's come with DETAIL, HINT and CONTEXT lines
    (a PL/pgSQL error's CONTEXT names every function it passed through)."""
    return " ".join(str(error).split())


def driver_of(conn: sa.Connection) -> Any:
    """The driver's own connection under ``conn`` (psycopg's; sqlite3's): for these
    synchronous drivers it is the DBAPI connection itself, an attribute, where SQLAlchemy's
    ``driver_connection`` is three calls — and every statement of the hot path asks."""
    return conn.connection.dbapi_connection


def in_transaction(conn: sa.Connection) -> bool:
    """Whether ``conn`` is in a transaction: SQLAlchemy's, or one the driver began for a
    statement on its own cursor (:meth:`Store._on_driver`), which SQLAlchemy never saw."""
    return conn.in_transaction() or _driver_transaction(conn)


def _driver_transaction(conn: sa.Connection) -> bool:
    if conn.dialect.name != "postgresql":
        return False  # SQLite's statements all go through SQLAlchemy
    if conn.invalidated or conn.closed:
        # Thrown away (a lost connection): its transaction went with it on the server.
        # (Reading its driver would check a new connection out of the pool.)
        return False
    driver: Any = driver_of(conn)
    return bool(driver is not None and driver.info.transaction_status != connections.IDLE)


def commit(conn: sa.Connection) -> None:
    """Commit ``conn``'s transaction, SQLAlchemy's or the driver's own (a transaction of
    statements on the driver's cursor only: SQLAlchemy's commit would do nothing).

    :raises sa.exc.DBAPIError: SQLAlchemy's commit failed
    :raises psycopg.Error: the driver's commit failed
    """
    if conn.in_transaction():
        conn.commit()
    elif _driver_transaction(conn):
        driver_of(conn).commit()


def rollback(conn: sa.Connection) -> None:
    """Roll back ``conn``'s transaction, SQLAlchemy's or the driver's own (as :func:`commit`)."""
    if conn.in_transaction():
        conn.rollback()
    elif _driver_transaction(conn):
        driver_of(conn).rollback()


def is_driver_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the driver's own (raised past SQLAlchemy, on its cursor or
    connection) rather than SQLAlchemy's wrapping of one."""
    return type(exc).__module__.startswith("psycopg")


def is_lost(conn: sa.Connection, exc: BaseException) -> bool:
    """Whether ``exc``, met on ``conn``, means the connection is gone."""
    if connections.is_lost(exc):
        return True
    driver = driver_of(conn) if is_driver_error(exc) else None
    return bool(getattr(driver, "broken", False) or getattr(driver, "closed", False))


def commit_error(conn: sa.Connection, exc: BaseException) -> exceptions.DatabaseError:
    """A commit that failed on a connection still there, said as :func:`database_error`."""
    if isinstance(exc, sa_exc.DBAPIError):
        return database_error(conn.engine, "commit", exc)
    return exceptions.DatabaseError(f"commit: {one_line(exc)}")


def _driver_error(conn: sa.Connection, name: str, exc: Exception) -> Exception:
    """What a driver error on the driver's own cursor means to the broker's callers: a
    lost connection is invalidated with the pool's older connections (SQLAlchemy never
    saw the error, and would hand the dead connections out again) and becomes
    ConnectionLost — not the caller's fault, try again; a constraint violation becomes
    AlreadyExists or InUse; any other server error a DatabaseError. Anything else (a bug
    of ours) is left as it is."""
    if not type(exc).__module__.startswith("psycopg"):
        return exc
    driver = driver_of(conn)
    broken = getattr(driver, "broken", False) or getattr(driver, "closed", False)
    if broken or connections.is_lost(exc):
        connections.invalidate(conn, exc)
        return connections.lost(name, exc)
    state = getattr(exc, "sqlstate", None)
    if state is not None and state.startswith("23"):  # integrity constraint violation
        return _constraint_error(name, exc)
    return _server_error(name, exc)


def _integrity_error(name: str, exc: sa_exc.IntegrityError) -> exceptions.BrokerError:
    return _constraint_error(name, exc.orig)


def _constraint_error(name: str, orig: BaseException | None) -> exceptions.BrokerError:
    text = str(orig).lower()
    if "unique" in text or "duplicate key" in text or "primary key" in text:
        return exceptions.AlreadyExists(f"{name}: already exists ({one_line(orig)})")
    if "foreign key" in text:
        return exceptions.InUse(f"{name}: still referenced ({one_line(orig)})")
    return exceptions.DatabaseError(f"{name}: {one_line(orig)}")
