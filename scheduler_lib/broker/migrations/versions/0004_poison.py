"""Poison messages and failure recovery: the rollback counter, failure details, the
poison-message log / holding queue, per-queue policies, leases for long work.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

NAME = sa.String(128)
HANDLE = sa.String(36)
TIME = sa.Float(precision=53)
ID = sa.BigInteger().with_variant(sa.Integer, "sqlite")  # SQLite autoincrements INTEGER only

EVENT_TYPES_BEFORE = "event_type IN ('QUEUE_ACTIVATION', 'BROKER_QUEUE_DISABLED')"
EVENT_TYPES_AFTER = "event_type IN ('QUEUE_ACTIVATION', 'BROKER_QUEUE_DISABLED', 'POISON_MESSAGE')"


def _message_columns() -> list[sa.Column]:
    """A message as it was on its queue, so it can go back there unchanged."""
    return [
        sa.Column("queue_name", NAME, nullable=False),
        sa.Column("conversation_group_id", HANDLE, nullable=False),
        sa.Column("conversation_handle", HANDLE, nullable=False),
        sa.Column("message_sequence_number", sa.BigInteger, nullable=False),
        sa.Column("message_type_name", NAME, nullable=False),
        sa.Column("message_body", sa.LargeBinary),
        sa.Column("priority", sa.SmallInteger, nullable=False),
        sa.Column("service_name", NAME, nullable=False),
        sa.Column("service_contract_name", NAME, nullable=False),
        sa.Column("enqueued_at", TIME, nullable=False),
    ]


def _event_notifications(check: str, name: str = "event_notifications") -> None:
    op.create_table(
        name,
        sa.Column("notification_name", NAME, primary_key=True),
        sa.Column("queue_name", NAME, nullable=False),
        sa.Column("event_type", sa.String(32), nullable=False),
        sa.Column("to_service_name", NAME, nullable=False),
        sa.Column("conversation_handle", HANDLE),
        sa.Column("created_at", TIME, nullable=False),
        sa.CheckConstraint(check, name="event_type_known"),
    )


def _replace_event_check(check: str) -> None:
    """Widen (or narrow) the event types. SQLite cannot alter a CHECK constraint, so the
    small table is rebuilt there; written out by hand so that offline DDL works too."""
    if op.get_context().dialect.name == "sqlite":
        _event_notifications(check, "event_notifications_new")
        op.execute(
            "INSERT INTO event_notifications_new SELECT notification_name, queue_name, "
            "event_type, to_service_name, conversation_handle, created_at "
            "FROM event_notifications"
        )
        op.drop_index("ix_event_notifications_queue", "event_notifications")
        op.drop_table("event_notifications")
        op.rename_table("event_notifications_new", "event_notifications")
        op.create_index("ix_event_notifications_queue", "event_notifications", ["queue_name"])
    else:
        op.drop_constraint("event_type_known", "event_notifications", type_="check")
        op.create_check_constraint("event_type_known", "event_notifications", check)


def upgrade() -> None:
    # Built-in detection: consecutive rollbacks of transactions that received from the
    # queue (a commit that received resets it), and why a queue is off.
    op.add_column(
        "queues",
        sa.Column("consecutive_rollbacks", sa.Integer, nullable=False, server_default="0"),
    )
    op.add_column("queues", sa.Column("disabled_reason", sa.String(1024)))
    op.add_column("queues", sa.Column("disabled_at", TIME))
    _replace_event_check(EVENT_TYPES_AFTER)
    # The seed's poison_message_details: one row per failure, written OUTSIDE the failed
    # transaction (it rolled back). kind: FAILED (the handler raised and rolled back),
    # EXPIRED (a lease's heartbeat ran out: a silent failure), PARKED (a marker: the
    # message went to the holding queue; failures are counted again from here).
    op.create_table(
        "poison_message_details",
        sa.Column("incident_id", ID, primary_key=True, autoincrement=True),
        sa.Column("queue_name", NAME, nullable=False),
        sa.Column("conversation_handle", HANDLE, nullable=False),
        sa.Column("message_sequence_number", sa.BigInteger, nullable=False),
        sa.Column("message_type_name", NAME, nullable=False),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("error", sa.Text),
        sa.Column("worker", sa.String(256)),
        sa.Column("occurred_at", TIME, nullable=False),
        sa.CheckConstraint("kind IN ('FAILED', 'EXPIRED', 'PARKED')", name="incident_kind_known"),
    )
    op.create_index(
        "ix_poison_message_details_message",
        "poison_message_details",
        ["conversation_handle", "message_sequence_number"],
    )
    # Poison messages taken off their queue: LOGGED (kept for an operator: replay or drop)
    # or PARKED (the holding queue: redelivered at redeliver_at).
    op.create_table(
        "poison_messages",
        sa.Column("poison_id", ID, primary_key=True, autoincrement=True),
        sa.Column("state", sa.String(8), nullable=False),
        *_message_columns(),
        sa.Column("failures", sa.Integer, nullable=False),
        sa.Column("cycles", sa.Integer, nullable=False),
        sa.Column("last_error", sa.Text),
        sa.Column("dispositions", sa.String(256), nullable=False),
        sa.Column("recorded_at", TIME, nullable=False),
        sa.Column("redeliver_at", TIME),
        sa.CheckConstraint("state IN ('LOGGED', 'PARKED')", name="poison_state_known"),
    )
    op.create_index(
        "ix_poison_messages_redeliver",
        "poison_messages",
        ["redeliver_at"],
        postgresql_where=sa.text("state = 'PARKED'"),
        sqlite_where=sa.text("state = 'PARKED'"),
    )
    op.create_index("ix_poison_messages_queue", "poison_messages", ["queue_name", "poison_id"])
    # A queue's poison policy, read by every process that handles its failures (readers,
    # timer threads expiring leases, the CLI).
    op.create_table(
        "poison_policies",
        sa.Column(
            "queue_name",
            NAME,
            sa.ForeignKey("queues.queue_name", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("threshold", sa.Integer, nullable=False),
        sa.Column("dispositions", sa.Text, nullable=False),  # JSON
        sa.Column("updated_at", TIME, nullable=False),
        sa.CheckConstraint("threshold >= 1", name="threshold_positive"),
    )
    # Long work without a long transaction: a message taken under a lease leaves its queue
    # and waits here, with its worker's heartbeat, until the worker completes it. A lease
    # whose heartbeat runs out is a silent failure: the policy retries or fails it.
    op.create_table(
        "message_leases",
        sa.Column("lease_id", HANDLE, primary_key=True),
        *_message_columns(),
        sa.Column("worker", sa.String(256), nullable=False),
        sa.Column("taken_at", TIME, nullable=False),
        sa.Column("heartbeat_at", TIME, nullable=False),
        sa.Column("expires_at", TIME, nullable=False),
    )
    op.create_index("ix_message_leases_expires", "message_leases", ["expires_at"])
    op.create_index("ix_message_leases_conversation", "message_leases", ["conversation_handle"])


def downgrade() -> None:
    op.drop_table("message_leases")
    op.drop_table("poison_policies")
    op.drop_table("poison_messages")
    op.drop_table("poison_message_details")
    op.execute("DELETE FROM event_notifications WHERE event_type = 'POISON_MESSAGE'")
    _replace_event_check(EVENT_TYPES_BEFORE)
    with op.batch_alter_table("queues") as batch:
        batch.drop_column("disabled_at")
        batch.drop_column("disabled_reason")
        batch.drop_column("consecutive_rollbacks")
