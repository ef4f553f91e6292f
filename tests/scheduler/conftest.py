"""Fixtures for the task scheduler: a broker with the scheduler's catalog, and executors
run as threads (the same procedure the activation runtime starts)."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import Executor, Target, TaskScheduler, init

# The shared fixtures (db_url, broker) and the multi-process helpers.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))


@pytest.fixture
def sched(broker: Broker) -> Broker:
    """A broker with the scheduler's catalog (executors are started by each test)."""
    init(broker, targets=[Target(activation=False)])
    return broker


@pytest.fixture
def scheduler(sched: Broker) -> TaskScheduler:
    return TaskScheduler(sched)


Executors = Callable[..., contextlib.AbstractContextManager[list[threading.Thread]]]


@pytest.fixture
def executors(sched: Broker) -> Executors:
    """``with executors(n): ...`` runs ``n`` executor threads on the target queue."""

    @contextlib.contextmanager
    def run(
        count: int, queue: str = "QueueAsyncTarget", **options: object
    ) -> Iterator[list[threading.Thread]]:
        stop = threading.Event()
        threads = [
            threading.Thread(
                target=Executor(sched, queue, idle_timeout=3600, **options).serve,  # type: ignore[arg-type]
                args=(stop,),
                name=f"reader-{i}",
                daemon=True,
            )
            for i in range(count)
        ]
        for thread in threads:
            thread.start()
        try:
            yield threads
        finally:
            stop.set()
            for thread in threads:
                thread.join(10)

    return run
