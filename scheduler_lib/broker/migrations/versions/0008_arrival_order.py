"""RECEIVE inside a group serves conversations in the arrival order of their oldest ready
message, not in the order of their handles' text (issue 22.5).

The group index is ordered by level, then arrival (``message_id``), instead of by level,
handle and sequence number: the first ``top`` rows of a group in that order hold the
oldest ready message of every conversation one RECEIVE TOP (``top``) can serve from (the
rows ahead of a conversation's oldest one belong to the conversations served before it),
so RECEIVE finds its conversations in ``top`` index rows and then reads each one's
ready messages in sequence order — never the whole group. For that,
``ix_queue_messages_conversation`` gets the status between the handle and the sequence
number: a conversation's ready messages are then one ordered range of it, whatever the
planner's statistics say (with the status outside it, PostgreSQL read a 4,000-message
conversation in full through a bitmap scan to sort it, on freshly filled tables). Two
indexes replace two: sends and receives write no more than before.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_queue_messages_conversation", "queue_messages")
    op.create_index(
        "ix_queue_messages_conversation",
        "queue_messages",
        ["conversation_handle", "status", "message_sequence_number"],
    )
    op.drop_index("ix_queue_messages_group", "queue_messages")
    op.create_index(
        "ix_queue_messages_group",
        "queue_messages",
        ["conversation_group_id", sa.text("priority DESC"), "message_id"],
        postgresql_where=sa.text("status = 1"),
        sqlite_where=sa.text("status = 1"),
    )


def downgrade() -> None:
    op.drop_index("ix_queue_messages_conversation", "queue_messages")
    op.create_index(
        "ix_queue_messages_conversation",
        "queue_messages",
        ["conversation_handle", "message_sequence_number"],
    )
    op.drop_index("ix_queue_messages_group", "queue_messages")
    op.create_index(
        "ix_queue_messages_group",
        "queue_messages",
        [
            "conversation_group_id",
            sa.text("priority DESC"),
            "conversation_handle",
            "message_sequence_number",
        ],
        postgresql_where=sa.text("status = 1"),
        sqlite_where=sa.text("status = 1"),
    )
