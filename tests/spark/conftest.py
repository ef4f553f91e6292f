"""Fixtures for the Spark layer: one ``local[2]`` SparkSession for the whole run (a JVM
takes seconds to start), and a Spark worker whose readers are threads on it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import TaskScheduler
from scheduler_lib.spark import Worker
from scheduler_lib.spark import session as sessions

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # spark_tasks: the callables tasks name
sys.path.insert(0, str(HERE.parent / "integration"))  # multiproc: poll


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    """The worker session every Spark test shares: FAIR pools, the UI on (its REST API
    shows the pools jobs ran in), a warehouse of its own."""
    warehouse = tmp_path_factory.mktemp("warehouse")
    session = sessions.build(
        master="local[2]",
        conf={
            "spark.ui.enabled": "true",
            "spark.sql.warehouse.dir": str(warehouse),
            "spark.sql.shuffle.partitions": "2",
        },
        app_name="scheduler-lib tests",
    )
    try:
        yield session
    finally:
        session.stop()
        sessions.use(None)


@pytest.fixture
def spark_broker(sqlite_url: str) -> Iterator[Broker]:
    """A broker on a fresh SQLite file (the Spark kinds do not depend on the backend;
    the end-to-end test runs on PostgreSQL too)."""
    with Broker(sqlite_url) as broker:
        yield broker


@pytest.fixture
def worker(spark_broker: Broker, spark: SparkSession) -> Iterator[Worker]:
    """A Spark worker on the shared session, two readers."""
    w = Worker(spark_broker, spark=spark, max_readers=2).start()
    try:
        yield w
    finally:
        w.stop()


@pytest.fixture
def scheduler(worker: Worker) -> TaskScheduler:
    return TaskScheduler(worker.broker)
