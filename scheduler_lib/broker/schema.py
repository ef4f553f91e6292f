"""Creating and upgrading the broker schema with the Alembic migrations in the package."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

SCRIPT_LOCATION = "scheduler_lib.broker:migrations"
# Not Airflow's alembic_version, for when both share one database.
VERSION_TABLE = "broker_alembic_version"


def _config() -> Config:
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    return config


def head() -> str:
    """The newest migration's revision id."""
    revision = ScriptDirectory.from_config(_config()).get_current_head()
    assert revision is not None
    return revision


def current(engine: sa.Engine) -> str | None:
    """The revision the database is at, or ``None`` before the first migration."""
    with engine.connect() as conn:
        return MigrationContext.configure(
            conn, opts={"version_table": VERSION_TABLE}
        ).get_current_revision()


def migrate(engine: sa.Engine, revision: str = "head") -> None:
    """Upgrade the database to ``revision`` (idempotent: a no-op when already there)."""
    config = _config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, revision)


def offline_sql(dialect_url: str) -> str:
    """The DDL the migrations run, as a script a DBA can read and apply (``sql/``).

    :param dialect_url: a URL naming the dialect only, e.g. ``postgresql://`` or ``sqlite://``
    """
    config = _config()
    config.set_main_option("sqlalchemy.url", dialect_url)
    buffer = io.StringIO()
    config.output_buffer = buffer
    with redirect_stdout(buffer):
        command.upgrade(config, "head", sql=True)
    return buffer.getvalue()
