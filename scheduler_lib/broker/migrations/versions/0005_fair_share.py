"""Fair share between conversations: a queue option that serves conversations in turn
instead of in arrival order.

Each SEND to a queue with ``fair_share`` stamps the message with a virtual time taken
from its sending endpoint's clock: ``fair_clock = max(now, fair_clock + quantum)``. An
idle conversation's next message is stamped "now"; a conversation that sends a burst is
stamped one quantum apart per message. RECEIVE serves the lowest stamp first (within a
priority level), so bursts of several conversations interleave — round-robin — and a
conversation that starts late is not queued behind another's whole backlog. Without the
option every stamp is 0 and the order is arrival order, as before.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

TIME = sa.Float(precision=53)


def upgrade() -> None:
    op.add_column("queues", sa.Column("fair_share_quantum", TIME))  # NULL: arrival order
    op.add_column(
        "conversation_endpoints",
        sa.Column("fair_clock", TIME, nullable=False, server_default="0"),
    )
    op.add_column("queue_messages", sa.Column("fair_at", TIME, nullable=False, server_default="0"))
    op.add_column(
        "transmission_queue", sa.Column("fair_at", TIME, nullable=False, server_default="0")
    )
    # RECEIVE without a filter: the ready message with the highest level, then the lowest
    # stamp, then the first to arrive.
    op.drop_index("ix_queue_messages_ready", "queue_messages")
    op.create_index(
        "ix_queue_messages_ready",
        "queue_messages",
        ["queue_name", sa.text("priority DESC"), "fair_at", "message_id"],
        postgresql_where=sa.text("status = 1"),
        sqlite_where=sa.text("status = 1"),
    )


def downgrade() -> None:
    op.drop_index("ix_queue_messages_ready", "queue_messages")
    op.create_index(
        "ix_queue_messages_ready",
        "queue_messages",
        ["queue_name", sa.text("priority DESC"), "message_id"],
        postgresql_where=sa.text("status = 1"),
        sqlite_where=sa.text("status = 1"),
    )
    with op.batch_alter_table("transmission_queue") as batch:
        batch.drop_column("fair_at")
    with op.batch_alter_table("queue_messages") as batch:
        batch.drop_column("fair_at")
    with op.batch_alter_table("conversation_endpoints") as batch:
        batch.drop_column("fair_clock")
    with op.batch_alter_table("queues") as batch:
        batch.drop_column("fair_share_quantum")
