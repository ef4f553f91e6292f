"""Task bodies of tests/stack's ``spark_submit`` and ``pyspark`` scenario (issue 23,
scenario 5), called on the stack's worker applications (``PYTHONPATH`` reaches this
checkout)."""

from __future__ import annotations

import os
import time
from typing import Any

# Each row sleeps in the executor (a static Java method through reflect): rows x ms
# milliseconds on the application's one core, in partitions (Spark's tasks) of a stage.
SLEEP = "coalesce(reflect('java.lang.Thread', 'sleep', CAST({ms} AS BIGINT)), 'x') <> 'never'"


def slow_count(spark: Any, rows: str | int, ms: str | int, partitions: str | int = 4) -> int:
    """A ``pyspark`` task: count ``rows`` rows, each sleeping ``ms`` milliseconds (the
    arguments are rendered from templates: text)."""
    frame = spark.range(0, int(rows), 1, int(partitions)).where(SLEEP.format(ms=int(ms)))
    return int(frame.count())


def fail_when(path: str, seconds: str | float) -> None:
    """A ``python`` task that fails once ``path`` exists (a test creates it when it wants
    the failure), or after ``seconds`` at the latest (without ``path``: after
    ``seconds``)."""
    deadline = time.monotonic() + float(seconds)
    while time.monotonic() < deadline:
        if path and os.path.exists(path):
            raise RuntimeError(f"told to fail ({path} exists)")
        time.sleep(0.2)
    raise RuntimeError(f"failed after {float(seconds):g} s")
