"""The ``scheduler-lib`` command."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import math
import os
import re
import signal
import sqlite3
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import sqlalchemy as sa
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from scheduler_lib import __version__, scheduler
from scheduler_lib.broker import (
    Broker,
    BrokerError,
    CannotConnect,
    DatabaseUnavailable,
    InvalidArgument,
    QueueInfo,
    activation,
    schema,
    transport,
)
from scheduler_lib.broker.db import connections, engine
from scheduler_lib.broker.poison import PoisonMessage
from scheduler_lib.scheduler import logs, metrics, reporting

T = TypeVar("T")
DB_ENV = "SCHEDULER_LIB_DB"  # default for --db
SERVE_LOG_FORMAT = "%(asctime)s %(levelname)s %(message)s"  # serve's text lines (in UTC)
INT_MAX = 2**31 - 1  # the largest count or limit an argument may give
ID_MAX = 2**63 - 1  # the largest id (a BIGINT)
# The schemas a command may need, by the name its errors give them.
SCHEMAS = {"broker": schema.BROKER, "scheduler": scheduler.MIGRATIONS}


class NoSchema(BrokerError):
    """The database has no scheduler_lib schema, or an older one than this version
    needs: ``scheduler-lib init`` creates or upgrades it."""


def _open(args: argparse.Namespace, *needs: str) -> Broker:
    """The broker of a command that reads or administers an existing database (status,
    queues, poison, routes): opened without migrating and without timers, once its
    schemas (``needs``, by default the broker's) are there and current — so it creates
    nothing, not even an SQLite file.

    :raises NoSchema: a missing SQLite file, a missing or older schema
    """
    url = engine.normalize_url(args.db)  # a malformed URL: said without its password
    _check_schemas(url, needs or ("broker",))
    return Broker(url, migrate=False, timers=False)


def _check_schemas(url: sa.URL, needs: Sequence[str]) -> None:
    shown = url.render_as_string(hide_password=True)
    fix = f"scheduler-lib init --db {shown}"
    if url.get_backend_name() == "sqlite" and not Path(url.database or "").is_file():
        raise NoSchema(f"{shown}: no such database file: create it with: {fix}")
    for name, current in zip(needs, _revisions(url, needs), strict=True):
        migrations = SCHEMAS[name]
        head = schema.head(migrations)
        if current is None:
            what = "scheduler_lib" if name == "broker" else name
            raise NoSchema(f"{shown} has no {what} schema: create it with: {fix}")
        if current == head:
            continue
        if current in _known_revisions(migrations):
            raise NoSchema(
                f"{shown}: its {name} schema is at revision {current}, scheduler-lib "
                f"{__version__} needs {head}: upgrade it with: {fix}"
            )
        raise NoSchema(
            f"{shown}: its {name} schema is at revision {current}, which scheduler-lib "
            f"{__version__} does not know (it needs {head}): a newer version made it; use that"
        )


def _revisions(url: sa.URL, needs: Sequence[str]) -> list[str | None]:
    """The revision each schema is at (``None``: not there), read without writing: an
    SQLite file is opened read-only (the broker's own connections would switch a
    foreign file to WAL); a PostgreSQL server that is away is waited for, as the
    broker's operations wait (``--reconnect-timeout``)."""
    if url.get_backend_name() == "sqlite":
        uri = Path(url.database or "").resolve().as_uri() + "?mode=ro"
        eng = sa.create_engine(
            url, creator=lambda: sqlite3.connect(uri, uri=True), poolclass=sa.pool.NullPool
        )
    else:
        eng = engine.create_engine(url)

    def read() -> list[str | None]:
        try:
            with connections.connect(eng) as conn:
                return [
                    MigrationContext.configure(
                        conn, opts={"version_table": SCHEMAS[name].version_table}
                    ).get_current_revision()
                    for name in needs
                ]
        except sa.exc.DBAPIError as exc:
            if connections.is_lost(exc):
                raise connections.lost("read the schema's revision", exc) from exc
            raise

    try:
        return _riding(eng, read, "read the schema's revision")
    finally:
        eng.dispose()


def _riding(eng: sa.Engine, call: Callable[[], T], what: str) -> T:
    """``call()`` on an engine of the command's own, riding through an outage as the
    broker's operations do (until ``--reconnect-timeout``); a setting that waiting will
    not fix is one line naming the database (``CannotConnect``)."""
    timeout = connections.reconnect_timeout()
    availability = connections.Availability(eng.url, timeout, threading.Event(), lambda: [eng])
    return availability.retrying(call, what=what)


def _known_revisions(migrations: schema.MigrationSet) -> set[str]:
    config = Config()
    config.set_main_option("script_location", migrations.script_location)
    return {script.revision for script in ScriptDirectory.from_config(config).walk_revisions()}


def _init(args: argparse.Namespace) -> int:
    eng = engine.create_engine(args.db)
    try:
        # (a stack's init may start before its server: it waits, as everything else does)
        _riding(eng, lambda: connections.connect(eng).close(), "connect")
        before = schema.current(eng)
        schema.migrate(eng)
        after = schema.current(eng)
    finally:
        eng.dispose()
    if before == after:
        print(f"{eng.url.render_as_string()}: schema already at revision {after}")
    else:
        print(f"{eng.url.render_as_string()}: schema upgraded from {before or 'empty'} to {after}")
    with Broker(args.db, migrate=False, timers=False) as broker:
        # Named here, by the schema's owner, so that `routes`, which only reads, has the
        # broker's identity to show.
        print(f"broker instance {broker.broker_instance}")
        if args.scheduler:
            scheduler.init(broker)
            print(
                "scheduler catalog ready: ServiceAsyncInitiator -> ServiceAsyncTarget "
                "(kinds: sql, python)"
            )
    return 0


def _run(args: argparse.Namespace) -> int:
    """Run a plan's waves and report; exit 1 when a task failed."""
    import scheduler_lib.spark  # noqa: F401 - Spark tasks of the plan are checked before sending
    from scheduler_lib.scheduler.plan import load_plan
    from scheduler_lib.scheduler.reporting import PlanRunner
    from scheduler_lib.spark.worker import PROCEDURE as SPARK_PROCEDURE

    plan = load_plan(args.plan)
    with Broker(args.db) as broker, _interruptible():
        runner = PlanRunner(
            broker,
            plan,
            policy=args.policy,
            max_in_flight=args.max_in_flight,
            target=args.target,
            serve=args.serve,
            serve_skip={SPARK_PROCEDURE},  # Spark target queues are served by workers
            as_json=args.json,
            reader_wait=None if args.wait_for_readers else args.reader_wait,
        )
        try:
            return runner.run()
        except KeyboardInterrupt as exc:
            # Ctrl-C, or SIGTERM (`timeout`, a supervisor): the scheduler was released as
            # the interrupt left its block. One line says what that did to the tasks.
            print(
                f"scheduler-lib: {_interrupted_line(runner.handle, exc, broker)}", file=sys.stderr
            )
            return _interrupted_code(exc)


class _Interrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT) raised where the main thread is, as Ctrl-C raises
    KeyboardInterrupt; ``signum``: which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupted_code(exc: KeyboardInterrupt) -> int:
    """128 + the signal, as shells report a command a signal ended."""
    return 128 + getattr(exc, "signum", signal.SIGINT)


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """SIGINT and SIGTERM interrupt the main thread (Python's default ends the process at
    a SIGTERM without unwinding: the plan's scheduler stayed open and its queued tasks ran
    on). The handlers before are put back at the end."""

    def interrupt(signum: int, _frame: Any) -> None:
        raise _Interrupted(signum)

    if threading.current_thread() is not threading.main_thread():
        yield  # (only the main thread may set handlers: in-process callers of main)
        return
    before = {
        signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _interrupted_line(handle: Any, exc: BaseException, broker: Broker) -> str:
    """What an interrupted ``run`` did to its tasks, in one line."""
    if handle is None:
        return "interrupted before the plan's scheduler began: nothing was sent"
    url = broker.url.render_as_string(hide_password=True)
    if isinstance(exc.__context__, KeyboardInterrupt):
        # Interrupted again while the first interrupt released the scheduler.
        return (
            f"interrupted again while releasing scheduler {handle}: its queued tasks may "
            f"still run; see `scheduler-lib status --db {url}`"
        )
    return (
        f"interrupted: scheduler {handle} released: its queued tasks were cancelled and "
        f"its running ones asked to stop; `scheduler-lib status --db {url}` shows how they "
        "ended"
    )


def _status(args: argparse.Namespace) -> int:
    """What runs now (execution_status), the recent log and the semaphores."""
    from scheduler_lib.scheduler.reporting import print_status

    with _open(args, "broker", "scheduler") as broker:
        print_status(broker, limit=args.limit, as_json=args.json)
    return 0


def _serve(args: argparse.Namespace) -> int:
    """Run queue monitors and their readers until SIGTERM / SIGINT."""
    _log_to_stderr(args, SERVE_LOG_FORMAT)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    from scheduler_lib.spark.worker import PROCEDURE as SPARK_PROCEDURE

    with contextlib.ExitStack() as stack:
        broker = stack.enter_context(Broker(args.db))
        if args.listen is not None:  # it logs where it listens
            stack.enter_context(_transport_endpoint(broker, args))
        processes = None
        reader_setup = None
        if args.readers == "process":
            # Reader processes log as this one does, and count what they ran for its
            # /metrics (their counters in files: set before they are spawned).
            reader_setup = functools.partial(_reader_log, args.log_format, args.log_level)
            if args.metrics_port is not None:
                processes = stack.enter_context(metrics.reader_processes())
        # Spark target queues are served by `scheduler-lib worker` (readers need its session).
        rt = stack.enter_context(
            activation.running(
                broker,
                reader_mode=args.readers,
                skip_procedures={SPARK_PROCEDURE},
                reader_setup=reader_setup,
            )
        )
        if args.metrics_port is not None:
            checks = {"readers": _runtime_check(lambda: rt)}
            _serve_metrics(stack, broker, args, checks, processes=processes)
        print(f"serving {broker.url.render_as_string()} (runtime {rt.runtime_id})", flush=True)
        while not stop.wait(0.5):  # a bounded wait, so the signal handler always gets to run
            pass
    print("stopped", flush=True)
    return 0


def _serve_metrics(
    stack: contextlib.ExitStack,
    broker: Broker,
    args: argparse.Namespace,
    checks: dict[str, Any],
    processes: str | None = None,
) -> None:
    """``--metrics-port``: /metrics and /healthz (the database check first) until the
    command's stack closes; the address said on stdout (port 0 picks a free one).
    ``processes``: where reader processes keep their counters (added to this process's)."""
    host, port = stack.enter_context(
        metrics.serving(
            broker,
            args.metrics_port,
            {"database": metrics.database_check(broker), **checks},
            host=args.metrics_host,
            processes=processes,
        )
    )
    print(f"metrics on http://{host}:{port}/metrics, health on /healthz", flush=True)


def _runtime_check(
    runtime: Callable[[], activation.ActivationRuntime | None],
) -> metrics.Check:
    """/healthz: the activation runtime's supervisor (which starts readers) and heartbeat
    (which vouches for them) still loop."""

    def check() -> tuple[bool, str]:
        rt = runtime()
        if rt is None:
            return False, "stopped"
        stalled = rt.stalled_loops()
        if stalled:
            return False, f"not looping: {', '.join(stalled)}"
        return True, f"looping, {rt.readers} reader(s) running"

    return check


def _spark_check(spark_worker: Any) -> metrics.Check:
    """/healthz: the worker's SparkContext (and its JVM) lives."""
    from scheduler_lib.spark import session

    def check() -> tuple[bool, str]:
        spark = spark_worker.spark
        if spark is None or session.stopped(spark):
            return False, "the SparkContext stopped (or its JVM died)"
        return True, f"application {spark_worker.application_id}"

    return check


def _add_service_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the long-running commands: logging, metrics and health."""
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="text lines, or one JSON object per line (with the task's log_id, conversation "
        "handle, name and kind on lines logged while it runs)",
    )
    parser.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        default="INFO",
        help="the lowest level logged (default %(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=_port,
        help="serve Prometheus metrics at /metrics and a health check at /healthz on this "
        "port (default: not served)",
    )
    parser.add_argument(
        "--metrics-host",
        default=metrics.DEFAULT_HOST,
        help="address the metrics port listens on (default %(default)s; 0.0.0.0 in a container)",
    )


def _transport_endpoint(broker: Broker, args: argparse.Namespace) -> transport.TransportEndpoint:
    """The endpoint ``serve --listen`` runs, from its flags."""
    server_ssl = client_ssl = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise InvalidArgument("--tls-cert and --tls-key go together")
        server_ssl, client_ssl = transport.tls_contexts(args.tls_cert, args.tls_key, args.tls_ca)
    return transport.TransportEndpoint(
        broker,
        key=transport.read_key(args.key_file),
        listen=args.listen,
        advertise=args.advertise,
        server_ssl=server_ssl,
        client_ssl=client_ssl,
        retry_initial=args.retry_initial,
        retry_max=args.retry_max,
        idle_timeout=args.idle_timeout,
        max_connections=args.max_connections,
        max_handshakes=args.max_handshakes,
        events_retention=args.events_retention,
        events_max=args.events_max,
    )


class _UtcFormatter(logging.Formatter):
    """Log lines stamped as everything else this command prints: ISO 8601 in UTC; a line
    logged while a task runs names it, unless it does already, and the Airflow task
    instance that sent it (``[task 7: load; etl.wave_1 scheduled__2026-11-27 try 1]``)."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return reporting.utc(record.created, "milliseconds")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)  # before a traceback, which follows
        log_id = getattr(record, "log_id", None)
        if log_id is not None and not re.search(rf"\btask {log_id}\b", record.getMessage()):
            sender = ""
            dag_id = getattr(record, "dag_id", None)
            if dag_id is not None:  # the Airflow task instance that sent it
                sender = f"; {dag_id}.{getattr(record, 'task_id', None)}"
                sender += f" {getattr(record, 'run_id', None)}"
                try_number = getattr(record, "try_number", None)
                if try_number is not None:
                    sender += f" try {try_number}"
            line += f" [task {log_id}: {getattr(record, 'task_name', None)}{sender}]"
        return line


def _json_formatter() -> logging.Formatter:
    """One JSON object per line (structlog's renderer over the standard library's
    records): time in UTC, level, logger, message, the task's fields while one runs, and
    an exception's traceback as one string."""
    import structlog

    def drop_empty(_: Any, __: str, event: MutableMapping[str, Any]) -> Mapping[str, Any]:
        return {k: v for k, v in event.items() if v is not None}

    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.stdlib.ExtraAdder(allow=logs.FIELDS),
            drop_empty,
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
    )


