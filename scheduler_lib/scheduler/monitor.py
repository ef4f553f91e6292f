"""What the Execution Status page shows: the ``execution_status`` view and the newest
``execution_log`` rows, filtered by scheduler handle, Airflow DAG or DAG run, failed
rows only, target, task kind and a time range, as plain JSON-friendly dicts.

Read-only and cheap enough to poll every few seconds: every filter shape has its own
named query on an index (``monitor_log_*`` in ``sql/queries.sql``), and task bodies and
results, which can be large, are left out.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import time
from collections.abc import Callable, Mapping
from typing import Any

from scheduler_lib.broker import Broker
from scheduler_lib.broker.exceptions import InvalidArgument
from scheduler_lib.scheduler import catalog

DEFAULT_LIMIT = 200  # rows of the log a page shows
MAX_LIMIT = 5000  # rows: a bigger screen is a report, not a monitor
MAX_READS = 5  # reads of ``limit`` rows one refresh makes at most to fill it with rows the
# user may see (a user who may see few of many rows gets a partial page, said so)
MAX_ERROR = 4000  # characters of a task's error shown; the full text stays in the log


LAST_LOG_ID = 2**63 - 1  # above every log id: ``before`` for the newest rows
FAILED = "FAILED"


@dataclasses.dataclass(frozen=True)
class Filters:
    """Which rows to show; ``None`` means any.

    :param scheduler_handle: one scheduler (conversation) handle
    :param dag_id: one Airflow DAG
    :param run_id: one run of that DAG (needs ``dag_id``: run ids are unique per DAG only)
    :param failed: only rows whose task failed
    :param target: one target service
    :param kind: one task kind
    :param since: rows sent at or after this time (seconds since the epoch)
    :param until: rows sent before this time (seconds since the epoch)
    """

    scheduler_handle: str | None = None
    dag_id: str | None = None
    run_id: str | None = None
    failed: bool = False
    target: str | None = None
    kind: str | None = None
    since: float | None = None
    until: float | None = None

    def __post_init__(self) -> None:
        if self.run_id is not None and self.dag_id is None:
            raise InvalidArgument(
                f"run_id {self.run_id!r} needs dag_id: a run id names a run of one DAG only"
            )
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise InvalidArgument(
                f"since ({self.since}) must be before until ({self.until}): the time range is empty"
            )

    @classmethod
    def of(
        cls,
        scheduler_handle: str | None = None,
        dag_id: str | None = None,
        run_id: str | None = None,
        *,
        failed: bool = False,
        target: str | None = None,
        kind: str | None = None,
        since: float | str | None = None,
        until: float | str | None = None,
    ) -> Filters:
        """Filters from user input: blanks mean any, a run needs its DAG, times are
        seconds since the epoch.

        :raises InvalidArgument: for a run id without a DAG id, a time that is not a
            number, or a time range that is empty
        """
        return cls(
            _blank_is_none(scheduler_handle),
            _blank_is_none(dag_id),
            _blank_is_none(run_id),
            failed=bool(failed),
            target=_blank_is_none(target),
            kind=_blank_is_none(kind),
            since=_epoch(since, "since"),
            until=_epoch(until, "until"),
        )

    def matches(self, row: Mapping[str, Any]) -> bool:
        """Whether a row (of the log or of the status view) passes the filters."""
        sent_at = row.get("sent_at")
        return (
            (self.scheduler_handle is None or row.get("scheduler_handle") == self.scheduler_handle)
            and (self.dag_id is None or row.get("dag_id") == self.dag_id)
            and (self.run_id is None or row.get("run_id") == self.run_id)
            and (not self.failed or row.get("status") == FAILED)
            and (self.target is None or row.get("target_service") == self.target)
            and (self.kind is None or row.get("task_kind") == self.kind)
            and (self.since is None or (sent_at is not None and sent_at >= self.since))
            and (self.until is None or (sent_at is not None and sent_at < self.until))
        )

    @property
    def any(self) -> bool:
        """Whether some filter is set."""
        return self.failed or any(
            v is not None
            for v in (
                self.scheduler_handle,
                self.dag_id,
                self.run_id,
                self.target,
                self.kind,
                self.since,
                self.until,
            )
        )


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
    broker: Broker,
    filters: Filters = Filters(),
    *,
    limit: int = DEFAULT_LIMIT,
    before: int = LAST_LOG_ID,
) -> list[dict[str, Any]]:
    """The newest rows of ``execution_log`` that pass the filters, newest first.

    :param broker: the scheduler's broker
    :param filters: which rows to show
    :param limit: at most this many rows (1 to :data:`MAX_LIMIT`)
    :param before: only rows whose log id is below this one (to read on after a page)
    :raises InvalidArgument: for a limit out of range
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidArgument(f"limit must be a whole number from 1 to {MAX_LIMIT}, got {limit!r}")
    catalog.prepare(broker)
    query, params = _log_query(filters)
    narrowing = {
        "target": filters.target,
        "kind": filters.kind,
        "since": filters.since,
        "until": filters.until,
    }
    rows = broker.fetch(query, limit=limit, before=before, **params, **narrowing)
    return [_json_row(r) for r in rows]


def task(broker: Broker, log_id: int) -> dict[str, Any] | None:
    """One row of the log as :func:`execution_log` shows it, or ``None`` when there is no
    such row.

    :param broker: the scheduler's broker
    :param log_id: the row's log id
    """
    catalog.prepare(broker)
    rows = broker.fetch("monitor_task", log_id=log_id)
    return _json_row(rows[0]) if rows else None


def snapshot(
    broker: Broker,
    filters: Filters = Filters(),
    *,
    limit: int = DEFAULT_LIMIT,
    visible: Callable[[Mapping[str, Any]], bool] | None = None,
) -> dict[str, Any]:
    """Everything one refresh of the page needs: the server's clock (the page draws its
    timeline against it, not against the browser's), the running tasks and the log.

    With ``visible`` (the rows the user may see), the limit counts visible rows: the log
    is read on, ``limit`` rows at a time below the last one read, up to
    :data:`MAX_READS` reads; ``complete`` says whether the log was read as far as needed
    (false: fewer rows than the limit are shown, and older visible rows may exist).

    :param broker: the scheduler's broker
    :param filters: which rows to show
    :param limit: at most this many log rows
    :param visible: which rows the user may see (``None``: every row)
    """
    running = execution_status(broker, filters)
    log: list[dict[str, Any]] = []
    before, complete = LAST_LOG_ID, True
    for read in range(MAX_READS):
        rows = execution_log(broker, filters, limit=limit, before=before)
        log += [r for r in rows if visible is None or visible(r)]
        if len(log) >= limit or len(rows) < limit:
            break
        before = rows[-1]["log_id"]
        complete = read + 1 < MAX_READS
    if visible is not None:
        running = [r for r in running if visible(r)]
    return {
        "now": time.time(),
        "filters": dataclasses.asdict(filters),
        "running": running,
        "log": log[:limit],
        "complete": complete,
    }


def _log_query(filters: Filters) -> tuple[str, dict[str, str | None]]:
    """The named query for a filter shape, and its binds: each shape reads one index."""
    handle, dag, run = filters.scheduler_handle, filters.dag_id, filters.run_id
    if filters.failed:
        return "monitor_log_failed", {"handle": handle, "dag_id": dag, "run_id": run}
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


def _epoch(value: float | str | None, name: str) -> float | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(value, bool) or not 0 <= seconds < float("inf"):
        raise InvalidArgument(f"{name} must be a time in seconds since the epoch, got {value!r}")
    return seconds


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
