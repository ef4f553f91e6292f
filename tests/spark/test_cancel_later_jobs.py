"""A cancelled ``pyspark`` task whose callable starts a Spark job after the cancel (it
was between actions, or before its first): that job is cancelled too. Spark's
``cancelJobGroup`` stops only the group's jobs running at the time."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from multiproc import poll

from scheduler_lib.scheduler import TaskScheduler
from scheduler_lib.spark import job_group

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEADLINE = 60.0
ENDLESS = "SELECT sum(hash(id)) AS h FROM range(0, 400000000000)"  # hours on one core


def test_a_job_started_after_the_cancel_is_cancelled_too(
    scheduler: TaskScheduler, spark: SparkSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a pyspark task's callable running, not in a Spark job yet
    gate = tmp_path / "gate"
    handle = scheduler.get_scheduler()
    [log_id] = scheduler.exec_many(
        handle,
        [
            {
                "kind": "pyspark",
                "name": "late job",
                "callable": "spark_tasks:wait_then_run",
                "args": [str(gate), ENDLESS],
            }
        ],
    )
    started = Path(f"{gate}.started")
    poll(started.exists, DEADLINE, "the task's callable to run")

    # When it is cancelled (the worker in this process has told the task: it logs so),
    # and then its callable starts a long Spark job
    caplog.set_level(logging.INFO, logger="scheduler_lib.scheduler.executor")
    assert scheduler.cancel(handle, "cancelled: stop it") == (0, 1)
    poll(
        lambda: f"task {log_id}: cancelled: stop it" in caplog.text,
        DEADLINE,
        "the cancel to reach the task",
    )
    gate.touch()

    # Then that job is cancelled too, and the task answers CANCELLED soon
    done = scheduler.synchronization(handle, timeout=DEADLINE)
    assert (done.log_id, done.status) == (log_id, "CANCELLED"), done
    assert "it was running: " in (done.error or "") and "TaskCancelled" not in done.error, done
    tracker = spark.sparkContext.statusTracker()
    active = set(tracker.getActiveJobsIds())
    assert not [j for j in tracker.getJobIdsForGroup(job_group(log_id)) if j in active]
    scheduler.release_scheduler(handle)