def _log_to_stderr(args: argparse.Namespace, line_format: str) -> None:
    """``--log-level`` and above to stderr, as text lines or JSON (``--log-format``), for
    the long-running commands (serve, worker). Libraries' chatter (py4j's connections,
    alembic's context lines) only at DEBUG."""
    handler = logging.StreamHandler()
    handler.addFilter(logs.TaskFields())
    if args.log_format == "json":
        handler.setFormatter(_json_formatter())
    else:
        handler.setFormatter(_UtcFormatter(line_format))
    level = logging.getLevelName(args.log_level)
    logging.basicConfig(level=level, handlers=[handler], force=True)
    if level > logging.DEBUG:
        for noisy in ("py4j", "alembic"):
            logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
    logging.captureWarnings(True)  # a library's warnings as log lines (JSON too)


def _reader_log(log_format: str, log_level: str) -> None:
    """A reader process's log, as its ``serve`` has it (spawned, it starts without)."""
    args = argparse.Namespace(log_format=log_format, log_level=log_level)
    _log_to_stderr(args, SERVE_LOG_FORMAT)


def _routes(args: argparse.Namespace) -> int:
    """Create, drop and list routes; show the transmission queue and transport events."""
    with _open(args) as broker:
        if args.action == "create":
            broker.create_route(
                args.name, args.service, args.address, broker_instance=args.broker_instance
            )
        elif args.action == "drop":
            broker.drop_route(args.name)
        # Read, not made: a look at the routes writes nothing (`init` names the broker).
        named = broker.fetch("setting_get", name="broker_instance")
        instance: str | None = named[0]["setting_value"] if named else None
        routes = broker.routes()
        outgoing = broker.fetch("outgoing_list", limit=args.limit)
        links = broker.fetch("transport_connection_list")
        events = broker.fetch("transport_event_list", limit=args.limit)
    if args.json:
        reporting.write_json(
            {
                "broker_instance": instance,
                "routes": [reporting.json_row(dataclasses.asdict(r)) for r in routes],
                "outgoing": [reporting.json_row(m) for m in outgoing],
                "transport_connections": [
                    reporting.json_row({**c, "carries_messages": bool(c["carries_messages"])})
                    for c in links
                ],
                "transport_events": [reporting.json_row(e) for e in events],
            }
        )
        return 0
    print(f"broker instance {instance or 'not named yet (scheduler-lib init names it)'}")
    rows: list[tuple[str, ...]] = [("route", "service", "broker instance", "address")]
    for r in routes:
        rows.append((r.route_name, r.remote_service_name, r.broker_instance or "ANY", r.address))
    _print_table(rows)
    if outgoing:
        print()
        out: list[tuple[str, ...]] = [
            ("message", "to service", "seq", "type", "waiting since", "tries", "status")
        ]
        for m in outgoing:
            out.append(
                (
                    str(m["message_id"]),
                    m["to_service_name"],
                    str(m["message_sequence_number"]),
                    m["message_type_name"],
                    _when(m["enqueued_at"]),
                    str(m["attempts"]),
                    m["transmission_status"] or "in flight",
                )
            )
        _print_table(out)
    if links:
        print()
        conn: list[tuple[str, ...]] = [
            (
                "endpoint",
                "process",
                "direction",
                "peer",
                "peer broker",
                "since",
                "frames out/in",
                "corrupted",
                "carries",
            )
        ]
        for c in links:
            conn.append(
                (
                    c["endpoint_address"] or "-",
                    f"{c['host_name']}:{c['process_id']}",
                    c["direction"],
                    c["peer_address"] or c["peer"],
                    c["peer_broker"] or "-",
                    _when(c["opened_at"]),
                    f"{c['frames_sent']}/{c['frames_received']}",
                    str(c["corrupted_frames"]),
                    "yes" if c["carries_messages"] else "no",
                )
            )
        _print_table(conn)
    if events:
        print()
        ev: list[tuple[str, ...]] = [("when", "event", "peer", "detail")]
        for e in events:
            ev.append((_when(e["occurred_at"]), e["event_type"], e["peer"] or "-", e["detail"]))
        _print_table(ev)
    return 0


