"""Targets on another broker: the target broker's copy of a task's row.

When the initiator and the target service live on two brokers (two databases linked by
the transport), the initiator's ``execution_log`` row is out of the executor's reach. The
executor then keeps a row of its own for the run — who, when, how it ended — with the
initiator's log id in ``origin_log_id``, and answers with everything the initiator needs
to complete its row from the ``AsyncDone``.

Revision ID: s0004
Revises: s0003
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "s0004"
down_revision = "s0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("execution_log", sa.Column("origin_log_id", sa.BigInteger))
    op.create_index(
        "ix_execution_log_origin",
        "execution_log",
        ["scheduler_handle", "origin_log_id"],
        unique=True,  # one copy per task, however often its message is delivered
        postgresql_where=sa.text("origin_log_id IS NOT NULL"),
        sqlite_where=sa.text("origin_log_id IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_execution_log_origin", table_name="execution_log")
    with op.batch_alter_table("execution_log") as batch:
        batch.drop_column("origin_log_id")
