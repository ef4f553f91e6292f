"""Connection loss, handled in one place.

A PostgreSQL restart, a failover, a network blip or a terminated backend all look the same
from here: a statement, a commit or a connect fails. This module decides what counts as a
lost connection, throws away every pooled connection of that generation (so the next
caller never gets a dead one), and rides through the outage: work that is safe to repeat
is run again on a fresh connection, backing off (bounded exponential, jittered) while the
server refuses connections, until the broker's reconnect deadline. It also remembers when
the database was last unavailable, so that lease expiry can give live workers a full lease
after an outage before declaring them lost.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from scheduler_lib.broker import exceptions
from scheduler_lib.broker.db import engine as engines

log = logging.getLogger(__name__)
T = TypeVar("T")

RECONNECT_TIMEOUT = 120.0  # seconds a caller rides through an outage; the env var overrides
RECONNECT_TIMEOUT_ENV = "SCHEDULER_LIB_RECONNECT_TIMEOUT"
FIRST_BACKOFF = 0.05  # seconds before the first retry
MAX_BACKOFF = 0.5  # seconds between retries at most: the first task after an outage matters
# SQLSTATEs that mean the session is gone or cannot be had: connection exceptions (08),
# the server shutting down or starting up (57P01..57P03)
LOST_STATES = ("08", "57P01", "57P02", "57P03")


def reconnect_timeout(value: float | None = None) -> float:
    """The reconnect deadline: ``value``, else ``SCHEDULER_LIB_RECONNECT_TIMEOUT``, else
    ``RECONNECT_TIMEOUT``.

    :raises InvalidArgument: for a negative or unparsable value
    """
    raw: Any = value if value is not None else os.environ.get(RECONNECT_TIMEOUT_ENV)
    if raw is None:
        return RECONNECT_TIMEOUT
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        seconds = -1.0
    if not 0 <= seconds < math.inf:  # nan and inf too: a deadline that never comes is none
        raise exceptions.InvalidArgument(
            f"reconnect timeout must be a finite number of seconds >= 0, got {raw!r}",
            hint=f"e.g. {RECONNECT_TIMEOUT_ENV}=120",
        )
    return seconds


def is_lost(exc: BaseException) -> bool:
    """Whether a driver or SQLAlchemy error means the connection is gone."""
    if isinstance(exc, exceptions.ConnectionLost):
        return True
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated:
            return True
        exc = exc.orig or exc
    if not type(exc).__module__.startswith("psycopg"):
        return False
    state = getattr(exc, "sqlstate", None)
    if state is not None and state.startswith(LOST_STATES):
        return True
    # psycopg's OperationalError without a state: the socket closed, the server vanished
    return type(exc).__name__ == "OperationalError" and state is None


def is_schema_missing(exc: BaseException | None) -> bool:
    """Whether an error (or one it came from) says that a table of the broker's schema is
    not there: a database emptied under a running process (a restore under way, a dropped
    and recreated database), which a restore or ``scheduler-lib init`` ends."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, exceptions.SchemaMissing):
            return True
        if isinstance(exc, sa_exc.DBAPIError) and exc.orig is not None:
            exc = exc.orig
        if getattr(exc, "sqlstate", None) == "42P01":  # PostgreSQL: undefined_table
            return True
        if type(exc).__module__ == "sqlite3" and "no such table" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def invalidate(conn: sa.Connection, exc: BaseException) -> None:
    """Throw away ``conn`` and every pooled connection made before it: a server that
    dropped one has dropped them all, and the next caller must get a fresh one."""
    _discarded(conn.engine)
    with contextlib.suppress(Exception):
        pooled = conn.connection
        conn.engine.pool._invalidate(pooled, exc, _checkin=False)
    with contextlib.suppress(Exception):
        conn.invalidate(exc)


def discard_pool(engine: sa.Engine) -> None:
    """Every connection ``engine``'s pool holds now is replaced at its next checkout
    (those in use finish what they do)."""
    _discarded(engine)
    engine.pool._invalidate(None, None, _checkin=False)  # type: ignore[arg-type]


