"""Failed rows of the log, found without a scan.

The Execution Status page filters ``execution_log`` to failed rows for triage (issue 26):
failures are few among many rows, so a partial index on them lets each refresh read only
them, newest first, instead of walking the whole log to find a handful.

Revision ID: s0007
Revises: s0006
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op

revision = "s0007"
down_revision = "s0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_execution_log_failed",
        "execution_log",
        ["log_id"],
        postgresql_where=sa.text("status = 'FAILED'"),
        sqlite_where=sa.text("status = 'FAILED'"),
    )


def downgrade() -> None:
    op.drop_index("ix_execution_log_failed", "execution_log")
