"""Targets say whether a task may start before its start is on disk.

``durable_start`` true (every existing target): a task's start commits durably before the
task runs, so a database crash can never run it twice. False, for targets whose tasks'
effects are idempotent: the start commits without waiting for the WAL flush and the task
runs at once (docs/scheduler.md, "Durable or lazy start").

Revision ID: s0006
Revises: s0005
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "s0006"
down_revision = "s0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "scheduler_targets",
        sa.Column("durable_start", sa.Boolean, nullable=False, server_default=sa.true()),
    )


def downgrade() -> None:
    with op.batch_alter_table("scheduler_targets") as batch:
        batch.drop_column("durable_start")
