"""Which task a log line is about, on every line written while it runs.

The executor sets :data:`TASK` around each task it runs (its ``log_id``, the handle of
the reader's side of its scheduler's conversation, its name and kind, and the Airflow
task instance that sent it, when one did); :class:`TaskFields`
copies it onto every record logged meanwhile by that thread — the executor's own lines,
the task kind's, a library's the task calls — so a line is found by its task's id
(``scheduler-lib serve|worker --log-format json``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Mapping

# The task the current thread runs: field -> value; empty outside any task
TASK: contextvars.ContextVar[Mapping[str, object] | None] = contextvars.ContextVar(
    "scheduler_lib_task", default=None
)
FIELDS = (
    "log_id",
    "conversation_handle",
    "task_name",
    "task_kind",
    # the sender's Airflow task instance (None from a sender without Airflow)
    "dag_id",
    "run_id",
    "task_id",
    "try_number",
)


@contextlib.contextmanager
def about_task(**fields: object) -> Iterator[None]:
    """Lines logged in this block name the task (see :data:`FIELDS`)."""
    token = TASK.set(fields)
    try:
        yield
    finally:
        TASK.reset(token)


class TaskFields(logging.Filter):
    """Adds the running task's fields to a record (``None`` outside a task), so that a
    formatter can show them; filters nothing out."""

    def filter(self, record: logging.LogRecord) -> bool:
        task = TASK.get() or {}
        for name in FIELDS:
            if not hasattr(record, name):
                setattr(record, name, task.get(name))
        return True
