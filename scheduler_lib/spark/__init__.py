"""Spark execution (DESIGN.md section 10): ``scheduler-lib worker`` — a Spark driver whose
activated readers run ``spark_sql``, ``pyspark`` and ``spark_submit`` tasks on one
SparkSession — and the task kinds themselves.

Importing this package registers the Spark task kinds (so callers can check Spark tasks
before sending them) without importing pyspark; pyspark is imported when a worker starts.
"""

from scheduler_lib.spark import kinds
from scheduler_lib.spark.kinds import (
    PySparkKind,
    SparkSqlError,
    SparkSqlKind,
    SparkSubmitKind,
    TaskCancelled,
    job_group,
)
from scheduler_lib.spark.session import NoSparkSession, pool_for
from scheduler_lib.spark.worker import Worker, serve

kinds.register()

__all__ = [
    "NoSparkSession",
    "PySparkKind",
    "SparkSqlError",
    "SparkSqlKind",
    "SparkSubmitKind",
    "TaskCancelled",
    "Worker",
    "job_group",
    "pool_for",
    "serve",
]
