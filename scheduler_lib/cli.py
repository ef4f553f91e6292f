"""The ``scheduler-lib`` command."""

from __future__ import annotations

import argparse
import os
import sys

from scheduler_lib import __version__
from scheduler_lib.broker import BrokerError, engine, schema

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
