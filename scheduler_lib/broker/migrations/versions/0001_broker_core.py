"""Broker core: catalog, conversations, queues, transmission queue.

Revision ID: 0001
Revises:
Create Date: 2026-11-22

Times are seconds since the epoch (UTC) in double precision: one representation that
compares and indexes the same on every backend. The monitoring views in sql/ show them as
timestamps.
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

NAME = sa.String(128)  # SQL Server's sysname length
HANDLE = sa.String(36)  # UUID in its canonical text form
TIME = sa.Float(precision=53)  # seconds since the epoch, UTC


def upgrade() -> None:
    op.create_table(
        "message_types",
        sa.Column("message_type_name", NAME, primary_key=True),
        sa.Column("validation", sa.String(16), nullable=False),
        sa.Column("created_at", TIME, nullable=False),
        sa.CheckConstraint(
            "validation IN ('NONE', 'EMPTY', 'WELL_FORMED_XML', 'JSON')", name="validation_known"
        ),
    )
    op.create_table(
        "contracts",
        sa.Column("contract_name", NAME, primary_key=True),
        sa.Column("created_at", TIME, nullable=False),
    )
    op.create_table(
        "contract_message_types",
        sa.Column(
            "contract_name",
            NAME,
            sa.ForeignKey("contracts.contract_name", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column(
            "message_type_name",
            NAME,
            sa.ForeignKey("message_types.message_type_name"),
            primary_key=True,
        ),
        sa.Column("sent_by", sa.String(9), nullable=False),
        sa.CheckConstraint("sent_by IN ('INITIATOR', 'TARGET', 'ANY')", name="sent_by_known"),
    )
    op.create_table(
        "queues",
        sa.Column("queue_name", NAME, primary_key=True),
        sa.Column("is_receive_enabled", sa.Boolean, nullable=False),
        sa.Column("is_retention_enabled", sa.Boolean, nullable=False),
        sa.Column("is_activation_enabled", sa.Boolean, nullable=False),
        sa.Column("activation_procedure", sa.String(512)),
        sa.Column("max_readers", sa.Integer, nullable=False),
        sa.Column("execute_as", NAME),
        sa.Column("is_poison_message_handling_enabled", sa.Boolean, nullable=False),
        # Receivers blocked in WAITFOR on PostgreSQL; senders NOTIFY only when it is > 0.
        sa.Column("waiting_receivers", sa.Integer, nullable=False, server_default="0"),
        sa.Column("created_at", TIME, nullable=False),
        sa.Column("modified_at", TIME, nullable=False),
        sa.CheckConstraint("max_readers >= 0", name="max_readers_not_negative"),
    )
    op.create_table(
        "services",
        sa.Column("service_name", NAME, primary_key=True),
        sa.Column("queue_name", NAME, sa.ForeignKey("queues.queue_name"), nullable=False),
        sa.Column("created_at", TIME, nullable=False),
    )
    op.create_index("ix_services_queue_name", "services", ["queue_name"])
    op.create_table(
        "service_contracts",
        sa.Column(
            "service_name",
            NAME,
            sa.ForeignKey("services.service_name", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column(
            "contract_name", NAME, sa.ForeignKey("contracts.contract_name"), primary_key=True
        ),
    )
    # A group row is only a lock object: RECEIVE locks it (FOR UPDATE SKIP LOCKED on
    # PostgreSQL) and nothing on the send path ever writes it, so sends never wait on a
    # receiver.
    op.create_table(
        "conversation_groups",
        sa.Column("conversation_group_id", HANDLE, primary_key=True),
        sa.Column("queue_name", NAME, nullable=False),
        sa.Column("created_at", TIME, nullable=False),
    )
    op.create_table(
        "conversation_endpoints",
        sa.Column("conversation_handle", HANDLE, primary_key=True),
        sa.Column("conversation_id", HANDLE, nullable=False),
        sa.Column("is_initiator", sa.Boolean, nullable=False),
        sa.Column("service_name", NAME, nullable=False),
        sa.Column("far_service_name", NAME, nullable=False),
        sa.Column("contract_name", NAME, nullable=False),
        sa.Column("queue_name", NAME, nullable=False),
        sa.Column("conversation_group_id", HANDLE, nullable=False),
        sa.Column("state", sa.String(2), nullable=False),
        sa.Column("priority", sa.SmallInteger, nullable=False),
        sa.Column("send_sequence", sa.BigInteger, nullable=False),  # next number to send
        sa.Column("receive_sequence", sa.BigInteger, nullable=False),  # next number expected
        sa.Column("lifetime_expires_at", TIME),
        sa.Column("timer_due_at", TIME),
        sa.Column("created_at", TIME, nullable=False),
        sa.UniqueConstraint("conversation_id", "is_initiator", name="uq_conversation_side"),
        sa.CheckConstraint(
            "state IN ('SO', 'SI', 'CO', 'DI', 'DO', 'ER', 'CD')", name="state_known"
        ),
        sa.CheckConstraint("priority BETWEEN 1 AND 10", name="priority_in_range"),
    )
    op.create_index(
        "ix_conversation_endpoints_group", "conversation_endpoints", ["conversation_group_id"]
    )
    op.create_index(
        "ix_conversation_endpoints_timer",
        "conversation_endpoints",
        ["timer_due_at"],
        postgresql_where=sa.text("timer_due_at IS NOT NULL"),
        sqlite_where=sa.text("timer_due_at IS NOT NULL"),
    )
    op.create_index(
        "ix_conversation_endpoints_lifetime",
        "conversation_endpoints",
        ["lifetime_expires_at"],
        postgresql_where=sa.text("lifetime_expires_at IS NOT NULL AND state <> 'ER'"),
        sqlite_where=sa.text("lifetime_expires_at IS NOT NULL AND state <> 'ER'"),
    )
    op.create_table(
        "queue_messages",
        sa.Column(
            "message_id",
            sa.BigInteger().with_variant(sa.Integer, "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("queue_name", NAME, nullable=False),
        sa.Column("conversation_group_id", HANDLE, nullable=False),
        sa.Column("conversation_handle", HANDLE, nullable=False),
        sa.Column("message_sequence_number", sa.BigInteger, nullable=False),
        sa.Column("message_type_name", NAME, nullable=False),
        sa.Column("message_body", sa.LargeBinary),
        sa.Column("priority", sa.SmallInteger, nullable=False),
        sa.Column("status", sa.SmallInteger, nullable=False),
        sa.Column("service_name", NAME, nullable=False),
        sa.Column("service_contract_name", NAME, nullable=False),
        sa.Column("enqueued_at", TIME, nullable=False),
    )
    # RECEIVE without a filter: the first ready message of the queue in priority order.
    # Partial, so retained (received) rows and other queues never cost a scan.
    op.create_index(
        "ix_queue_messages_ready",
        "queue_messages",
        ["queue_name", sa.text("priority DESC"), "message_id"],
        postgresql_where=sa.text("status = 1"),
        sqlite_where=sa.text("status = 1"),
    )
    # RECEIVE inside a locked group: conversations by level, then sequence order.
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
    op.create_index(
        "ix_queue_messages_conversation",
        "queue_messages",
        ["conversation_handle", "message_sequence_number"],
    )
    # Messages whose local target queue is off wait here until it is turned on again.
    op.create_table(
        "transmission_queue",
        sa.Column(
            "message_id",
            sa.BigInteger().with_variant(sa.Integer, "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("conversation_handle", HANDLE, nullable=False),  # the receiving endpoint
        sa.Column("to_queue_name", NAME, nullable=False),
        sa.Column("conversation_group_id", HANDLE, nullable=False),
        sa.Column("message_sequence_number", sa.BigInteger, nullable=False),
        sa.Column("message_type_name", NAME, nullable=False),
        sa.Column("message_body", sa.LargeBinary),
        sa.Column("priority", sa.SmallInteger, nullable=False),
        sa.Column("to_service_name", NAME, nullable=False),
        sa.Column("service_contract_name", NAME, nullable=False),
        sa.Column("enqueued_at", TIME, nullable=False),
        sa.Column("transmission_status", sa.String(1024), nullable=False),
    )
    op.create_index(
        "ix_transmission_queue_to_queue", "transmission_queue", ["to_queue_name", "message_id"]
    )
    op.create_index(
        "ix_transmission_queue_conversation", "transmission_queue", ["conversation_handle"]
    )
    # Every broker has the DEFAULT message type and contract, as in SQL Server.
    op.execute(
        "INSERT INTO message_types (message_type_name, validation, created_at) "
        "VALUES ('DEFAULT', 'NONE', 0)"
    )
    op.execute("INSERT INTO contracts (contract_name, created_at) VALUES ('DEFAULT', 0)")
    op.execute(
        "INSERT INTO contract_message_types (contract_name, message_type_name, sent_by) "
        "VALUES ('DEFAULT', 'DEFAULT', 'ANY')"
    )


def downgrade() -> None:
    for table in (
        "transmission_queue",
        "queue_messages",
        "conversation_endpoints",
        "conversation_groups",
        "service_contracts",
        "services",
        "queues",
        "contract_message_types",
        "contracts",
        "message_types",
    ):
        op.drop_table(table)