# How many times each engine's connections were thrown away (:func:`invalidate`,
# :func:`discard_pool`): a connection a thread keeps (:class:`Kept`) from an earlier
# generation is thrown away too, at its next use, as the pool does with its own.
_generations: weakref.WeakKeyDictionary[sa.Engine, int] = weakref.WeakKeyDictionary()


def _discarded(engine: sa.Engine) -> None:
    _generations[engine] = _generations.get(engine, 0) + 1


def lost(what: str, exc: BaseException, *, committing: bool = False) -> exceptions.ConnectionLost:
    """The error a caller sees for a lost connection: what was running, and why."""
    orig = exc.orig if isinstance(exc, sa_exc.DBAPIError) and exc.orig is not None else exc
    text = " ".join(str(orig).split())
    when = " while committing (the commit may or may not have happened)" if committing else ""
    return exceptions.ConnectionLost(
        f"{what}: the connection was lost{when} ({text})", committing=committing
    )


def connect(engine: sa.Engine) -> sa.Connection:
    """A connection from ``engine``'s pool; a server that refuses it for now (down,
    starting up, unreachable) is a :class:`ConnectionLost`, so callers back off and try
    again; one that refuses it for good (a wrong password, no such database) is
    :class:`CannotConnect` at once."""
    try:
        return engine.connect()
    except sa_exc.DBAPIError as exc:
        raise connect_error(engine, "connect", exc) from exc
    except sa_exc.InvalidRequestError as exc:
        # The pool found the connection it handed out closed by the server, connected
        # anew, found that one closed too, and gave up ("This connection is closed"):
        # a storm of terminations, to ride through like any lost connection.
        raise lost("connect", exc) from exc


# A thread keeps a connection of an engine only while those kept hold at most this share
# of its pool: the rest stays for threads that run a statement now and then (a process
# with more busy threads than that runs the others on the pool, as before).
KEPT_SHARE = 0.5


class _Mine(dict[sa.Engine, "Keeping"]):
    """A thread's kept connections, by engine (weakly referable: its holders point back
    to it without a cycle, so that they go, and give their connections back, the moment
    their thread's locals go — not at the next cyclic garbage collection)."""

    __slots__ = ("__weakref__",)


class Keeping:
    """One thread's kept connection of one engine (:meth:`Kept.take` hands it out with the
    connection, :meth:`Kept.give_back` takes both)."""

    __slots__ = (
        *("__weakref__", "busy", "conn", "engine", "generation", "kept_at", "mine"),
        *("pid", "release"),
    )

    def __init__(self, conn: sa.Connection, mine: _Mine, generation: int) -> None:
        self.conn = conn
        self.engine = conn.engine
        self.generation = generation  # as it was before the connection was checked out
        self.kept_at = time.monotonic()
        self.pid = os.getpid()
        self.busy = True
        self.mine = weakref.ref(mine)  # its thread's kept connections
        # When its thread ends (its locals go) or the broker closes: back to the pool
        self.release = weakref.finalize(self, _give_back_to_pool, conn, self.pid)

    def discard(self) -> None:
        """Not kept any more: the connection goes back to its pool (which resets it)."""
        mine = self.mine()
        if mine is not None and mine.get(self.engine) is self:
            mine.pop(self.engine, None)
        self.release()


def _give_back_to_pool(conn: sa.Connection, pid: int) -> None:
    if os.getpid() == pid:  # never a forked child's copy of its parent's socket
        with contextlib.suppress(Exception):
            conn.close()


