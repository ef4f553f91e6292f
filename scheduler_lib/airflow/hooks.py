"""The hook: a broker (and a task scheduler on it) from an Airflow connection.

A ``scheduler_lib`` connection holds the broker database's SQLAlchemy URL in its *host*
field (``sqlite:////var/lib/scheduler_lib.db``, ``postgresql://user@db:5432/broker``);
a password given in its own field is put into the URL, so it can live in a secrets
backend rather than in the URL. Extras: ``target_service`` (where tasks go, default the
blog's ``ServiceAsyncTarget``) and ``migrate`` (apply the schema when the broker opens;
default true, off for roles without DDL rights)::

    AIRFLOW_CONN_SCHEDULER_LIB_DEFAULT='{"conn_type": "scheduler_lib",
        "host": "postgresql://airflow@db:5432/broker",
        "extra": {"target_service": "ServiceAsyncTarget"}}'
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import sqlalchemy as sa
from airflow.sdk import BaseHook

from scheduler_lib.broker import Broker, ConnectionLost, DatabaseUnavailable, schema
from scheduler_lib.broker.db import connections, engine
from scheduler_lib.broker.exceptions import BrokerError, InvalidArgument
from scheduler_lib.scheduler import KindNotAllowed, TaskScheduler, catalog

CONN_TYPE = "scheduler_lib"
DEFAULT_CONN_ID = "scheduler_lib_default"
FORM_PREFIX = f"extra__{CONN_TYPE}__"
OUTAGE_LINE = 400  # characters of a database outage's reason shown (one line)
# libpq's second line for a refused connection, which says nothing the first did not
_LIBPQ_HINT = re.compile(r"\s+Is the server running [^?]*\?")

# One broker per (URL, migrate, timers, reconnect timeout) per process: a broker owns an
# engine (a pool) and background threads, and a worker process runs many tasks and
# triggers.
_brokers: dict[tuple[str, bool, bool, float | None], Broker] = {}
_brokers_lock = threading.Lock()
# Per broker: the lock of the one caller that, during an outage, finds out whether the
# database is back (see turn()), and whether ready() applied the broker's migrations.
_states: weakref.WeakKeyDictionary[Broker, _State] = weakref.WeakKeyDictionary()
_states_lock = threading.Lock()
# alembic says "Context impl SQLiteImpl." and "Will assume non-transactional DDL." at INFO
# each time a broker migrates: noise in a task's log. Its level is raised while the
# provider migrates (not for good: Airflow's own `airflow db migrate` prints through it).
ALEMBIC_LOGGER = "alembic"
_quiet_lock = threading.Lock()
_quiet_depth = 0
_quiet_level = logging.NOTSET


@contextlib.contextmanager
def quiet_migrations() -> Iterator[None]:
    """alembic's INFO lines kept out of the logs while the provider migrates a broker
    (its level is raised to WARNING, and put back once the last migration ends)."""
    global _quiet_depth, _quiet_level
    logger = logging.getLogger(ALEMBIC_LOGGER)
    with _quiet_lock:
        if _quiet_depth == 0:
            _quiet_level = logger.level
            if logger.getEffectiveLevel() < logging.WARNING:
                logger.setLevel(logging.WARNING)
        _quiet_depth += 1
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                logger.setLevel(_quiet_level)


def broker_url(conn: Any) -> str:
    """The SQLAlchemy URL of a ``scheduler_lib`` connection, with its password field put
    into the URL when the URL has none.

    :raises InvalidArgument: naming the connection when its host is not a URL
    """
    raw = (conn.host or "").strip()
    if not raw:
        raise InvalidArgument(
            f"connection {conn.conn_id!r}: its host must hold the broker's SQLAlchemy URL "
            "(e.g. sqlite:////var/lib/scheduler_lib.db or postgresql://user@host/db), got "
            "nothing"
        )
    try:
        url = sa.make_url(raw)
    except (sa.exc.ArgumentError, ValueError) as exc:  # ValueError: a port not a number
        # What SQLAlchemy says names the part at fault (e.g. the port 'notaport').
        why = "" if isinstance(exc, sa.exc.ArgumentError) else f" ({exc})"
        raise InvalidArgument(
            f"connection {conn.conn_id!r}: host {engine.mask_password(raw)!r} is not a "
            f"SQLAlchemy URL{engine.mask_password(why)} (e.g. "
            "sqlite:////var/lib/scheduler_lib.db or postgresql://user@host/db)"
        ) from None
    if conn.password and url.password is None:
        url = url.set(password=conn.password)
    return url.render_as_string(hide_password=False)


def connection_options(conn: Any) -> dict[str, Any]:
    """The extras of a ``scheduler_lib`` connection, checked."""
    # The connection form may store its fields with the older prefixed names.
    extra = {k.removeprefix(FORM_PREFIX): v for k, v in (conn.extra_dejson or {}).items()}
    known = {"target_service", "migrate"}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise InvalidArgument(
            f"connection {conn.conn_id!r}: unknown extra field(s) {unknown}; known: {sorted(known)}"
        )
    target = extra.get("target_service") or catalog.Target.service
    if not isinstance(target, str):
        raise InvalidArgument(
            f"connection {conn.conn_id!r}: extra 'target_service' must be a service name, "
            f"got {target!r}"
        )
    migrate = extra.get("migrate")
    if migrate is None:
        migrate = True
    if isinstance(migrate, str):
        migrate = migrate.strip().lower() not in ("false", "0", "no", "off")
    return {"target_service": target, "migrate": bool(migrate)}


def shared_broker(
    url: str,
    *,
    migrate: bool = True,
    timers: bool = True,
    reconnect_timeout: float | None = None,
) -> Broker:
    """The process's broker for ``url`` (opened, and migrated if asked, once).

    :param migrate: apply the broker's schema when it opens (which needs the database:
        during an outage the open waits up to the reconnect deadline). ``False`` opens it
        without a round trip; :func:`ready` brings the schema up to date later
    :param timers: run the broker's timer thread (conversation timers, lifetimes, expired
        leases) in this process; a process that only reads (the Execution Status page)
        leaves that to the workers, and then needs no more than ``SELECT``
    :param reconnect_timeout: seconds each call on the broker rides through a database
        outage before :class:`DatabaseUnavailable` (default
        ``SCHEDULER_LIB_RECONNECT_TIMEOUT``, else 120). A short one — for a caller that
        must answer soon, or that rides through outages in a loop of its own — also
        bounds each connection attempt on PostgreSQL (``connect_timeout``), so that an
        unreachable host cannot hold a call for the kernel's TCP timeout
    """
    key = (url, migrate, timers, reconnect_timeout)
    with _brokers_lock:
        broker = _brokers.get(key)
        if broker is None:
            with quiet_migrations():
                broker = Broker(
                    url,
                    migrate=migrate,
                    timers=timers,
                    reconnect_timeout=reconnect_timeout,
                    engine_options=_engine_options(url, reconnect_timeout),
                )
            _brokers[key] = broker
        return broker


def _engine_options(url: str, reconnect_timeout: float | None) -> dict[str, Any] | None:
    if reconnect_timeout is None:
        return None
    try:
        postgresql = sa.make_url(url).get_backend_name() == "postgresql"
    except sa.exc.ArgumentError:
        return None  # the broker says what is wrong with the URL
    if not postgresql:
        return None
    # libpq's smallest connect_timeout is 2 s
    return {"connect_args": {"connect_timeout": max(2, math.ceil(reconnect_timeout))}}


class _State:
    def __init__(self) -> None:
        self.turn = threading.Lock()
        self.migrated = False  # ready() applied the broker's migrations
        self.prepared = False  # ready() prepared the scheduler's schema


def _state(broker: Broker) -> _State:
    with _states_lock:
        state = _states.get(broker)
        if state is None:
            state = _states[broker] = _State()
        return state


def ready(broker: Broker, *, migrate: bool = False) -> None:
    """Make the schemas ready, once per broker, riding through an outage: with
    ``migrate``, bring the broker's (for a broker opened with ``migrate=False``) and the
    scheduler's (what ``TaskScheduler()`` and the page's queries need) up to date;
    without it, check that the scheduler's is.

    :raises DatabaseUnavailable: the database stayed away past the reconnect deadline
    :raises SchemaNotCurrent: without ``migrate``, the scheduler's schema is not current
    """
    # Broker.apply_migrations rides through an outage itself (catalog.prepare runs it).
    state = _state(broker)
    if migrate and not state.migrated:
        with quiet_migrations():
            broker.apply_migrations(schema.BROKER)
        state.migrated = True
    if not state.prepared:
        # Without ``migrate`` (the connection's default, and the page's monitor role, which
        # may not change the schema) the scheduler's schema is checked, not migrated.
        with quiet_migrations():
            catalog.prepare(broker, migrate=migrate)
        state.prepared = True


def open_scheduler(broker: Broker, *, migrate: bool = False, **kwargs: Any) -> TaskScheduler:
    """A :class:`TaskScheduler` on ``broker`` (``kwargs`` as it takes them), its schema
    made :func:`ready` first, so that opening it rides through an outage."""
    ready(broker, migrate=migrate)
    with quiet_migrations():  # TaskScheduler() prepares the scheduler's schema too
        return TaskScheduler(broker, **kwargs)


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` says the broker's database could not be reached (it is down,
    restarting, failing over), rather than that it refused the work."""
    if isinstance(exc, DatabaseUnavailable | ConnectionLost):
        return True
    return isinstance(exc, sa.exc.DBAPIError) and connections.is_lost(exc)


