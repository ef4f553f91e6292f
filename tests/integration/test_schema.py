"""The schema: migrations are idempotent, sql/ holds exactly what they build, and data
migrations carry old rows over."""

from __future__ import annotations

import pathlib
import sqlite3
import uuid
import warnings
from typing import Any

import alembic.command
import alembic.config
import psycopg
import pytest
import sqlalchemy as sa

from scheduler_lib.broker import Broker, schema
from scheduler_lib.broker.db import engine
from scheduler_lib.scheduler import MIGRATIONS, TaskScheduler

SQL_DIR = pathlib.Path(__file__).resolve().parents[2] / "sql"


def _reflect(url: str) -> dict[str, Any]:
    """Tables, columns, keys, indexes and checks as SQLAlchemy's inspector sees them."""
    eng = sa.create_engine(engine.normalize_url(url))
    try:
        with warnings.catch_warnings():
            # SQLite's reflection skips expression indexes; they are compared below.
            warnings.simplefilter("ignore", sa.exc.SAWarning)
            return _reflect_with(eng)
    finally:
        eng.dispose()


def _reflect_with(eng: sa.Engine) -> dict[str, Any]:
    inspector = sa.inspect(eng)
    shape: dict[str, Any] = {"views": sorted(inspector.get_view_names())}
    for table in sorted(inspector.get_table_names()):
        shape[table] = {
            "columns": [
                (c["name"], str(c["type"]), c["nullable"], str(c.get("default")))
                for c in inspector.get_columns(table)
            ],
            "pk": inspector.get_pk_constraint(table)["constrained_columns"],
            "fks": sorted(
                (tuple(f["constrained_columns"]), f["referred_table"], str(f.get("options")))
                for f in inspector.get_foreign_keys(table)
            ),
            "indexes": sorted(
                (
                    i["name"],
                    tuple(str(c) for c in i["column_names"]),
                    bool(i["unique"]),
                    str(sorted((k, str(v)) for k, v in i.get("dialect_options", {}).items())),
                )
                for i in inspector.get_indexes(table)
            ),
            "uniques": sorted(
                (u["name"], tuple(u["column_names"]))
                for u in inspector.get_unique_constraints(table)
            ),
            "checks": sorted(
                (c["name"], c["sqltext"]) for c in inspector.get_check_constraints(table)
            ),
        }
    with eng.connect() as conn:
        if eng.dialect.name == "sqlite":
            rows = conn.exec_driver_sql(
                "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
            )
        else:
            rows = conn.exec_driver_sql(
                "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'"
            )
        shape["index definitions"] = sorted((name, " ".join(sql.split())) for name, sql in rows)
    return shape


def _apply_script(url: str, script: str) -> None:
    parsed = engine.normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        with sqlite3.connect(parsed.database) as conn:
            conn.executescript(script)
    else:
        conninfo = parsed.set(drivername="postgresql").render_as_string(hide_password=False)
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(script)  # type: ignore[call-overload]


COMPONENTS = {"schema": schema.BROKER, "scheduler": MIGRATIONS}


@pytest.mark.parametrize("component", sorted(COMPONENTS))
@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_sql_dir_is_what_the_migrations_emit(dialect: str, component: str) -> None:
    # Given the reference DDL kept in sql/ for DBAs
    kept = (SQL_DIR / f"{component}_{dialect}.sql").read_text()
    # When the migrations render their DDL offline
    emitted = schema.offline_sql(f"{dialect}://", COMPONENTS[component])
    # Then the two are identical (regenerate with `make sql` after adding a migration)
    assert kept == emitted, f"sql/{component}_{dialect}.sql is stale: run `make sql`"


