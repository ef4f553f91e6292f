"""What the Execution Status page shows: the ``execution_status`` view and the newest
``execution_log`` rows, filtered by scheduler handle, Airflow DAG or DAG run, as plain
JSON-friendly dicts.

Read-only and cheap enough to poll every few seconds: every filter shape has its own
named query on an index (``monitor_log_*`` in ``sql/queries.sql``), and task bodies and
results, which can be large, are left out.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import time
from collections.abc import Mapping
from typing import Any

from scheduler_lib.broker import Broker
from scheduler_lib.broker.exceptions import InvalidArgument
from scheduler_lib.scheduler import catalog

DEFAULT_LIMIT = 200  # rows of the log a page shows
MAX_LIMIT = 5000  # rows: a bigger screen is a report, not a monitor
MAX_ERROR = 4000  # characters of a task's error shown; the full text stays in the log


@dataclasses.dataclass(frozen=True)
class Filters:
    """Which rows to show; ``None`` means any.

    :param scheduler_handle: one scheduler (conversation) handle
    :param dag_id: one Airflow DAG
    :param run_id: one run of that DAG (needs ``dag_id``: run ids are unique per DAG only)
    """

    scheduler_handle: str | None = None
    dag_id: str | None = None
    run_id: str | None = None

    def __post_init__(self) -> None:
        if self.run_id is not None and self.dag_id is None:
            raise InvalidArgument(
                f"run_id {self.run_id!r} needs dag_id: a run id names a run of one DAG only"
            )

    @classmethod
    def of(
        cls,
        scheduler_handle: str | None = None,
        dag_id: str | None = None,
        run_id: str | None = None,
    ) -> Filters:
        """Filters from user input: blanks mean any, a run needs its DAG.

        :raises InvalidArgument: for a run id without a DAG id
        """
        return cls(_blank_is_none(scheduler_handle), _blank_is_none(dag_id), _blank_is_none(run_id))

    def matches(self, row: Mapping[str, Any]) -> bool:
        """Whether a row (of the log or of the status view) passes the filters."""
        return (
            (self.scheduler_handle is None or row.get("scheduler_handle") == self.scheduler_handle)
            and (self.dag_id is None or row.get("dag_id") == self.dag_id)
            and (self.run_id is None or row.get("run_id") == self.run_id)
        )

    @property
    def any(self) -> bool:
        """Whether some filter is set."""
        return any(v is not None for v in (self.scheduler_handle, self.dag_id, self.run_id))


def execution_status(broker: Broker, filters: Filters = Filters()) -> list[dict[str, Any]]:
    """The activated readers and what each runs now (the ``execution_status`` view).

    Unfiltered, idle readers are included (their task columns are ``None``); with a
    filter only readers running a matching task are. The view holds one row per running
    reader, so it is filtered here rather than in SQL.

    :param broker: the scheduler's broker
    :param filters: which tasks to show
    """
    catalog.prepare(broker)
    rows = [_json_row(r) for r in broker.fetch("status_list")]
    if filters.any:
        rows = [r for r in rows if r["log_id"] is not None and filters.matches(r)]
    return rows


def execution_log(
    broker: Broker, filters: Filters = Filters(), *, limit: int = DEFAULT_LIMIT
) -> list[dict[str, Any]]:
    """The newest rows of ``execution_log`` that pass the filters, newest first.

    :param broker: the scheduler's broker
    :param filters: which rows to show
    :param limit: at most this many rows (1 to :data:`MAX_LIMIT`)
    :raises InvalidArgument: for a limit out of range
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidArgument(f"limit must be a whole number from 1 to {MAX_LIMIT}, got {limit!r}")
    catalog.prepare(broker)
    query, params = _log_query(filters)
    return [_json_row(r) for r in broker.fetch(query, limit=limit, **params)]


def snapshot(
    broker: Broker, filters: Filters = Filters(), *, limit: int = DEFAULT_LIMIT
) -> dict[str, Any]:
    """Everything one refresh of the page needs: the server's clock (the page draws its
    timeline against it, not against the browser's), the running tasks and the log.

    :param broker: the scheduler's broker
    :param filters: which rows to show
    :param limit: at most this many log rows
    """
    return {
        "now": time.time(),
        "filters": dataclasses.asdict(filters),
        "running": execution_status(broker, filters),
        "log": execution_log(broker, filters, limit=limit),
    }


def _log_query(filters: Filters) -> tuple[str, dict[str, str]]:
    """The named query for a filter shape, and its binds: each shape reads one index."""
    handle, dag, run = filters.scheduler_handle, filters.dag_id, filters.run_id
    if run is not None:
        assert dag is not None  # Filters refuses a run without its DAG
        if handle is not None:
            return "monitor_log_of_scheduler_in_run", {
                "handle": handle,
                "dag_id": dag,
                "run_id": run,
            }
        return "monitor_log_of_run", {"dag_id": dag, "run_id": run}
    if handle is not None:
        if dag is not None:
            return "monitor_log_of_scheduler_in_dag", {"handle": handle, "dag_id": dag}
        return "monitor_log_of_scheduler", {"handle": handle}
    if dag is not None:
        return "monitor_log_of_dag", {"dag_id": dag}
    return "monitor_log_recent", {}


def _blank_is_none(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip()
    return value or None


def _json_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row with values JSON can carry (drivers may hand back decimals, datetimes or
    bytes) and errors cut to a size a page can show."""
    out: dict[str, Any] = {}
    for key, value in dict(row).items():
        if isinstance(value, decimal.Decimal):
            value = float(value)
        elif isinstance(value, datetime.datetime | datetime.date):
            value = value.isoformat()
        elif isinstance(value, bytes | memoryview):
            value = bytes(value).decode("utf-8", "replace")
        out[key] = value
    error = out.get("error")
    if isinstance(error, str) and len(error) > MAX_ERROR:
        out["error"] = error[:MAX_ERROR] + f"… ({len(error) - MAX_ERROR} more characters)"
    return out