@contextlib.contextmanager
def turn(broker: Broker) -> Iterator[bool]:
    """Whether the caller may use ``broker`` now: always while its database is
    available; while it is away, one caller at a time (who finds out whether it is back,
    waiting up to the reconnect deadline) and ``False`` at once for the others — so that
    an outage holds one thread per broker (of the api-server's pool, of the triggerer's),
    not one per request or trigger."""
    if broker.availability.available:
        yield True
        return
    lock = _state(broker).turn
    if not lock.acquire(blocking=False):
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def outage_line(broker: Broker | None, exc: BaseException | None = None) -> str:
    """One line saying that the broker's database is unavailable, naming it (without its
    password), since when and why: for a page, a log line, an Airflow error."""
    availability = broker.availability if broker is not None else None
    if availability is not None and availability.unavailable_since is not None:
        away = time.time() - availability.unavailable_since
        text = f"database {availability.database} unavailable for {away:.0f} s"
        if availability.last_error:
            text += f" (last error: {availability.last_error})"
    elif exc is not None:
        text = str(exc)
        hint = getattr(exc, "hint", None) if isinstance(exc, BrokerError) else None
        if hint:
            text = text.removesuffix(f" (hint: {hint})")
    else:
        text = "database unavailable"
    text = " ".join(_LIBPQ_HINT.sub("", text).split())
    password = broker.url.password if broker is not None else None
    if password:
        text = text.replace(str(password), "***")
    return text if len(text) <= OUTAGE_LINE else text[: OUTAGE_LINE - 1] + "…"


