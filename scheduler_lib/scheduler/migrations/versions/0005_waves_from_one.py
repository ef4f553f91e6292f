"""Waves are numbered from 1 in ``execution_log``, as everywhere else.

The log kept a wave's 0-based index while people, tables, the Airflow operators and
``run_waves``' callbacks counted from 1, so every reader added one and the JSON outputs
showed the index. From this revision the column holds the number people read: the first
wave is 1. Rows sent outside a wave keep ``NULL``.

Revision ID: s0005
Revises: s0004
Create Date: 2026-11-25
"""

from alembic import op

revision = "s0005"
down_revision = "s0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("UPDATE execution_log SET wave = wave + 1 WHERE wave IS NOT NULL")


def downgrade() -> None:
    op.execute("UPDATE execution_log SET wave = wave - 1 WHERE wave IS NOT NULL")
