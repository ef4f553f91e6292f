"""Callables that ``pyspark`` tasks of the tests name (importable by launched workers)."""

from __future__ import annotations

import time
from typing import Any


def local_properties(spark: Any) -> dict[str, Any]:
    """What the task's jobs carry: its pool and job group (Spark local properties)."""
    sc = spark.sparkContext
    count = spark.range(10).count()  # a job, submitted with these properties
    return {
        "pool": sc.getLocalProperty("spark.scheduler.pool"),
        "job_group": sc.getLocalProperty("spark.jobGroup.id"),
        "count": count,
    }


def squares(spark: Any, n: int, *, offset: int = 0) -> Any:
    """A DataFrame: the task's result is its first rows."""
    return spark.range(n).selectExpr(
        f"id + {offset} AS x", f"(id + {offset}) * (id + {offset}) AS sq"
    )


def hold(spark: Any, seconds: float) -> str:
    """Occupy a reader for a while (launch tests), returning who ran it."""
    time.sleep(seconds)
    return spark.sparkContext.applicationId


def fail(spark: Any, message: str) -> None:
    raise RuntimeError(message)


def hold_until(spark: Any, gate: str, timeout: float = 120.0) -> str:
    """Occupy a reader until the file ``gate`` exists, returning who ran it."""
    import os

    deadline = time.monotonic() + timeout
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gate} did not appear within {timeout} s")
        time.sleep(0.05)
    return spark.sparkContext.applicationId


def wait_then_run(spark: Any, gate: str, sql: str, timeout: float = 120.0) -> Any:
    """Wait (no Spark job yet) until the file ``gate`` exists, then run ``sql``: a task
    cancelled before its first job starts one afterwards. ``<gate>.started`` says it is
    waiting."""
    import os

    open(f"{gate}.started", "w").close()
    deadline = time.monotonic() + timeout
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gate} did not appear within {timeout} s")
        time.sleep(0.05)
    return spark.sql(sql).collect()
