"""Transport events may say ``REPLAYED_FRAME`` (issue 25): a frame written again into the
connection it was first sent on — signed with that connection's session key, so nobody
but a recorder on the path writes it — is dropped by its number and recorded.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

KNOWN = "'CORRUPTED_MESSAGE', 'CONNECTION_REJECTED', 'MESSAGE_REJECTED'"
TIME = sa.Float(precision=53)
ID = sa.BigInteger().with_variant(sa.Integer, "sqlite")


def _known(kinds: str) -> None:
    """Replace the CHECK on ``event_type``. SQLite changes a CHECK only by copying the
    table (batch mode); the table is given, not reflected, so that ``scheduler-lib ddl``
    renders this migration offline too (the columns are 0006's)."""
    table = sa.Table(
        "transport_events",
        sa.MetaData(),
        sa.Column("event_id", ID, primary_key=True, autoincrement=True),
        sa.Column("occurred_at", TIME, nullable=False),
        sa.Column("event_type", sa.String(32), nullable=False),
        sa.Column("peer", sa.String(256)),
        sa.Column("detail", sa.String(1024), nullable=False),
        sa.CheckConstraint(f"event_type IN ({KNOWN})", name="transport_event_known"),
        sa.Index("ix_transport_events_occurred", "occurred_at"),
    )
    with op.batch_alter_table("transport_events", copy_from=table) as batch:
        batch.drop_constraint("transport_event_known", type_="check")
        batch.create_check_constraint("transport_event_known", f"event_type IN ({kinds})")


def upgrade() -> None:
    _known(f"{KNOWN}, 'REPLAYED_FRAME'")


def downgrade() -> None:
    op.execute("DELETE FROM transport_events WHERE event_type = 'REPLAYED_FRAME'")
    _known(KNOWN)
