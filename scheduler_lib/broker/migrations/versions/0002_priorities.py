"""Conversation priorities, the broker-wide honor_broker_priority switch, RECEIVE aging.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

NAME = sa.String(128)
TIME = sa.Float(precision=53)


def upgrade() -> None:
    # NULL in contract / local / remote means ANY, as in sys.conversation_priorities.
    op.create_table(
        "conversation_priorities",
        sa.Column("priority_name", NAME, primary_key=True),
        sa.Column("contract_name", NAME),
        sa.Column("local_service_name", NAME),
        sa.Column("remote_service_name", NAME),
        sa.Column("priority_level", sa.SmallInteger, nullable=False),
        sa.Column("created_at", TIME, nullable=False),
        sa.CheckConstraint("priority_level BETWEEN 1 AND 10", name="priority_level_in_range"),
    )
    # As in SQL Server, no two priorities may name the same contract/local/remote triple.
    op.create_index(
        "uq_conversation_priorities_match",
        "conversation_priorities",
        [
            sa.text("coalesce(contract_name, '')"),
            sa.text("coalesce(local_service_name, '')"),
            sa.text("coalesce(remote_service_name, '')"),
        ],
        unique=True,
    )
    op.create_table(
        "broker_settings",
        sa.Column("setting_name", NAME, primary_key=True),
        sa.Column("setting_value", sa.String(256), nullable=False),
    )
    op.execute(
        "INSERT INTO broker_settings (setting_name, setting_value) "
        "VALUES ('honor_broker_priority', 'false')"
    )
    # Seconds after which a waiting message is served ahead of higher levels; NULL = off.
    # A plain ADD COLUMN (no table copy on SQLite, where foreign keys point at queues).
    op.add_column("queues", sa.Column("receive_aging_seconds", TIME))
    # Aged messages are found oldest first without a scan.
    op.create_index(
        "ix_queue_messages_age",
        "queue_messages",
        ["queue_name", "enqueued_at"],
        postgresql_where=sa.text("status = 1"),
        sqlite_where=sa.text("status = 1"),
    )


def downgrade() -> None:
    op.drop_index("ix_queue_messages_age", "queue_messages")
    with op.batch_alter_table("queues") as batch:
        batch.drop_column("receive_aging_seconds")
    op.drop_table("broker_settings")
    op.drop_index("uq_conversation_priorities_match", "conversation_priorities")
    op.drop_table("conversation_priorities")
