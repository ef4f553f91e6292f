"""The demo's view of ``execution_log``: one frozen value per task run, read back through
the broker after the waves."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from typing import Any

from scheduler_lib.broker import Broker


@dataclasses.dataclass(frozen=True)
class TaskRun:
    """One row of ``execution_log``, with the worker id taken apart.

    ``wave`` is the wave's number, the first being 1 (as in the log). ``worker_id`` is
    ``host:pid:reader-thread:spark-application``; a task that never started has none.
    """

    log_id: int
    wave: int
    task_name: str
    status: str
    worker_id: str | None
    sent_at: float
    start_time: float
    end_time: float | None
    error: str | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> TaskRun:
        started = bool(row["attempts"])  # until it starts, start_time is the send time
        return cls(
            log_id=int(row["log_id"]),
            wave=int(row["wave"]),
            task_name=str(row["task_name"]),
            status=str(row["status"]),
            worker_id=row["worker_id"] if started else None,
            sent_at=float(row["sent_at"]),
            start_time=float(row["start_time"]),
            end_time=None if row["end_time"] is None else float(row["end_time"]),
            error=row["error"],
        )

    @property
    def ran(self) -> bool:
        """Whether a reader ran it (it has a start and an end on a worker)."""
        return self.worker_id is not None and self.end_time is not None

    @property
    def seconds(self) -> float | None:
        if self.worker_id is None or self.end_time is None:
            return None
        return self.end_time - self.start_time

    @property
    def reader(self) -> str | None:
        """The reader thread that ran it (the worker id between pid and application)."""
        if self.worker_id is None:
            return None
        parts = self.worker_id.split(":")
        return ":".join(parts[2:-1]) if len(parts) >= 4 else self.worker_id

    @property
    def application(self) -> str | None:
        """The Spark application that ran it."""
        return None if self.worker_id is None else self.worker_id.rsplit(":", 1)[-1]


def fetch(broker: Broker, scheduler_handle: uuid.UUID) -> list[TaskRun]:
    """The runs of one scheduler, in the order they were sent."""
    broker.use_queries("scheduler_lib.scheduler")
    rows = broker.fetch("log_of_scheduler", handle=str(scheduler_handle))
    return [TaskRun.from_row(r) for r in rows]


def fetch_one(broker: Broker, log_id: int) -> TaskRun | None:
    """One run, or ``None`` when the log has no such row."""
    broker.use_queries("scheduler_lib.scheduler")
    rows = broker.fetch("log_get", log_id=log_id)
    return TaskRun.from_row(rows[0]) if rows else None


def reader_labels(runs: list[TaskRun]) -> dict[str, str]:
    """Short names for the readers, ``reader 1`` … ``reader N`` in the order they first
    started a task."""
    first: dict[str, float] = {}
    for run in sorted((r for r in runs if r.reader is not None), key=lambda r: r.start_time):
        assert run.reader is not None
        first.setdefault(run.reader, run.start_time)
    return {reader: f"reader {n}" for n, reader in enumerate(first, start=1)}
