"""Alembic environment for the broker schema; see :func:`scheduler_lib.broker.schema.run_env`
(there is no alembic.ini)."""

from scheduler_lib.broker import schema

schema.run_env()
