"""Activation: activated tasks, queue monitors, event notifications.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

NAME = sa.String(128)
HANDLE = sa.String(36)
TIME = sa.Float(precision=53)


def upgrade() -> None:
    # sys.dm_broker_activated_tasks, made durable: a reader's row lives while its runtime
    # keeps the heartbeat fresh, so a crashed runtime's readers are recognised as gone.
    op.create_table(
        "activated_tasks",
        sa.Column("task_id", HANDLE, primary_key=True),
        sa.Column("queue_name", NAME, nullable=False),
        sa.Column("procedure_name", sa.String(512), nullable=False),
        sa.Column("runtime_id", HANDLE, nullable=False),
        sa.Column("host_name", sa.String(256), nullable=False),
        sa.Column("process_id", sa.Integer, nullable=False),
        sa.Column("reader_name", sa.String(256), nullable=False),
        sa.Column("execute_as", NAME),
        sa.Column("started_at", TIME, nullable=False),
        sa.Column("heartbeat_at", TIME, nullable=False),
    )
    op.create_index("ix_activated_tasks_queue", "activated_tasks", ["queue_name"])
    op.create_index("ix_activated_tasks_runtime", "activated_tasks", ["runtime_id"])
    # sys.dm_broker_queue_monitors: one row per queue that activates (internally or by
    # QUEUE_ACTIVATION events). Unfiltered RECEIVEs that come back empty stamp
    # last_empty_rowset_at: a fresh stamp means somebody is waiting for work.
    op.create_table(
        "queue_monitors",
        sa.Column("queue_name", NAME, primary_key=True),
        sa.Column("state", sa.String(24), nullable=False),
        sa.Column("last_empty_rowset_at", TIME),
        sa.Column("last_activated_at", TIME),
        sa.Column("last_notified_at", TIME),
        # The head of the queue when the last event was posted: once it is gone, a
        # RECEIVE has happened and another event may be posted.
        sa.Column("notified_head_message_id", sa.BigInteger),
        sa.Column("updated_at", TIME, nullable=False),
        sa.CheckConstraint(
            "state IN ('INACTIVE', 'NOTIFIED', 'RECEIVES_OCCURRING')", name="monitor_state_known"
        ),
    )
    # CREATE EVENT NOTIFICATION ... ON QUEUE ... FOR QUEUE_ACTIVATION TO SERVICE ...
    op.create_table(
        "event_notifications",
        sa.Column("notification_name", NAME, primary_key=True),
        sa.Column("queue_name", NAME, nullable=False),
        sa.Column("event_type", sa.String(32), nullable=False),
        sa.Column("to_service_name", NAME, nullable=False),
        sa.Column("conversation_handle", HANDLE),  # the dialog events travel on
        sa.Column("created_at", TIME, nullable=False),
        sa.CheckConstraint(
            "event_type IN ('QUEUE_ACTIVATION', 'BROKER_QUEUE_DISABLED')", name="event_type_known"
        ),
    )
    op.create_index("ix_event_notifications_queue", "event_notifications", ["queue_name"])
    # Like DEFAULT, every broker has what event notifications travel as, so a subscriber's
    # service can accept PostEventNotification before the first subscription exists.
    op.execute(
        "INSERT INTO message_types (message_type_name, validation, created_at) "
        "VALUES ('EventNotification', 'JSON', 0)"
    )
    op.execute(
        "INSERT INTO contracts (contract_name, created_at) VALUES ('PostEventNotification', 0)"
    )
    op.execute(
        "INSERT INTO contract_message_types (contract_name, message_type_name, sent_by) "
        "VALUES ('PostEventNotification', 'EventNotification', 'INITIATOR')"
    )


def downgrade() -> None:
    op.execute("DELETE FROM contracts WHERE contract_name = 'PostEventNotification'")
    op.execute("DELETE FROM message_types WHERE message_type_name = 'EventNotification'")
    op.drop_table("event_notifications")
    op.drop_table("queue_monitors")
    op.drop_table("activated_tasks")
