"""Alembic environment for the scheduler schema; see
:func:`scheduler_lib.broker.schema.run_env` (there is no alembic.ini)."""

from scheduler_lib.broker.schema import run_env

run_env()
