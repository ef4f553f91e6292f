"""The trivial task every system runs, as our executors call it: ``noop(tag)`` records
``[tag, start, end]`` (``time.time()``, taken inside the handler) in this process's memory,
as the peers' handlers do in ``bench.peers.worker`` and ``bench.peers.celery_app``.

Our tasks are timed here, not by ``execution_log.start_time``: that stamp is taken before
the start's durable commit and before the task is called, while the peers' are taken
inside their handlers after their own dequeue (issue 24). A module of its own, so that the
executor's import of the task callable and the worker's read of what it recorded find the
same list (the worker runs as ``__main__``).
"""

from __future__ import annotations

import time
from typing import Any

RECORDS: list[list[Any]] = []  # [tag, start, end]; list.append is atomic for the readers


def noop(tag: str) -> None:
    start = time.time()
    RECORDS.append([tag, start, time.time()])


def task(tag: str) -> Any:
    """Our task that runs :func:`noop` with ``tag``."""
    from scheduler_lib.scheduler import Task

    return Task.python("bench.peers.handlers:noop", tag, name="no-op")
