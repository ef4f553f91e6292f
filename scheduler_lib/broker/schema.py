"""Creating and upgrading schemas with the Alembic migrations in the package.

The broker's schema is one set of migrations; a layer above it (the scheduler) brings its
own, with its own version table, so each is upgraded on its own and both can share a
database with Airflow's ``alembic_version``.
"""

from __future__ import annotations

import dataclasses
import io
import threading
from contextlib import redirect_stdout

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory


@dataclasses.dataclass(frozen=True)
class MigrationSet:
    """Where a component's migrations live and which table records its revision."""

    script_location: str
    version_table: str


BROKER = MigrationSet("scheduler_lib.broker:migrations", "broker_alembic_version")
SCRIPT_LOCATION = BROKER.script_location
# Not Airflow's alembic_version, for when both share one database.
VERSION_TABLE = BROKER.version_table


def _config(migrations: MigrationSet) -> Config:
    config = Config()
    config.set_main_option("script_location", migrations.script_location)
    config.set_main_option("version_table", migrations.version_table)
    return config


_MIGRATING = threading.Lock()  # see migrate()


def head(migrations: MigrationSet = BROKER) -> str:
    """The newest migration's revision id."""
    revision = ScriptDirectory.from_config(_config(migrations)).get_current_head()
    assert revision is not None
    return revision


def current(engine: sa.Engine, migrations: MigrationSet = BROKER) -> str | None:
    """The revision the database is at, or ``None`` before the first migration."""
    with engine.connect() as conn:
        return MigrationContext.configure(
            conn, opts={"version_table": migrations.version_table}
        ).get_current_revision()


def migrate(engine: sa.Engine, revision: str = "head", migrations: MigrationSet = BROKER) -> None:
    """Upgrade the database to ``revision`` (idempotent: a no-op when already there).

    One at a time per process: alembic runs a migration through module-level proxies
    (``alembic.context``), which threads migrating at once would tear from each other —
    as the readers of a wave, started together, each preparing the scheduler's schema.
    """
    config = _config(migrations)
    with _MIGRATING, engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, revision)


def offline_sql(dialect_url: str, migrations: MigrationSet = BROKER) -> str:
    """The DDL the migrations run, as a script a DBA can read and apply (``sql/``).

    :param dialect_url: a URL naming the dialect only, e.g. ``postgresql://`` or ``sqlite://``
    """
    config = _config(migrations)
    config.set_main_option("sqlalchemy.url", dialect_url)
    buffer = io.StringIO()
    config.output_buffer = buffer
    with redirect_stdout(buffer):
        command.upgrade(config, "head", sql=True)
    return buffer.getvalue()


def run_env() -> None:
    """The body of every ``env.py`` in this package: run the migrations on the connection
    (or, offline, for the URL) that :func:`migrate` / :func:`offline_sql` passed in."""
    from alembic import context

    config = context.config
    version_table = config.get_main_option("version_table")
    if context.is_offline_mode():
        context.configure(
            url=config.get_main_option("sqlalchemy.url"),
            literal_binds=True,
            version_table=version_table,
            render_as_batch=True,
        )
    else:
        connection = config.attributes["connection"]
        context.configure(
            connection=connection,
            version_table=version_table,
            render_as_batch=connection.dialect.name == "sqlite",
            transactional_ddl=True,
        )
    with context.begin_transaction():
        context.run_migrations()
