"""The workload of ``bench.airflow_waves``, shared by its DAGs and the script: 50 tiny
Spark SQL statements in 5 waves of 10. Plain Python (no Airflow import), so the script
can read it; ``.airflowignore`` keeps the dag-processor from parsing it as a DAG file.
"""

from __future__ import annotations

WAVES = 5
PER_WAVE = 10
# Tiny but a real Spark job (a range scan and an aggregate); each distinct, one row back.
STATEMENT = "SELECT {i} AS n, count(*) AS c FROM range(100)"

OURS_DAG_ID = "bench_waves_ours"  # OrderedWavesOperator: one Airflow task
GROUP_DAG_ID = "bench_waves_ours_group"  # ordered_waves(): 12 Airflow tasks
NATIVE_DAG_ID = "bench_waves_native"  # one Airflow task per statement
SPARK_CONNECT_CONN_ID = "bench_spark_connect"  # the native side's Spark Connect server


def statements() -> list[list[str]]:
    """The waves of statements, in order."""
    return [
        [STATEMENT.format(i=w * PER_WAVE + i + 1) for i in range(PER_WAVE)] for w in range(WAVES)
    ]


def spark_sql_waves() -> list[list[dict[str, object]]]:
    """The same waves as scheduler_lib ``spark_sql`` tasks (one row collected, as the
    native side's ``collect()`` gets)."""
    return [
        [
            {"kind": "spark_sql", "name": f"wave {w} statement {i}", "sql": sql, "collect": 1}
            for i, sql in enumerate(wave, start=1)
        ]
        for w, wave in enumerate(statements(), start=1)
    ]