class Kept:
    """Each thread's own connection of an engine, kept between its transactions (and its
    single statements in autocommit) instead of going back to the pool after each.

    A pool's checkout and checkin (SQLAlchemy's events, its reset on return) are Python
    work on every operation, on the client's share of two cores: ``python -m
    bench.before_after --before 305d523`` at 70a8ba6 (its table in docs/benchmarks.md,
    2026-11-30 08:13) measured the peers benchmark's queue at batch 1 going from 0.44 to
    0.69 of the raw ceiling, its drain from 0.47 to 0.54. A
    connection is kept only when its transaction is over (the driver says it is idle): a
    thread that keeps one holds no lock and no snapshot.

    What the pool's checkout does is done at each take: a connection the server closed
    while it was kept (a restart, a terminated backend) is thrown away unused, as is one
    of a generation a lost connection threw away (:func:`invalidate`), so that a
    statement that fails on its connection was sent (a one-statement write in autocommit
    may have committed: it is not run again blindly); one kept past the pool's
    ``pool_recycle`` goes back too, and a pool with ``pool_pre_ping`` keeps none (its
    user wants the ping). A transaction inside another on the same thread, and a thread
    past the engine's share (:data:`KEPT_SHARE`, rounded down: a pool of one keeps
    none), use the pool. A thread's connection goes back to the pool when the thread
    ends, every one when the broker closes (:meth:`close`), and one whose transaction was
    dropped without an end when its session goes (``Session.__del__``)."""

    def __init__(self) -> None:
        self._local = threading.local()
        # The busy flags and the set of holders, against close(). Nothing that can wait
        # (a pool's checkout) runs under it, and nothing run by the garbage collector
        # (a finalizer, Session.__del__) takes it.
        self._lock = threading.Lock()
        self._all: weakref.WeakSet[Keeping] = weakref.WeakSet()
        self._closed = False

    def take(self, engine: sa.Engine) -> tuple[sa.Connection, Keeping | None]:
        """This thread's kept connection of ``engine`` if it is free and sound, else one
        from the pool (kept from now on when there is room); and its keeping (``None``:
        the pool's, not kept)."""
        if engine.dialect.name != "postgresql":
            return connect(engine), None
        mine: _Mine | None = self._local.__dict__.get("mine")
        if mine is None:
            mine = self._local.mine = _Mine()
        holder = mine.get(engine)
        if holder is not None:
            with self._lock:
                busy = holder.busy  # busy: a transaction inside another, the pool's
                sound = not busy and self._sound(holder)
                holder.busy = busy or sound
            if busy:
                return connect(engine), None
            if sound:
                return holder.conn, holder
            holder.discard()
            holder = None
        generation = _generations.get(engine, 0)  # read first: a discard meanwhile wins
        conn = connect(engine)
        with self._lock:
            if self._closed or not self._room(engine):
                return conn, None
            mine[engine] = holder = Keeping(conn, mine, generation)
            self._all.add(holder)
        return conn, holder

    def give_back(self, conn: sa.Connection, holder: Keeping | None) -> None:
        """End the use of ``conn`` (from :meth:`take`, with its ``holder``): kept if it is
        idle and sound (from any thread: it is its thread's again), else back to the pool."""
        if holder is None:
            with contextlib.suppress(Exception):
                conn.close()
            return
        keep = not (self._closed or conn.closed or conn.invalidated) and _idle(conn)
        with self._lock:
            keep = keep and not self._closed
            if keep:
                holder.busy = False
        if not keep:
            holder.discard()

    def close(self) -> None:
        """Give every kept connection back to its pool (a busy one when its transaction
        ends); none is kept from now on."""
        with self._lock:
            self._closed = True
            idle = [h for h in self._all if not h.busy]
        for holder in idle:
            holder.release()

    def _sound(self, holder: Keeping) -> bool:
        conn = holder.conn
        if self._closed or holder.pid != os.getpid() or conn.closed or conn.invalidated:
            return False
        if holder.generation != _generations.get(holder.engine, 0):
            return False
        recycle = getattr(holder.engine.pool, "_recycle", -1)
        if 0 <= recycle < time.monotonic() - holder.kept_at:
            return False
        return not engines.closed_by_server(conn.connection.dbapi_connection)

    def _room(self, engine: sa.Engine) -> bool:
        pool = engine.pool
        if getattr(pool, "_pre_ping", False):
            return False
        share = int(getattr(pool, "size", lambda: 0)() * KEPT_SHARE)
        return sum(h.engine is engine for h in self._all) < share


