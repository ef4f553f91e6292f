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

import threading
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from airflow.sdk import BaseHook

from scheduler_lib.broker import Broker
from scheduler_lib.broker.exceptions import InvalidArgument
from scheduler_lib.scheduler import KindNotAllowed, TaskScheduler, catalog

CONN_TYPE = "scheduler_lib"
DEFAULT_CONN_ID = "scheduler_lib_default"
FORM_PREFIX = f"extra__{CONN_TYPE}__"

# One broker per (URL, migrate) per process: a broker owns an engine (a pool) and
# background threads, and a worker process runs many tasks and triggers.
_brokers: dict[tuple[str, bool, bool], Broker] = {}  # (url, migrate, timers)
_brokers_lock = threading.Lock()


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
    except sa.exc.ArgumentError:
        raise InvalidArgument(
            f"connection {conn.conn_id!r}: host {raw!r} is not a SQLAlchemy URL "
            "(e.g. sqlite:////var/lib/scheduler_lib.db or postgresql://user@host/db)"
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


def shared_broker(url: str, *, migrate: bool = True, timers: bool = True) -> Broker:
    """The process's broker for ``url`` (opened, and migrated if asked, once).

    :param timers: run the broker's timer thread (conversation timers, lifetimes, expired
        leases) in this process; a process that only reads (the Execution Status page)
        leaves that to the workers, and then needs no more than ``SELECT``
    """
    key = (url, migrate, timers)
    with _brokers_lock:
        broker = _brokers.get(key)
        if broker is None:
            broker = _brokers[key] = Broker(url, migrate=migrate, timers=timers)
        return broker


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
        """The broker of the connection (shared within the process)."""
        url, options = self.settings()
        return shared_broker(url, migrate=options["migrate"])

    get_broker = get_conn

    @property
    def target_service(self) -> str:
        return self.settings()[1]["target_service"]

    def get_scheduler(
        self, context: Mapping[str, str | None] | None = None, *, target: str | None = None
    ) -> TaskScheduler:
        """A task scheduler on the broker; ``context`` is Airflow's dag/run/task ids,
        written into ``execution_log`` with every task sent."""
        return TaskScheduler(self.get_conn(), target=target or self.target_service, context=context)

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
