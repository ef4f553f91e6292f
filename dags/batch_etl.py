"""A realistic batch-ETL run ordered in waves: load four sources together, then two
transforms, then the aggregate, then the report — Spark SQL over data the load wave
generates for the run's date, on a scheduler_lib Spark worker.

    load:      raw_orders, raw_customers, raw_products, raw_returns   (together)
    transform: orders_enriched, returns_net                           (together)
    aggregate: daily_sales
    report:    the day's revenue per region and category, back through XCom

One :func:`~scheduler_lib.airflow.ordered_waves` call draws it as a task group:
``etl.get_scheduler >> etl.load >> etl.transform >> … >> etl.release_scheduler``, one
Airflow task per wave that sends it and waits for it — in the triggerer once a wave has
run a couple of seconds (``deferrable=True``). Every statement is templated, so
each run writes the partition of its own logical date.

Needs a ``scheduler_lib_default`` connection and a Spark worker on the same database:
``scheduler-lib worker --db URL``.
"""

from __future__ import annotations

import datetime
import sys
from typing import Any

from airflow.sdk import DAG

from scheduler_lib.airflow import ordered_waves

ORDERS = 60_000  # rows the load wave generates per run
CUSTOMERS = 5_000
PRODUCTS = 800
# Each run's data carries its date and its tables are named after it: the logical date,
# or for a run triggered without one (Airflow 3's REST API and UI may leave it out, and
# `ds`, `ds_nodash` and `logical_date` are then undefined) the instant it was triggered
# for — to the second in table names, so that it never rewrites the tables of the day's
# scheduled run while that run reads them.
DATE = "{{ (dag_run.logical_date or dag_run.run_after) | ds }}"
DAY = (
    "{{ dag_run.logical_date | ds_nodash if dag_run.logical_date "
    "else dag_run.run_after | ts_nodash }}"
)
REGIONS = "'north', 'south', 'east', 'west'"
CATEGORIES = "'books', 'games', 'garden', 'kitchen', 'toys'"


def table(name: str, query: str) -> list[str]:
    """(Re)build the run's table ``name`` from ``query``."""
    return [
        f"DROP TABLE IF EXISTS {name}_{DAY}",
        f"CREATE TABLE {name}_{DAY} USING parquet AS {query}",
    ]


def spark_sql(name: str, statements: list[str], **fields: Any) -> dict[str, Any]:
    return {"kind": "spark_sql", "name": name, "sql": statements, **fields}


def pick(choices: str, seed: int) -> str:
    """One of a SQL array's values, chosen by a hash of ``id``: the same every run."""
    size = choices.count(",") + 1
    return f"element_at(array({choices}), CAST(pmod(hash(id, {seed}), {size}) AS INT) + 1)"


LOAD = [
    spark_sql(
        "load orders",
        table(
            "raw_orders",
            f"SELECT id AS order_id, pmod(hash(id, 1), {CUSTOMERS}) AS customer_id, "
            f"pmod(hash(id, 2), {PRODUCTS}) AS product_id, "
            "CAST(1 + pmod(hash(id, 3), 4) AS INT) AS quantity, "
            f"to_date('{DATE}') AS order_date "
            f"FROM range({ORDERS})",
        ),
    ),
    spark_sql(
        "load customers",
        table(
            "raw_customers",
            f"SELECT id AS customer_id, {pick(REGIONS, 4)} AS region FROM range({CUSTOMERS})",
        ),
    ),
    spark_sql(
        "load products",
        table(
            "raw_products",
            f"SELECT id AS product_id, "
            f"{pick(CATEGORIES, 5)} AS category, "
            "2 + pmod(hash(id, 6), 9800) / 100.0D AS price "
            f"FROM range({PRODUCTS})",
        ),
    ),
    spark_sql(
        "load returns",
        table(
            "raw_returns",
            "SELECT order_id, quantity AS returned FROM ("
            f"SELECT id AS order_id, CAST(1 + pmod(hash(id, 3), 4) AS INT) AS quantity "
            f"FROM range({ORDERS})) WHERE pmod(hash(order_id, 7), 20) = 0",
        ),
    ),
]

TRANSFORM = [
    spark_sql(
        "enrich orders",
        table(
            "orders_enriched",
            f"SELECT o.order_id, c.region, p.category, o.quantity, p.price "
            f"FROM raw_orders_{DAY} o JOIN raw_customers_{DAY} c USING (customer_id) "
            f"JOIN raw_products_{DAY} p USING (product_id)",
        ),
    ),
    spark_sql(
        "net returns",
        table(
            "returns_net",
            f"SELECT order_id, sum(returned) AS returned FROM raw_returns_{DAY} GROUP BY order_id",
        ),
    ),
]

AGGREGATE = [
    spark_sql(
        "daily sales",
        table(
            "daily_sales",
            "SELECT o.region, o.category, count(*) AS orders, "
            "sum(o.quantity - coalesce(r.returned, 0)) AS items, "
            "round(sum((o.quantity - coalesce(r.returned, 0)) * o.price), 2) AS revenue "
            f"FROM orders_enriched_{DAY} o LEFT JOIN returns_net_{DAY} r USING (order_id) "
            "GROUP BY o.region, o.category",
        ),
    ),
]

REPORT = [
    spark_sql(
        "sales report",
        [
            f"SELECT region, sum(orders) AS orders, sum(revenue) AS revenue "
            f"FROM daily_sales_{DAY} GROUP BY region ORDER BY region"
        ],
        collect=10,
    ),
]

with DAG(
    dag_id="scheduler_lib_batch_etl",
    description="Batch ETL in ordered waves of Spark SQL: load, transform, aggregate, report",
    schedule="@daily",
    start_date=datetime.datetime(2026, 1, 1),
    catchup=False,
    # One retry, soon: Airflow 3.3's scheduler can fail a deferred task whose trigger fires
    # before it has handled the end of the try that deferred (apache/airflow#67287,
    # #72716, "state changed externally"; seen on make stack). The retry finds the wave's
    # tasks succeeded in execution_log and sends none of them again.
    default_args={"retries": 1, "retry_delay": datetime.timedelta(seconds=5)},
    tags=["scheduler_lib", "example", "spark"],
) as dag:
    ordered_waves(
        [LOAD, TRANSFORM, AGGREGATE, REPORT],
        group_id="etl",
        wave_names=["load", "transform", "aggregate", "report"],
        deferrable=True,
    )

if __name__ == "__main__":
    # dag.test() returns the run; a failed one must fail the command too.
    sys.exit(0 if dag.test().state == "success" else 1)