def _idle(conn: sa.Connection) -> bool:
    """Whether ``conn`` is in no transaction, for SQLAlchemy and for the server."""
    if conn.in_transaction():
        return False
    driver: Any = conn.connection.dbapi_connection  # the driver's own (store.driver_of)
    return bool(driver is not None and driver.info.transaction_status == IDLE)


IDLE = 0  # psycopg.pq.TransactionStatus.IDLE (psycopg is not imported: SQLite needs none)


def connect_error(engine: sa.Engine, what: str, exc: sa_exc.DBAPIError) -> exceptions.DatabaseError:
    """What a failure to open a connection means: an outage to wait out, or a setting to
    fix (said in one line, naming the database without its password)."""
    text = " ".join(str(exc.orig or exc).split())
    if engine.dialect.name == "postgresql" and not any(p in text for p in PERMANENT):
        return lost(what, exc)
    return exceptions.CannotConnect(
        f"{what}: cannot connect to {engine.url.render_as_string(hide_password=True)}: {text}",
        hint="check the URL (host, port, database, user, password) and that they exist",
    )


# What a refused connection says when waiting will not help (libpq gives no SQLSTATE).
PERMANENT = (
    "does not exist",
    "authentication failed",
    "no pg_hba.conf entry",
    "failed to resolve host",
    "could not translate host name",
    "unable to open database file",  # SQLite: no such directory, or not writable
)


class DatabaseFile:
    """SQLite: the database file this process opened, and whether its path still names
    that file. A file removed under a running process (``rm`` to start afresh) or
    replaced (a copy put back) leaves the process's open connections on the old one,
    which nobody else reaches: its readers served a file nobody could send to, and said
    nothing. (PostgreSQL, an in-memory or a URI database: nothing to watch.)"""

    def __init__(self, url: sa.URL) -> None:
        path = url.database or ""
        watched = url.get_backend_name() == "sqlite" and path not in ("", ":memory:")
        self.path = path if watched and not path.startswith("file:") else None
        self._identity: tuple[int, int] | None = None  # (device, inode) it names now
        self._identity = self._stat()

    def _stat(self) -> tuple[int, int] | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        except OSError:  # unreadable now: not a change this can tell
            return self._identity
        return (st.st_dev, st.st_ino)

    def moved(self) -> bool:
        """Whether the path no longer names the file this process opened (once per
        change). Removed or replaced cannot be told apart: a connection of another thread
        may already have made a new, empty file where one was removed."""
        if self.path is None:
            return False
        now = self._stat()
        before, self._identity = self._identity, now
        return now != before and before is not None  # (one that appeared: none of ours)


