"""A tiny PySpark application for ``spark-submit``: counts ``rows`` rows slowly (each row
sleeps ``ms`` milliseconds in the executor, a static Java method through ``reflect``) and
prints the count. tests/stack's ``spark_submit`` scenario (issue 23, scenario 5) submits
it to the stack's Spark cluster.

    spark-submit sleepy_count.py ROWS MS_PER_ROW [PARTITIONS]
"""

from __future__ import annotations

import sys

from pyspark.sql import SparkSession


def main(argv: list[str]) -> int:
    rows = int(argv[0]) if argv else 10
    ms = int(argv[1]) if len(argv) > 1 else 100
    partitions = int(argv[2]) if len(argv) > 2 else 4
    spark = SparkSession.builder.getOrCreate()  # its name comes from spark-submit --name
    try:
        n = (
            spark.range(0, rows, 1, partitions)
            .where(
                f"coalesce(reflect('java.lang.Thread', 'sleep', CAST({ms} AS BIGINT)), 'x') "
                "<> 'never'"
            )
            .count()
        )
        print(f"sleepy_count: counted {n} rows", flush=True)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
