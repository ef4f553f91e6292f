"""Eager activation: a queue option that starts a reader per ready message at once (up
to ``max_readers``), for readers that take messages under leases — the task scheduler's
executors, where the tasks of one conversation (a scheduler) run side by side.

Seed 000's rule (a reader more only after RECEIVEs came back empty for a while) is right
for readers that hold a conversation group for the whole of their work: a backlog on one
conversation could use one reader only. A reader that takes under a lease holds the
group only while it takes, so a wave of N tasks can use N readers, and waiting out the
grace for each one made short waves run one task after another.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "queues",
        sa.Column("is_activation_eager", sa.Boolean, nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    with op.batch_alter_table("queues") as batch:
        batch.drop_column("is_activation_eager")
