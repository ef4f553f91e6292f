"""The launch set-up of a launching Spark worker (external activation): the queue and
service that receive its target queue's ``QUEUE_ACTIVATION`` events and the event
notification that sends them. A worker drops it when it stops; workers that share it make
it again when another one dropped it."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import pytest
from multiproc import poll as _poll

from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import TaskScheduler
from scheduler_lib.spark import Worker

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

T = TypeVar("T")
DEADLINE = 120.0  # generous: the machine may be busy
LAUNCH = [sys.executable, "-c", "pass"]  # these tests are about the set-up, not what starts
QUEUE, SERVICE = "QueueAsyncTarget", "ServiceAsyncTarget"  # the worker's defaults
EVENTS_QUEUE, EVENTS_SERVICE = f"{QUEUE}Launcher", f"{SERVICE}Launcher"
NOTIFICATION = f"{QUEUE}Workers"
WHOLE = {f"queue {EVENTS_QUEUE}", f"service {EVENTS_SERVICE}", f"notification {NOTIFICATION}"}


def poll(condition: Callable[[], T], what: str, timeout: float = DEADLINE) -> T:
    return _poll(condition, timeout, what, interval=0.1)


def launch_setup(broker: Broker) -> set[str]:
    """What of the launch set-up exists, with the event dialog once events were sent."""
    found = set()
    if any(q.name == EVENTS_QUEUE for q in broker.queues()):
        found.add(f"queue {EVENTS_QUEUE}")
    if any(s["service_name"] == EVENTS_SERVICE for s in broker.services()):
        found.add(f"service {EVENTS_SERVICE}")
    if any(n["notification_name"] == NOTIFICATION for n in broker.event_notifications()):
        found.add(f"notification {NOTIFICATION}")
    if any(
        EVENTS_SERVICE in (e.service_name, e.far_service_name)
        for e in broker.conversation_endpoints()
    ):
        found.add("the event dialog")
    return found


def notification_made_at(broker: Broker) -> float:
    [made_at] = [
        n["created_at"]
        for n in broker.event_notifications()
        if n["notification_name"] == NOTIFICATION
    ]
    return float(made_at)


def launching_worker(broker: Broker, spark: SparkSession) -> Worker:
    return Worker(broker, spark=spark, max_readers=1, launch_command=LAUNCH).start()


def fill_the_driver(broker: Broker, gate: Path) -> tuple[TaskScheduler, object, list[int]]:
    """Two tasks that hold their reader until ``gate`` exists: with one reader per driver,
    the second makes the queue monitor post ``QUEUE_ACTIVATION`` events."""
    scheduler = TaskScheduler(broker)
    handle = scheduler.get_scheduler()
    hold = {"kind": "pyspark", "callable": "spark_tasks:hold_until", "args": [str(gate)]}
    return scheduler, handle, scheduler.exec_many(handle, [hold, hold])


def finish(scheduler: TaskScheduler, handle: object, log_ids: list[int], gate: Path) -> None:
    gate.touch()
    done = [scheduler.synchronization(handle, timeout=DEADLINE) for _ in log_ids]
    assert all(c.ok for c in done), [c.error for c in done]
    scheduler.release_scheduler(handle)


def test_a_launching_worker_drops_its_launch_setup_when_it_stops(
    sqlite_url: str, spark: SparkSession, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    with Broker(sqlite_url) as broker:
        worker = launching_worker(broker, spark)
        try:
            assert launch_setup(broker) == WHOLE
            launcher = worker.launcher
            assert launcher is not None
            scheduler, handle, log_ids = fill_the_driver(broker, gate)
            poll(lambda: launcher.events_seen, "a QUEUE_ACTIVATION event on the full driver")
            # The event dialog stays open (and may hold unread events): dropping the
            # service has to end it first.
            assert launch_setup(broker) == WHOLE | {"the event dialog"}
            finish(scheduler, handle, log_ids, gate)
        finally:
            gate.touch()
            worker.stop()
        assert launch_setup(broker) == set()
        worker.stop()  # again (run() then the caller): nothing to drop, no error


def test_a_survivor_makes_the_shared_setup_again_and_still_hears_events(
    sqlite_url: str, spark: SparkSession, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    with Broker(sqlite_url) as broker:
        first = launching_worker(broker, spark)
        second = launching_worker(broker, spark)
        try:
            assert launch_setup(broker) == WHOLE  # one set-up, shared
            made_at = notification_made_at(broker)
            first.stop()
            poll(
                lambda: launch_setup(broker) >= WHOLE and notification_made_at(broker) > made_at,
                "the second worker to make the set-up again",
            )
            # Not deaf: its launcher receives the events of a full driver again.
            launcher = second.launcher
            assert launcher is not None
            seen = launcher.events_seen
            scheduler, handle, log_ids = fill_the_driver(broker, gate)
            poll(lambda: launcher.events_seen > seen, "the survivor to receive an event")
            finish(scheduler, handle, log_ids, gate)
        finally:
            gate.touch()
            first.stop()
            second.stop()
        assert launch_setup(broker) == set()


def test_a_setup_that_cannot_be_dropped_is_left_whole_with_a_warning(
    sqlite_url: str, spark: SparkSession, caplog: pytest.LogCaptureFixture
) -> None:
    with Broker(sqlite_url) as broker:
        worker = launching_worker(broker, spark)
        # Someone else's service on the events queue: the queue can't be dropped.
        broker.create_service("Bystander", EVENTS_QUEUE)
        launcher = worker.launcher
        assert launcher is not None
        # As if launched: stop() terminates it after dropping the set-up.
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        launcher.processes.append(sleeper)
        with caplog.at_level(logging.WARNING, logger="scheduler_lib.spark.worker"):
            worker.stop()
        # (the worker's INFO lines are there too when an earlier test left the logger at
        # INFO: the warnings are what counts)
        [warning] = [
            r
            for r in caplog.records
            if r.name == "scheduler_lib.spark.worker" and r.levelno >= logging.WARNING
        ]
        assert "could not drop the launch set-up of QueueAsyncTarget" in warning.getMessage()
        assert "\n" not in warning.getMessage()
        # One transaction: nothing half dropped; and stop() went on.
        assert launch_setup(broker) == WHOLE
        assert sleeper.poll() is not None