class Availability:
    """Whether one database is reachable, as this process last saw it, and the retry loop
    that rides through it being away.

    :param url: the database (shown in errors without its password)
    :param timeout: seconds a call keeps trying before :class:`DatabaseUnavailable`
    :param stopped: set when the broker closes: retries end at once
    """

    def __init__(
        self,
        url: sa.URL,
        timeout: float,
        stopped: threading.Event,
        engines: Callable[[], list[sa.Engine]] = list,
    ) -> None:
        self.database = url.render_as_string(hide_password=True)
        self._engines = engines  # the pools a lost connection condemns
        self.timeout = timeout
        self._stopped = stopped
        self._lock = threading.Lock()
        self.unavailable_since: float | None = None  # epoch seconds, while it is away
        self.recovered_at = 0.0  # epoch seconds it last came back after an outage
        self._said: set[str] = set()  # what this outage was said to be: lost, refused, schema
        self.last_error: str | None = None
        self._watchers: list[Callable[[Availability], None]] = []

    def watch(self, callback: Callable[[Availability], None]) -> None:
        """Call ``callback(self)`` when the database goes away and when it is back (for
        progress lines: "database unavailable, retrying for N s")."""
        with self._lock:
            self._watchers.append(callback)

    @property
    def available(self) -> bool:
        return self.unavailable_since is None

    def mark_lost(self, exc: BaseException) -> None:
        refused = isinstance(exc, exceptions.CannotConnect)
        schema = not refused and not is_lost(exc) and is_schema_missing(exc)
        if not schema:
            # Every pool of this database: its other connections died with this one (the
            # broker's autocommit and no-flush engines have pools of their own).
            for engine in self._engines():
                discard_pool(engine)
        kind = "refused" if refused else "schema" if schema else "lost"
        with self._lock:
            self.last_error = str(exc)
            if self.unavailable_since is not None:
                # Said once per outage; but an outage that turns out to be one that waiting
                # alone will not end (a connection lost to a DROP DATABASE, then "does not
                # exist"; or the database back empty) is said again, once per cause.
                if kind == "lost" or kind in self._said:
                    return
                self._said.add(kind)
                watchers = []
            else:
                self.unavailable_since = time.time()
                self._said = {kind}
                watchers = list(self._watchers)
        log.warning("database %s unavailable: %s; retrying", self.database, exc)
        for callback in watchers:
            with contextlib.suppress(Exception):
                callback(self)

    def report(self, logger: logging.Logger, what: str, exc: BaseException) -> None:
        """A background loop's failure: an outage is said once, here (not once per
        loop and retry, with a traceback each); anything else is logged with its trace.
        A connection refused for good (a dropped database, a changed password) and a
        database whose tables are gone (emptied for a restore) are said once too: every
        loop of a ``serve`` meets them each turn, and the message names the cause; a
        traceback would only repeat it, a hundred lines a second."""
        away = exceptions.DatabaseUnavailable | exceptions.CannotConnect
        if isinstance(exc, away) or is_lost(exc) or is_schema_missing(exc):
            self.mark_lost(exc)
        else:
            logger.warning("%s", what, exc_info=exc)

    def mark_ok(self) -> None:
        if self.unavailable_since is None:  # the hot path: one attribute read
            return
        with self._lock:
            if self.unavailable_since is None:
                return
            away = time.time() - self.unavailable_since
            self.unavailable_since = None
            self.recovered_at = time.time()
            watchers = list(self._watchers)
        log.warning("database %s is back after %.1f s", self.database, away)
        for callback in watchers:
            with contextlib.suppress(Exception):
                callback(self)

    def retrying(self, call: Callable[[], T], *, what: str = "the operation") -> T:
        """``call()``, run again while it fails for a lost connection — safe because a
        transaction whose connection was lost before its commit did nothing. A loss
        during the commit of a transaction that wrote is not retried here (it may have
        committed): that :class:`ConnectionLost` goes to the caller, who can tell.

        :raises DatabaseUnavailable: still lost after the reconnect deadline
        """
        deadline: float | None = None
        delay = FIRST_BACKOFF
        while True:
            try:
                result = call()
            except exceptions.ConnectionLost as exc:
                if exc.committing:
                    raise
                self.mark_lost(exc)
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.timeout
                left = deadline - now
                if left <= 0 or self._stopped.is_set():
                    raise self.unavailable(what, exc) from exc
                # Jittered, so that the readers of a process do not all knock at once.
                self._stopped.wait(min(left, delay * random.uniform(0.5, 1.0)))
                delay = min(delay * 2, MAX_BACKOFF)
                continue
            self.mark_ok()
            return result

    def unavailable(self, what: str, exc: BaseException) -> exceptions.DatabaseUnavailable:
        since = self.unavailable_since
        away = f"{time.time() - since:.0f} s" if since is not None else "a while"
        if self._stopped.is_set():
            return exceptions.DatabaseUnavailable(
                f"{what}: database {self.database} unavailable and the broker is closing ({exc})"
            )
        return exceptions.DatabaseUnavailable(
            f"{what}: database {self.database} unavailable for {away} (tried for "
            f"{self.timeout:.0f} s; last error: {exc})",
            hint=f"is the server up? a longer wait: --reconnect-timeout or {RECONNECT_TIMEOUT_ENV}",
        )