def close_brokers() -> None:
    """Close the process's shared brokers (their pools and background threads)."""
    with _brokers_lock:
        brokers = list(_brokers.values())
        _brokers.clear()
    for broker in brokers:
        broker.close()


class SchedulerLibHook(BaseHook):
    """Interact with a scheduler_lib broker: the scheduler's database.

    :param scheduler_lib_conn_id: a connection of type ``scheduler_lib``
    """

    conn_name_attr = "scheduler_lib_conn_id"
    default_conn_name = DEFAULT_CONN_ID
    conn_type = CONN_TYPE
    hook_name = "scheduler_lib"

    def __init__(self, scheduler_lib_conn_id: str = DEFAULT_CONN_ID, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scheduler_lib_conn_id = scheduler_lib_conn_id
        self._settings: tuple[str, dict[str, Any]] | None = None

    def settings(self) -> tuple[str, dict[str, Any]]:
        """(broker URL, options) of the connection, read once per hook."""
        if self._settings is None:
            conn = self.get_connection(self.scheduler_lib_conn_id)
            self._settings = (broker_url(conn), connection_options(conn))
        return self._settings

    def get_conn(self) -> Broker:
        """The broker of the connection (shared within the process). Its calls ride
        through a database outage up to the reconnect deadline
        (``SCHEDULER_LIB_RECONNECT_TIMEOUT``, else 120 s), then raise
        :class:`DatabaseUnavailable`."""
        url, options = self.settings()
        return shared_broker(url, migrate=options["migrate"])

    get_broker = get_conn

    @property
    def target_service(self) -> str:
        return self.settings()[1]["target_service"]

    def get_scheduler(
        self, context: Mapping[str, str | int | None] | None = None, *, target: str | None = None
    ) -> TaskScheduler:
        """A task scheduler on the broker; ``context`` is the Airflow task instance that
        sends (its dag/run/task ids, written into ``execution_log`` with every task sent,
        and what each task's message carries: see ``TaskScheduler``)."""
        return open_scheduler(
            self.get_conn(),
            migrate=self.settings()[1]["migrate"],
            target=target or self.target_service,
            context=context,
        )

    def test_connection(self) -> tuple[bool, str]:
        """The UI's *Test* button: the database answers and holds the scheduler's
        catalog."""
        try:
            scheduler = self.get_scheduler()
            scheduler.check_task({"kind": "sql", "sql": "SELECT 1"})
        except KindNotAllowed:
            pass  # the target runs other kinds: it exists, which is what is asked here
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"
        return True, f"broker reachable; target service {scheduler.target!r} is ready"
