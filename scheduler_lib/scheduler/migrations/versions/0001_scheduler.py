"""The task scheduler: target services and the task kinds they run, execution_log, the
execution_status view, named semaphores.

Revision ID: s0001
Revises:
Create Date: 2026-11-22

Applied after the broker's migrations (the view reads the broker's activated_tasks).
"""

import sqlalchemy as sa
from alembic import op

revision = "s0001"
down_revision = None
branch_labels = None
depends_on = None

NAME = sa.String(128)
HANDLE = sa.String(36)
TIME = sa.Float(precision=53)
ID = sa.BigInteger().with_variant(sa.Integer, "sqlite")

EXECUTION_STATUS = """
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
    # Which task kinds each target service runs (the executor refuses the others).
    op.create_table(
        "scheduler_targets",
        sa.Column("service_name", NAME, primary_key=True),
        sa.Column("queue_name", NAME, nullable=False),
        sa.Column("allowed_kinds", sa.String(1024), nullable=False),  # comma-separated
        sa.Column("updated_at", TIME, nullable=False),
    )
    # The blog's ExecutionLog: who sent what, who ran it, when, and how it ended.
    # start_time is the send time until the task starts, as in the blog.
    op.create_table(
        "execution_log",
        sa.Column("log_id", ID, primary_key=True, autoincrement=True),
        sa.Column("caller_id", sa.String(256), nullable=False),  # host:pid:thread
        sa.Column("scheduler_handle", HANDLE, nullable=False),
        sa.Column("target_service", NAME, nullable=False),
        sa.Column("wave", sa.Integer),
        sa.Column("task_name", sa.String(256), nullable=False),
        sa.Column("task_kind", sa.String(64), nullable=False),
        sa.Column("task_body", sa.Text, nullable=False),  # the task as JSON
        sa.Column("worker_id", sa.String(256)),  # host:pid:reader (our SPID)
        sa.Column("activated_task_id", HANDLE),  # the activated reader running it
        sa.Column("spark_application_id", sa.String(128)),
        sa.Column("spark_job_group", sa.String(128)),
        sa.Column("sent_at", TIME, nullable=False),
        sa.Column("start_time", TIME, nullable=False),
        sa.Column("end_time", TIME),
        sa.Column("status", sa.String(10), nullable=False),
        sa.Column("error", sa.Text),
        sa.Column("result", sa.Text),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("dag_id", sa.String(250)),
        sa.Column("run_id", sa.String(250)),
        sa.Column("task_id", sa.String(250)),
        sa.CheckConstraint(
            "status IN ('QUEUED', 'RUNNING', 'SUCCEEDED', 'FAILED', 'CANCELLED')",
            name="execution_status_known",
        ),
    )
    op.create_index("ix_execution_log_scheduler", "execution_log", ["scheduler_handle", "log_id"])
    # Open rows only: what runs (or waits) now, per reader; small however long the log.
    op.create_index(
        "ix_execution_log_open",
        "execution_log",
        ["activated_task_id"],
        postgresql_where=sa.text("end_time IS NULL"),
        sqlite_where=sa.text("end_time IS NULL"),
    )
    op.execute(EXECUTION_STATUS)
    # Named, durable, cross-process semaphores. A holder keeps its permit by renewing
    # expires_at; a holder that died loses it when it expires.
    op.create_table(
        "semaphores",
        sa.Column("semaphore_name", NAME, primary_key=True),
        sa.Column("permits", sa.Integer, nullable=False),
        sa.Column("created_at", TIME, nullable=False),
        sa.CheckConstraint("permits >= 1", name="permits_positive"),
    )
    op.create_table(
        "semaphore_holders",
        sa.Column("holder_id", HANDLE, primary_key=True),
        sa.Column(
            "semaphore_name",
            NAME,
            sa.ForeignKey("semaphores.semaphore_name", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("holder", sa.String(256), nullable=False),
        sa.Column("acquired_at", TIME, nullable=False),
        sa.Column("expires_at", TIME, nullable=False),
    )
    op.create_index("ix_semaphore_holders_name", "semaphore_holders", ["semaphore_name"])


def downgrade() -> None:
    op.drop_table("semaphore_holders")
    op.drop_table("semaphores")
    op.execute("DROP VIEW execution_status")
    op.drop_table("execution_log")
    op.drop_table("scheduler_targets")
