"""The ``scheduler-lib`` command."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from scheduler_lib import __version__
from scheduler_lib.broker import Broker, BrokerError, activation, engine, schema

DB_ENV = "SCHEDULER_LIB_DB"  # default for --db


def _init(args: argparse.Namespace) -> int:
    eng = engine.create_engine(args.db)
    try:
        before = schema.current(eng)
        schema.migrate(eng)
        after = schema.current(eng)
    finally:
        eng.dispose()
    if before == after:
        print(f"{eng.url.render_as_string()}: schema already at revision {after}")
    else:
        print(f"{eng.url.render_as_string()}: schema upgraded from {before or 'empty'} to {after}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    """Run queue monitors and their readers until SIGTERM / SIGINT."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with Broker(args.db) as broker, activation.running(broker, reader_mode=args.readers) as rt:
        print(f"serving {broker.url.render_as_string()} (runtime {rt.runtime_id})", flush=True)
        while not stop.wait(0.5):  # a bounded wait, so the signal handler always gets to run
            pass
    print("stopped", flush=True)
    return 0


def _queues(args: argparse.Namespace) -> int:
    """Queues with their status, activation, monitors and readers."""
    with Broker(args.db, timers=False) as broker:
        monitors = {m["queue_name"]: m for m in broker.queue_monitors()}
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
        for q in broker.queues():
            m = monitors.get(q.name, {})
            last_empty = m.get("last_empty_rowset_at")
            rows.append(
                (
                    q.name,
                    "ON" if q.is_receive_enabled else "OFF (disabled)",
                    q.activation_procedure or "-" if q.is_activation_enabled else "off",
                    str(m.get("tasks_running", 0)),
                    str(q.max_readers),
                    m.get("state", "-"),
                    str(m.get("messages_ready", "-")),
                    "-"
                    if last_empty is None
                    else time.strftime("%H:%M:%S", time.localtime(last_empty)),
                )
            )
        _print_table(rows)
        tasks = broker.activated_tasks()
        if tasks:
            print()
            readers: list[tuple[str, ...]] = [
                (
                    "reader task",
                    "queue",
                    "procedure",
                    "execute as",
                    "runtime",
                    "host",
                    "pid",
                    "started",
                )
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
                        time.strftime("%H:%M:%S", time.localtime(t["started_at"])),
                    )
                )
            _print_table(readers)
    return 0


def _print_table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


def _ddl(args: argparse.Namespace) -> int:
    sys.stdout.write(schema.offline_sql(f"{args.dialect}://"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scheduler-lib", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    init = commands.add_parser("init", help="create or upgrade the broker schema (idempotent)")
    init.add_argument(
        "--db",
        default=os.environ.get(DB_ENV, engine.DEFAULT_URL),
        help=f"SQLAlchemy URL (default: ${DB_ENV} or {engine.DEFAULT_URL})",
    )
    init.set_defaults(run=_init)

    db_default = os.environ.get(DB_ENV, engine.DEFAULT_URL)
    serve = commands.add_parser("serve", help="run queue monitors and activated readers")
    serve.add_argument("--db", default=db_default, help="SQLAlchemy URL")
    serve.add_argument("--readers", choices=["thread", "process"], default="thread")
    serve.set_defaults(run=_serve)

    queues = commands.add_parser("queues", help="queues, monitors and running readers")
    queues.add_argument("--db", default=db_default, help="SQLAlchemy URL")
    queues.set_defaults(run=_queues)

    ddl = commands.add_parser("ddl", help="print the schema's DDL as the migrations create it")
    ddl.add_argument("--dialect", choices=["postgresql", "sqlite"], required=True)
    ddl.set_defaults(run=_ddl)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``scheduler-lib``."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except BrokerError as exc:
        print(f"scheduler-lib: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