def test_sql_dir_builds_the_same_schema_as_the_migrations(
    db_url: str, tmp_path: pathlib.Path
) -> None:
    # Given one database migrated through Alembic (the broker, then the scheduler)
    migrated = engine.create_engine(db_url)
    schema.migrate(migrated)
    schema.migrate(migrated, migrations=MIGRATIONS)
    migrated.dispose()
    expected = _reflect(db_url)
    # When the reference DDL is applied to a second, empty database of the same kind
    if db_url.startswith("sqlite"):
        other_url = f"sqlite:///{tmp_path / 'from_ddl.db'}"
    else:
        admin = sa.create_engine(db_url, isolation_level="AUTOCOMMIT")
        name = engine.normalize_url(db_url).database + "_ddl"
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        admin.dispose()
        other_url = (
            engine.normalize_url(db_url).set(database=name).render_as_string(hide_password=False)
        )
    dialect = "sqlite" if db_url.startswith("sqlite") else "postgresql"
    try:
        for component in ("schema", "scheduler"):
            _apply_script(other_url, (SQL_DIR / f"{component}_{dialect}.sql").read_text())
        # Then both have the same tables, columns, keys, indexes and checks
        assert _reflect(other_url) == expected
    finally:
        if dialect == "postgresql":
            admin = sa.create_engine(db_url, isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            admin.dispose()


def test_migrate_is_idempotent(db_url: str) -> None:
    # Given a database at the newest revision
    eng = engine.create_engine(db_url)
    try:
        schema.migrate(eng)
        tables = sa.inspect(eng).get_table_names()
        # When it is migrated again
        schema.migrate(eng)
        # Then nothing changed and it is still at head
        assert schema.current(eng) == schema.head()
        assert sa.inspect(eng).get_table_names() == tables
        assert "queue_messages" in tables
    finally:
        eng.dispose()


def _scheduler_config() -> alembic.config.Config:
    """Alembic's configuration for the scheduler's migrations, as ``schema.migrate`` makes it."""
    config = alembic.config.Config()
    config.set_main_option("script_location", MIGRATIONS.script_location)
    config.set_main_option("version_table", MIGRATIONS.version_table)
    return config


def test_the_wave_migration_numbers_old_rows_from_one(db_url: str) -> None:
    # Given a database at s0004, where the log counted waves from 0: a scheduler that ran
    # two waves (2 tasks, then 1) and a task sent outside any wave
    eng = engine.create_engine(db_url)
    handle = str(uuid.uuid4())
    try:
        schema.migrate(eng)
        schema.migrate(eng, "s0004", migrations=MIGRATIONS)
        with eng.begin() as conn:
            for name, wave in (("a", 0), ("b", 0), ("c", 1), ("loose", None)):
                conn.execute(
                    sa.text(
                        "INSERT INTO execution_log (caller_id, scheduler_handle, "
                        "target_service, wave, task_name, task_kind, task_body, sent_at, "
                        "start_time, end_time, status, attempts) VALUES ('old:1:MainThread', "
                        ":handle, 'ServiceAsyncTarget', :wave, :name, 'python', '{}', 1.0, "
                        "1.0, 2.0, 'SUCCEEDED', 1)"
                    ),
                    {"handle": handle, "wave": wave, "name": name},
                )
        # When the scheduler's migrations run to head (what `scheduler-lib init` does)
        with Broker(db_url) as broker:
            scheduler = TaskScheduler(broker)
            # Then the library reads the first wave as 1 and the second as 2; no wave
            # stays no wave
            rows = scheduler.log(handle)
            assert [(r["task_name"], r["wave"]) for r in rows] == [
                ("a", 1),
                ("b", 1),
                ("c", 2),
                ("loose", None),
            ]
        # And the downgrade gives the old numbers back
        config = _scheduler_config()
        with eng.begin() as conn:
            config.attributes["connection"] = conn
            alembic.command.downgrade(config, "s0004")
        with eng.connect() as conn:
            waves = conn.execute(
                sa.text(
                    "SELECT wave FROM execution_log WHERE scheduler_handle = :h ORDER BY log_id"
                ),
                {"h": handle},
            ).scalars()
            assert list(waves) == [0, 0, 1, None]
    finally:
        eng.dispose()
