"""Alembic environment for the broker schema.

Run through :func:`scheduler_lib.broker.schema.migrate`, which passes the connection (or,
offline, the URL) in ``config.attributes``; there is no alembic.ini.
"""

from alembic import context

from scheduler_lib.broker.schema import VERSION_TABLE

config = context.config

if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        literal_binds=True,
        version_table=VERSION_TABLE,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    connection = config.attributes["connection"]
    context.configure(
        connection=connection,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",
        transactional_ddl=True,
    )
    with context.begin_transaction():
        context.run_migrations()
