"""Broker-to-broker transport: broker identity, routes, outgoing messages in the
transmission queue, fragments awaiting reassembly or their turn, transport events, and
tombstones of closed remote conversations.

- Each database is one broker with a ``broker_instance`` id (a UUID in broker_settings,
  made on first use: the reference DDL must not give every database the same one).
- ``routes`` map a service name (optionally of one broker instance) to an address.
- ``transmission_queue`` now also holds *outgoing* messages (``is_outgoing``): a message
  for a service on another broker waits there until that broker acknowledges it; the
  row is self-contained (conversation id, direction, services, contract), so the sender
  needs no join to transmit it. The local "held because the target queue is off" rows
  are unchanged (``is_outgoing`` false).
- ``transport_fragments``: what arrived but cannot be delivered yet — fragments of a large
  message, or a message whose predecessor has not arrived. Durable, so it is acknowledged.
- ``transport_connections`` shows each running endpoint's connections (written by it).
- A remote conversation's endpoint is not deleted when it closes: it stays in state
  ``CD`` (``closed_at`` set) for a while, as SQL Server keeps closed endpoints, so a late
  retransmission is recognised as a duplicate instead of opening a new conversation.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

NAME = sa.String(128)
HANDLE = sa.String(36)
TIME = sa.Float(precision=53)
ID = sa.BigInteger().with_variant(sa.Integer, "sqlite")


def upgrade() -> None:
    op.create_table(
        "routes",
        sa.Column("route_name", NAME, primary_key=True),
        sa.Column("remote_service_name", NAME, nullable=False),
        sa.Column("broker_instance", HANDLE),  # NULL: whichever broker answers there
        sa.Column("address", sa.String(256), nullable=False),  # tcp://host:port or LOCAL
        sa.Column("created_at", TIME, nullable=False),
    )
    op.create_index("ix_routes_service", "routes", ["remote_service_name"])
    # Plain ADD COLUMNs (no batch copy), so the offline DDL renders on SQLite too.
    op.add_column(
        "conversation_endpoints",
        sa.Column("is_remote", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    op.add_column("conversation_endpoints", sa.Column("closed_at", TIME))
    op.create_index(
        "ix_conversation_endpoints_closed",
        "conversation_endpoints",
        ["closed_at"],
        postgresql_where=sa.text("closed_at IS NOT NULL"),
        sqlite_where=sa.text("closed_at IS NOT NULL"),
    )
    # An outgoing row's to_queue_name is '' (the far broker's queue is not known here).
    for column in (
        sa.Column("is_outgoing", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("conversation_id", HANDLE),
        sa.Column("is_initiator", sa.Boolean),  # the sender's side
        sa.Column("from_service_name", NAME),
        sa.Column("lifetime_expires_at", TIME),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_attempt_at", TIME),
    ):
        op.add_column("transmission_queue", column)
    # The transmitter reads outgoing messages in arrival order from a cursor.
    op.create_index(
        "ix_transmission_queue_outgoing",
        "transmission_queue",
        ["message_id"],
        postgresql_where=sa.text("is_outgoing"),
        sqlite_where=sa.text("is_outgoing"),
    )
    op.create_table(
        "transport_fragments",
        sa.Column("conversation_id", HANDLE, primary_key=True),
        sa.Column("is_initiator", sa.Boolean, primary_key=True),  # the sender's side
        sa.Column("message_sequence_number", sa.BigInteger, primary_key=True),
        sa.Column("fragment_index", sa.Integer, primary_key=True),
        sa.Column("fragment_count", sa.Integer, nullable=False),
        sa.Column("message_type_name", NAME, nullable=False),
        sa.Column("message_body", sa.LargeBinary),
        sa.Column("received_at", TIME, nullable=False),
    )
    op.create_table(
        "transport_events",
        sa.Column("event_id", ID, primary_key=True, autoincrement=True),
        sa.Column("occurred_at", TIME, nullable=False),
        sa.Column("event_type", sa.String(32), nullable=False),
        sa.Column("peer", sa.String(256)),
        sa.Column("detail", sa.String(1024), nullable=False),
        sa.CheckConstraint(
            "event_type IN ('CORRUPTED_MESSAGE', 'CONNECTION_REJECTED', 'MESSAGE_REJECTED')",
            name="transport_event_known",
        ),
    )
    op.create_index("ix_transport_events_occurred", "transport_events", ["occurred_at"])
    # sys.dm_broker_connections: each running endpoint writes its connections here every
    # couple of seconds, so another process (scheduler-lib routes) can show them.
    op.create_table(
        "transport_connections",
        sa.Column("endpoint_id", HANDLE, primary_key=True),  # one running endpoint
        sa.Column("connection_number", sa.Integer, primary_key=True),
        sa.Column("endpoint_address", sa.String(256)),
        sa.Column("host_name", sa.String(256), nullable=False),
        sa.Column("process_id", sa.Integer, nullable=False),
        sa.Column("direction", sa.String(8), nullable=False),
        sa.Column("peer", sa.String(256), nullable=False),
        sa.Column("peer_address", sa.String(256)),
        sa.Column("peer_broker", HANDLE),
        sa.Column("opened_at", TIME, nullable=False),
        sa.Column("last_activity_at", TIME, nullable=False),
        sa.Column("frames_sent", sa.BigInteger, nullable=False),
        sa.Column("frames_received", sa.BigInteger, nullable=False),
        sa.Column("bytes_sent", sa.BigInteger, nullable=False),
        sa.Column("bytes_received", sa.BigInteger, nullable=False),
        sa.Column("corrupted_frames", sa.BigInteger, nullable=False),
        sa.Column("carries_messages", sa.Boolean, nullable=False),
        sa.Column("written_at", TIME, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("transport_connections")
    op.drop_table("transport_events")
    op.drop_table("transport_fragments")
    op.drop_index("ix_transmission_queue_outgoing", "transmission_queue")
    with op.batch_alter_table("transmission_queue") as batch:
        for column in (
            "last_attempt_at",
            "attempts",
            "lifetime_expires_at",
            "from_service_name",
            "is_initiator",
            "conversation_id",
            "is_outgoing",
        ):
            batch.drop_column(column)
    op.drop_index("ix_conversation_endpoints_closed", "conversation_endpoints")
    with op.batch_alter_table("conversation_endpoints") as batch:
        batch.drop_column("closed_at")
        batch.drop_column("is_remote")
    op.drop_index("ix_routes_service", "routes")
    op.drop_table("routes")
    op.execute("DELETE FROM broker_settings WHERE setting_name = 'broker_instance'")
