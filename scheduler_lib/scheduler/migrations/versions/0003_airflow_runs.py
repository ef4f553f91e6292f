"""Rows of one Airflow DAG run, found without a scan.

The Execution Status page in Airflow's UI filters ``execution_log`` by DAG and run (a
per-run tab, and the filters of the top-level page); every row an Airflow operator sends
carries both ids.

Revision ID: s0003
Revises: s0002
Create Date: 2026-11-24
"""

from alembic import op

revision = "s0003"
down_revision = "s0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_execution_log_airflow", "execution_log", ["dag_id", "run_id", "log_id"])


def downgrade() -> None:
    op.drop_index("ix_execution_log_airflow", table_name="execution_log")
