"""The tables each task of the batch-ETL example DAG (dags/batch_etl.py)
reads and writes, as its OpenLineage events must name them (without the ``_<day>`` suffix
the DAG gives every table): tests/spark/test_lineage.py checks a worker's events of its
tasks, tests/airflow/test_dags.py those of a real DAG run."""

from __future__ import annotations

# task name -> (tables read, tables written)
ETL_LINEAGE: dict[str, tuple[list[str], list[str]]] = {
    "load orders": ([], ["raw_orders"]),
    "load customers": ([], ["raw_customers"]),
    "load products": ([], ["raw_products"]),
    "load returns": ([], ["raw_returns"]),
    "enrich orders": (["raw_customers", "raw_orders", "raw_products"], ["orders_enriched"]),
    "net returns": (["raw_returns"], ["returns_net"]),
    "daily sales": (["orders_enriched", "returns_net"], ["daily_sales"]),
    "sales report": (["daily_sales"], []),
}