def _worker(args: argparse.Namespace) -> int:
    """A Spark driver serving a target queue until SIGTERM / SIGINT (or idle, launched)."""

    from scheduler_lib import spark
    from scheduler_lib.spark import session, worker

    if args.entry_script:
        from scheduler_lib import worker_entry

        print(worker_entry.__file__)
        return 0
    _log_to_stderr(args, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    conf = session.parse_conf(args.conf)
    command = None
    if args.launch_command:
        command = worker.split_command(args.launch_command)
    elif args.max_launched is not None:
        command = worker.launch_command(
            args.db,
            service=args.service,
            queue=args.queue,
            master=args.master,
            max_readers=args.max_readers,
            conf=conf,
        )
    idle_exit = args.idle_exit
    if idle_exit is None and worker.launched_by_activation():
        idle_exit = worker.LAUNCHED_IDLE_EXIT
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with Broker(args.db) as broker:
        spark_worker = spark.Worker(
            broker,
            service=args.service,
            queue=args.queue,
            master=args.master,
            conf=conf,
            max_readers=args.max_readers,
            queue_readers=args.queue_readers,
            # A worker started by external activation never rewrites the target, whatever
            # its command says: the first worker's settings (reader caps) stand.
            init=args.init and not worker.launched_by_activation(),
            launch_command=command,
            max_launched=args.max_launched or 1,
            idle_exit=idle_exit,
            app_name=args.app_name,
        )
        with contextlib.ExitStack() as stack:
            # Listening first: a taken port is said before Spark starts (unhealthy until
            # the session and the readers run).
            if args.metrics_port is not None:
                checks = {
                    "readers": _runtime_check(lambda: spark_worker.runtime),
                    "spark": _spark_check(spark_worker),
                }
                _serve_metrics(stack, broker, args, checks)
            spark_worker.start()
            print(
                f"worker serving {args.queue} on {broker.url.render_as_string()}: Spark "
                f"application {spark_worker.application_id}, UI {spark_worker.ui_url or 'off'}, "
                f"{args.max_readers} reader(s)",
                flush=True,
            )
            spark_worker.run(stop)
    print("stopped", flush=True)
    return 0


def _queues(args: argparse.Namespace) -> int:
    """Queues with their status, activation, monitors and readers."""
    with _open(args) as broker:
        queues = broker.queues()
        monitors = {m["queue_name"]: m for m in broker.queue_monitors()}
        tasks = broker.activated_tasks()
    if args.json:
        reporting.write_json(
            {
                "queues": [_queue_json(q) for q in queues],
                "queue_monitors": [reporting.json_row(m) for m in monitors.values()],
                "activated_tasks": [reporting.json_row(t) for t in tasks],
            }
        )
        return 0
    rows = [
        (
            "queue",
            "status",
            "activation",
            "readers",
            "max",
            "monitor",
            "ready",
            "last empty receive",
        )
    ]
    for q in queues:
        m = monitors.get(q.name, {})
        rows.append(
            (
                q.name,
                "ON" if q.is_receive_enabled else "OFF",
                q.activation_procedure or "-" if q.is_activation_enabled else "off",
                str(m.get("tasks_running", 0)),
                str(q.max_readers),
                m.get("state", "-"),
                str(m.get("messages_ready", "-")),
                _when(m.get("last_empty_rowset_at")),
            )
        )
    _print_table(rows)
    disabled = [q for q in queues if not q.is_receive_enabled]
    if disabled:
        print()
        why: list[tuple[str, ...]] = [("disabled queue", "since", "why")]
        for q in disabled:
            why.append(
                (q.name, _when(q.disabled_at), q.disabled_reason or "created with status off")
            )
        _print_table(why)
        print("turn a queue back on with: alter_queue(name, status=True)")
    if tasks:
        print()
        readers: list[tuple[str, ...]] = [
            ("reader task", "queue", "procedure", "execute as", "runtime", "host", "pid", "started")
        ]
        for t in tasks:
            readers.append(
                (
                    t["task_id"],
                    t["queue_name"],
                    t["procedure_name"],
                    t["execute_as"] or "-",
                    t["runtime_id"],
                    t["host_name"],
                    str(t["process_id"]),
                    _when(t["started_at"]),
                )
            )
        _print_table(readers)
    return 0


def _queue_json(queue: QueueInfo) -> dict[str, Any]:
    """A queue's settings as ``queues --json`` gives them: named as its columns."""
    settings = dataclasses.asdict(queue)
    return reporting.json_row({"queue_name": settings.pop("name"), **settings})


def _when(seconds: float | None) -> str:
    """A time in a table: :func:`reporting.utc`, ``-`` for none."""
    return "-" if seconds is None else reporting.utc(seconds)


def _poison(args: argparse.Namespace) -> int:
    """The poison-message log and holding queue: list, show, replay, drop."""
    histories: list[list[Mapping[str, Any]]] | None = None  # show's
    with _open(args) as broker:
        if args.action == "replay":
            count = broker.replay_poison_messages(args.ids)
            print(f"replayed {count} poison message(s): {_id_list(args.ids)}")
            return 0
        if args.action == "drop":
            count = broker.drop_poison_messages(args.ids)
            print(f"dropped {count} poison message(s): {_id_list(args.ids)}")
            return 0
        if args.action == "list":
            found = broker.poison_messages(queue=args.queue, state=args.state)
        else:  # show: all of them read before any is printed (an unknown id prints nothing)
            found = [broker.poison_message(poison_id) for poison_id in args.ids]
            histories = [
                broker.poison_incidents(m.conversation_handle, m.message_sequence_number)
                for m in (p.message for p in found)
            ]
    if args.json:
        shown = [
            _poison_json(p, None if histories is None else histories[i])
            for i, p in enumerate(found)
        ]
        reporting.write_json({"poison_messages": shown})
    elif histories is not None:
        for p, history in zip(found, histories, strict=True):
            _show_poison(p, history)
    elif not found:
        print("no poison messages")
    else:
        rows: list[tuple[str, ...]] = [
            (
                "id",
                "state",
                "queue",
                "conversation",
                "seq",
                "type",
                "failures",
                "cycles",
                "recorded",
                "redeliver at",
                "last error",
            )
        ]
        for p in found:
            m = p.message
            rows.append(
                (
                    str(p.poison_id),
                    p.state,
                    m.queue_name,
                    str(m.conversation_handle),
                    str(m.message_sequence_number),
                    m.message_type_name,
                    str(p.failures),
                    str(p.cycles),
                    _when(p.recorded_at),
                    _when(p.redeliver_at),
                    (p.last_error or "-").splitlines()[0][:80],
                )
            )
        _print_table(rows)
    return 0


def _id_list(ids: Sequence[int]) -> str:
    return ", ".join(str(i) for i in dict.fromkeys(ids))


def _body(body: bytes | None) -> tuple[str | None, str | None]:
    """A message body as text, and how: ``utf-8``, else ``hex``."""
    if body is None:
        return None, None
    try:
        return body.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return body.hex(), "hex"


def _poison_json(p: PoisonMessage, history: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """A poison message as ``poison list --json`` gives it, named as its columns; with
    its body and failure history for ``poison show --json``."""
    m = p.message
    row: dict[str, Any] = {
        "poison_id": p.poison_id,
        "state": p.state,
        "queue_name": m.queue_name,
        "service_name": m.service_name,
        "service_contract_name": m.service_contract_name,
        "conversation_handle": str(m.conversation_handle),
        "conversation_group_id": str(m.conversation_group_id),
        "message_sequence_number": m.message_sequence_number,
        "message_type_name": m.message_type_name,
        "priority": m.priority,
        "enqueued_at": m.enqueued_at,
        "recorded_at": p.recorded_at,
        "redeliver_at": p.redeliver_at,
        "failures": p.failures,
        "cycles": p.cycles,
        "dispositions": p.dispositions,
        "last_error": p.last_error,
    }
    if history is not None:
        body, encoding = _body(m.body)
        row["body"], row["body_encoding"] = body, encoding
        row["history"] = [reporting.json_row(incident) for incident in history]
    return reporting.json_row(row)


def _show_poison(p: PoisonMessage, history: Sequence[Mapping[str, Any]]) -> None:
    m = p.message
    fields = [
        ("id", str(p.poison_id)),
        ("state", p.state),
        ("queue", m.queue_name),
        ("service", m.service_name),
        ("contract", m.service_contract_name),
        ("conversation", str(m.conversation_handle)),
        ("group", str(m.conversation_group_id)),
        ("sequence", str(m.message_sequence_number)),
        ("type", m.message_type_name),
        ("priority", str(m.priority)),
        ("enqueued", _when(m.enqueued_at)),
        ("recorded", _when(p.recorded_at)),
        ("redeliver at", _when(p.redeliver_at)),
        ("failures", str(p.failures)),
        ("cycles", str(p.cycles)),
        ("dispositions", p.dispositions),
        ("last error", p.last_error or "-"),
    ]
    width = max(len(k) for k, _ in fields)
    for key, value in fields:
        print(f"{key.ljust(width)}  {value}")
    body, encoding = _body(m.body)
    if body is None:
        body = "(none)"
    elif encoding == "hex":
        body = f"({len(body) // 2} bytes, not UTF-8) {body}"
    print(f"{'body'.ljust(width)}  {body}")
    if history:
        print("history:")
        for i in history:
            error = (i["error"] or "").splitlines()[0][:100] if i["error"] else ""
            print(f"  {_when(i['occurred_at'])}  {i['kind']:<7}  {i['worker'] or '-'}  {error}")
    print()


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


def _ddl(args: argparse.Namespace) -> int:
    migrations = scheduler.MIGRATIONS if args.schema == "scheduler" else schema.BROKER
    sys.stdout.write(schema.offline_sql(f"{args.dialect}://", migrations))
    return 0


def _positive_int(text: str, what: str = "", high: int = INT_MAX) -> int:
    """An integer argument from 1 to ``high`` (a count, a limit, an id), checked as it is
    parsed: one error line, never a database's overflow."""
    try:
        value = int(text)
    except ValueError:  # not a number (or thousands of digits)
        value = 0
    if not 1 <= value <= high:
        shown = text if len(text) <= 40 else text[:37] + "..."
        what = what or f"expected an integer from 1 to {high}"
        raise argparse.ArgumentTypeError(f"{what}, got {shown!r}")
    return value


def _port(text: str) -> int:
    """A TCP port from 0 (any free one) to 65535."""
    if text.strip() == "0":
        return 0
    return _positive_int(text, "a port is an integer from 0 to 65535", 65535)


def _poison_id(text: str) -> int:
    return _positive_int(text, f"a poison id is a positive integer up to {ID_MAX}", ID_MAX)


class _Parser(argparse.ArgumentParser):
    """A bad argument is said as any other error: one line, exit 2 (its subcommands'
    parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"scheduler-lib: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="scheduler-lib", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--verbose", action="store_true", help="show the traceback of an error, not one line"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    init = commands.add_parser("init", help="create or upgrade the broker schema (idempotent)")
    init.add_argument(
        "--db",
        default=os.environ.get(DB_ENV, engine.DEFAULT_URL),
        help=f"SQLAlchemy URL (default: ${DB_ENV} or {engine.DEFAULT_URL})",
    )
    init.add_argument(
        "--no-scheduler",
        dest="scheduler",
        action="store_false",
        help="the broker only: not the scheduler's schema and default catalog",
    )
    init.set_defaults(run=_init)

    db_default = os.environ.get(DB_ENV, engine.DEFAULT_URL)
    serve = commands.add_parser("serve", help="run queue monitors and activated readers")
    serve.add_argument("--db", default=db_default, help="SQLAlchemy URL")
    serve.add_argument("--readers", choices=["thread", "process"], default="thread")
    serve.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="also run the broker-to-broker transport endpoint there (Service Broker: 4022)",
    )
    serve.add_argument(
        "--key-file",
        help="the transport key shared with the peers (else $SCHEDULER_LIB_TRANSPORT_KEY)",
    )
    serve.add_argument("--advertise", metavar="tcp://HOST:PORT", help="where peers reach us")
    serve.add_argument("--tls-cert", help="TLS certificate (PEM) for the transport")
    serve.add_argument("--tls-key", help="its private key (PEM)")
    serve.add_argument("--tls-ca", help="CA (PEM) that peers' certificates must chain to")
    serve.add_argument(
        "--retry-initial",
        type=_positive_seconds,
        default=transport.endpoint.RETRY_INITIAL,
        help="seconds before an unacknowledged message is sent again (doubling)",
    )
    serve.add_argument(
        "--retry-max",
        type=_positive_seconds,
        default=transport.endpoint.RETRY_MAX,
        help="cap of the retransmission backoff, in seconds",
    )
    serve.add_argument(
        "--idle-timeout",
        type=_positive_seconds,
        default=transport.endpoint.IDLE_TIMEOUT,
        help="seconds without traffic before a connection is closed",
    )
    serve.add_argument(
        "--max-connections",
        type=_positive_int,
        default=transport.endpoint.MAX_CONNECTIONS,
        help="inbound transport connections at once (default %(default)s)",
    )
    serve.add_argument(
        "--max-handshakes",
        type=_positive_int,
        default=transport.endpoint.MAX_HANDSHAKES,
        help="inbound connections still proving the key at once (default %(default)s)",
    )
    serve.add_argument(
        "--events-retention",
        type=_positive_seconds,
        default=transport.endpoint.EVENTS_RETENTION,
        help="seconds transport events are kept (default 7 days)",
    )
    serve.add_argument(
        "--events-max",
        type=_positive_int,
        default=transport.endpoint.EVENTS_MAX,
        help="transport events kept at most, the newest (default %(default)s)",
    )
    _add_service_flags(serve)
    serve.set_defaults(run=_serve)

    route = commands.add_parser(
        "routes", help="routes, the transmission queue and transport events"
    )
    route_actions = route.add_subparsers(dest="action")
    route.add_argument("--db", default=db_default, help="SQLAlchemy URL")
    route.add_argument("--limit", type=_positive_int, default=20, help="rows of each list")
    route.add_argument("--json", action="store_true", help="print every list as one JSON object")
    create = route_actions.add_parser("create", help="CREATE ROUTE")
    create.add_argument("name")
    create.add_argument("service", help="the remote service")
    create.add_argument("address", help="tcp://host:port of its broker, or LOCAL")
    create.add_argument("--broker-instance", help="only that broker")
    drop = route_actions.add_parser("drop", help="DROP ROUTE")
    drop.add_argument("name")
    route.set_defaults(run=_routes)

    worker = commands.add_parser(
        "worker", help="a Spark driver whose readers run the tasks of a target queue"
    )
    worker.add_argument("--db", default=db_default, help="SQLAlchemy URL")
    worker.add_argument("--service", default=scheduler.Target.service, help="target service")
    worker.add_argument("--queue", default=scheduler.Target.queue, help="target queue")
    worker.add_argument("--master", help="Spark master (default: spark-submit's, else local[*])")
    worker.add_argument(
        "--max-readers", type=_positive_int, default=4, help="tasks at once in this driver"
    )
    worker.add_argument(
        "--queue-readers",
        type=_positive_int,
        help="most tasks at once on the queue in all its workers together (the queue's "
        "max_queue_readers; default: --max-readers, times the launched workers plus one)",
    )
    worker.add_argument(
        "--conf", action="append", default=[], metavar="KEY=VALUE", help="a Spark setting"
    )
    worker.add_argument("--app-name", default="scheduler-lib worker", help="Spark app name")
    worker.add_argument(
        "--no-init",
        dest="init",
        action="store_false",
        help="do not (re)write the target's settings (workers started by another worker)",
    )
    worker.add_argument(
        "--idle-exit",
        type=_positive_seconds,
        help="leave after this many seconds without a running reader (readers stay "
        "$SCHEDULER_LIB_EXECUTOR_IDLE, 10 s, after their last task; default: never; 30 for "
        "workers started by external activation)",
    )
    worker.add_argument(
        "--launch-command",
        help="start this command (e.g. spark-submit ...) for one more worker when this "
        "driver is full and tasks wait (external activation)",
    )
    worker.add_argument(
        "--max-launched",
        type=_positive_int,
        help="most launched workers at once (alone: launch this same worker command)",
    )
    worker.add_argument(
        "--entry-script",
        action="store_true",
        help="print the path of the script spark-submit runs to start a worker, and exit",
    )
    _add_service_flags(worker)
    worker.set_defaults(run=_worker)

    queues = commands.add_parser("queues", help="queues, monitors and running readers")
    queues.add_argument("--db", default=db_default, help="SQLAlchemy URL")
    queues.add_argument("--json", action="store_true", help="print as JSON")
    queues.set_defaults(run=_queues)

    poison = commands.add_parser(
        "poison", help="poison messages taken off their queues: list, show, replay, drop"
    )
    actions = poison.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="logged and parked poison messages")
    listing.add_argument("--db", default=db_default, help="SQLAlchemy URL")
    listing.add_argument("--queue", help="only this queue's")
    listing.add_argument(
        "--state", choices=["LOGGED", "PARKED"], type=str.upper, help="only this state"
    )
    listing.add_argument("--json", action="store_true", help="print as JSON")
    for action, text in (
        ("show", "print poison messages with their bodies and failure history"),
        ("replay", "put exactly these messages back on their conversations' queues"),
        ("drop", "delete exactly these messages for good"),
    ):
        sub = actions.add_parser(action, help=text)
        sub.add_argument("--db", default=db_default, help="SQLAlchemy URL")
        sub.add_argument("ids", nargs="+", type=_poison_id, metavar="ID", help="poison id")
        if action == "show":
            sub.add_argument("--json", action="store_true", help="print as JSON")
    poison.set_defaults(run=_poison)

    run = commands.add_parser("run", help="run the waves of a plan file (YAML) and report")
    run.add_argument("plan", help="the plan file")
    run.add_argument("--db", default=db_default, help="SQLAlchemy URL")
    run.add_argument("--policy", choices=["fail_fast", "continue"], help="overrides the plan's")
    run.add_argument("--max-in-flight", type=_positive_int, help="overrides the plan's")
    run.add_argument("--target", help="target service (overrides the plan's)")
    run.add_argument(
        "--serve",
        action="store_true",
        help="also run the target's executors in this process while the plan runs",
    )
    run.add_argument("--json", action="store_true", help="print the report as JSON")
    run.add_argument(
        "--reader-wait",
        type=_seconds,
        default=reporting.READER_WAIT,
        metavar="SECONDS",
        help="how long to wait for a `serve` or `worker` to serve the target before "
        f"refusing to send (default {reporting.READER_WAIT:g})",
    )
    run.add_argument(
        "--wait-for-readers",
        action="store_true",
        help="wait for ever for something to serve the target (it may start later)",
    )
    run.set_defaults(run=_run)

    status = commands.add_parser("status", help="what runs now, the recent log, semaphores")
    status.add_argument("--db", default=db_default, help="SQLAlchemy URL")
    status.add_argument("--limit", type=_positive_int, default=20, help="recent log rows")
    status.add_argument("--json", action="store_true", help="print as JSON")
    status.set_defaults(run=_status)

    ddl = commands.add_parser("ddl", help="print the schema's DDL as the migrations create it")
    ddl.add_argument("--dialect", choices=["postgresql", "sqlite"], required=True)
    ddl.add_argument("--schema", choices=["broker", "scheduler"], default="broker")
    ddl.set_defaults(run=_ddl)
    for command in commands.choices.values():
        if any("--db" in action.option_strings for action in command._actions):
            command.add_argument(
                "--reconnect-timeout",
                type=_seconds,
                metavar="SECONDS",
                help="how long to keep trying while the database is unreachable (restart, "
                f"failover) before giving up (default: ${connections.RECONNECT_TIMEOUT_ENV} "
                f"or {connections.RECONNECT_TIMEOUT:.0f})",
            )
    return parser


def _seconds(text: str, *, positive: bool = False) -> float:
    """A duration argument: a finite number of seconds, ``>= 0`` (``> 0`` when
    ``positive``), checked as it is parsed — ``nan``, ``inf`` or a negative value is one
    error line naming the option, not a wait that never ends or a loop that never waits."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        shown = text if len(text) <= 40 else text[:37] + "..."
        bound = "> 0" if positive else ">= 0"
        raise argparse.ArgumentTypeError(f"expected a number of seconds {bound}, got {shown!r}")
    return value


def _positive_seconds(text: str) -> float:
    return _seconds(text, positive=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``scheduler-lib``."""
    args = build_parser().parse_args(argv)
    if getattr(args, "reconnect_timeout", None) is not None:
        # Every broker of this command, and of the reader processes it starts, uses it.
        os.environ[connections.RECONNECT_TIMEOUT_ENV] = str(args.reconnect_timeout)
    if args.command not in ("serve", "worker"):
        # A command that reports (run, status, ...) says what matters itself: an outage
        # as a progress line, a failure as one error line. The long-running services log.
        logging.getLogger("scheduler_lib").addHandler(logging.NullHandler())
    try:
        if args.command in ("run", "serve", "worker"):
            # Their readers read it as they start: a bad value is said here, at once.
            from scheduler_lib.scheduler.executor import prefetch_setting

            prefetch_setting()
        return int(args.run(args))
    except KeyboardInterrupt as exc:
        if args.verbose:
            raise
        # (`run` says more where it can: what became of its tasks)
        print("scheduler-lib: interrupted", file=sys.stderr)
        return _interrupted_code(exc)
    except Exception as exc:
        if args.verbose:
            raise
        code, line = _failure(exc)
        print(f"scheduler-lib: error: {line}", file=sys.stderr)
        return code


EXIT_FAILED = 1  # a task of the plan failed (run)
EXIT_ERROR = 2  # bad input or a refused operation: the message says what to change
# the database could not be reached or opened, or has no (current) scheduler_lib schema
EXIT_DATABASE = 3


def _failure(exc: Exception) -> tuple[int, str]:
    """(exit code, one line) for an error that ends a command: what was wrong and how
    to fix it, never a traceback (``--verbose`` shows it) nor a password."""
    if isinstance(exc, DatabaseUnavailable | CannotConnect | NoSchema):
        return EXIT_DATABASE, _one_line(exc)
    if isinstance(exc, BrokerError):
        return EXIT_ERROR, _one_line(exc)
    if isinstance(exc, sa.exc.DBAPIError):  # opening it: a missing database, a bad path
        return EXIT_DATABASE, "cannot use the database: " + _one_line(exc.orig or exc)
    raise exc  # a bug of ours: its traceback is what a report needs


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
