"""Cancelling running tasks, and where a Spark task can be watched.

``cancel_requested_at`` is set on a running task's row when its scheduler fails fast or
is released; the worker running it watches its open rows and stops the task (a Spark
task's job group is cancelled). ``spark_ui_url`` is the Spark UI of the application that
ran the task, shown by ``scheduler-lib status``.

Revision ID: s0002
Revises: s0001
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "s0002"
down_revision = "s0001"
branch_labels = None
depends_on = None

TIME = sa.Float(precision=53)

EXECUTION_STATUS = """
CREATE VIEW execution_status AS
SELECT t.task_id AS reader_task_id, t.queue_name, t.host_name, t.process_id,
    t.reader_name, t.started_at AS reader_started_at, t.heartbeat_at AS reader_heartbeat_at,
    l.log_id, l.caller_id, l.scheduler_handle, l.target_service, l.wave, l.task_name,
    l.task_kind, l.worker_id, l.spark_application_id, l.spark_job_group, l.spark_ui_url,
    l.sent_at, l.start_time, l.status, l.attempts, l.cancel_requested_at, l.dag_id,
    l.run_id, l.task_id
FROM activated_tasks t
LEFT JOIN execution_log l ON l.activated_task_id = t.task_id AND l.end_time IS NULL
"""

PREVIOUS_STATUS = """
CREATE VIEW execution_status AS
SELECT t.task_id AS reader_task_id, t.queue_name, t.host_name, t.process_id,
    t.reader_name, t.started_at AS reader_started_at, t.heartbeat_at AS reader_heartbeat_at,
    l.log_id, l.caller_id, l.scheduler_handle, l.target_service, l.wave, l.task_name,
    l.task_kind, l.worker_id, l.spark_application_id, l.spark_job_group, l.sent_at,
    l.start_time, l.status, l.attempts, l.dag_id, l.run_id, l.task_id
FROM activated_tasks t
LEFT JOIN execution_log l ON l.activated_task_id = t.task_id AND l.end_time IS NULL
"""


def upgrade() -> None:
    op.execute("DROP VIEW execution_status")
    op.add_column("execution_log", sa.Column("cancel_requested_at", TIME))
    op.add_column("execution_log", sa.Column("cancel_reason", sa.Text))
    op.add_column("execution_log", sa.Column("spark_ui_url", sa.String(512)))
    # What workers poll while they run tasks: only rows asked to stop and still open.
    op.create_index(
        "ix_execution_log_cancel",
        "execution_log",
        ["log_id"],
        postgresql_where=sa.text("cancel_requested_at IS NOT NULL AND end_time IS NULL"),
        sqlite_where=sa.text("cancel_requested_at IS NOT NULL AND end_time IS NULL"),
    )
    op.execute(EXECUTION_STATUS)


def downgrade() -> None:
    op.execute("DROP VIEW execution_status")
    op.drop_index("ix_execution_log_cancel", "execution_log")
    with op.batch_alter_table("execution_log") as batch:
        batch.drop_column("spark_ui_url")
        batch.drop_column("cancel_reason")
        batch.drop_column("cancel_requested_at")
    op.execute(PREVIOUS_STATUS)
