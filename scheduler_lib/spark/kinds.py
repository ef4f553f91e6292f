"""Spark task kinds: ``spark_sql`` (the blog's ``exec(@SQL)`` on Spark), ``pyspark`` (a
callable given the session) and ``spark_submit`` (an application submitted through the
Spark provider's ``SparkSubmitHook`` and tracked to completion).

Every ``spark_sql`` and ``pyspark`` task runs in a job group of its own,
``scheduler_lib-<log_id>``, recorded in ``execution_log`` with the application id and the
Spark UI; cancelling the task (its scheduler failed fast or was released) cancels the
group, which interrupts its running Spark tasks. Its jobs go to the FAIR-scheduler pool of
its conversation's priority (:func:`~scheduler_lib.spark.session.pool_for`).
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import json
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from scheduler_lib.broker.validation import resolve
from scheduler_lib.scheduler.errors import InvalidTask
from scheduler_lib.scheduler.kinds import (
    TaskContext,
    callable_fields,
    describe_statements,
    only_fields,
    register_kind,
    statements_field,
)
from scheduler_lib.spark import lineage
from scheduler_lib.spark import session as sessions

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

CANCEL_REPEAT = 0.5  # seconds between cancels of a cancelled task's later Spark jobs
COLLECT = 20  # rows of a query's result returned by default
COLLECT_LIMIT = 10_000  # most rows a task may ask to get back (they travel in a message)
WRITE_MODES = ("overwrite", "append", "error", "errorifexists", "ignore")
SUBMIT_OPTIONS = {  # spark_submit's fields, passed to SparkSubmitHook as they are
    "conf": dict,
    "name": str,
    "java_class": str,
    "py_files": str,
    "files": str,
    "jars": str,
    "packages": str,
    "driver_memory": str,
    "executor_memory": str,
    "executor_cores": int,
    "total_executor_cores": int,
    "num_executors": int,
    "deploy_mode": str,
    "env_vars": dict,
    "verbose": bool,
}


class TaskCancelled(Exception):
    """The task was cancelled before its next Spark statement."""


def job_group(log_id: int) -> str:
    """The Spark job group of a task."""
    return f"scheduler_lib-{log_id}"


@contextlib.contextmanager
def spark_job(context: TaskContext) -> Iterator[SparkSession]:
    """The worker's session, with the calling thread's jobs in the task's job group and
    its priority's pool for the ``with`` block; a cancel of the task cancels the group.

    Three py4j calls set it up (each is a round trip to the JVM). The properties stay on the
    reader's thread after the task: that thread starts no job before its next task sets
    them again.
    """
    spark = sessions.current()
    sc = spark.sparkContext
    group = job_group(context.log_id)
    application, ui_url = sessions.identity(spark)
    context.record_spark(application, group, ui_url)
    # interruptOnCancel: a cancel interrupts the job's running Spark tasks too.
    sc.setJobGroup(group, f"{context.task.label} (log {context.log_id})", True)
    sc.setLocalProperty("spark.scheduler.pool", sessions.pool_for(context.priority))
    # Tables another application (or session) rewrote since this session last read them:
    # its cached relations would still list the old files (FAILED_READ_FILE.FILE_NOT_EXIST
    # when a later wave ran on another worker of a shared metastore). A task starts from
    # the catalog as it is now. No public API drops them all; the call costs ~0.2 ms.
    spark._jsparkSession.sessionState().catalog().invalidateAllCachedTables()
    ended = threading.Event()

    def cancel_group() -> None:
        sc.cancelJobGroup(group)

        # cancelJobGroup stops the group's jobs running now, not later ones: a pyspark
        # callable cancelled between two actions (or before its first) would start its
        # next job and run it to its end. Until the task returns, its new jobs are
        # cancelled too.
        def later_jobs() -> None:
            while not ended.wait(CANCEL_REPEAT):
                with contextlib.suppress(Exception):  # the JVM may be stopping
                    sc.cancelJobGroup(group)

        threading.Thread(target=later_jobs, name=f"cancel-{group}", daemon=True).start()

    forget = context.on_cancel(cancel_group)
    try:
        yield spark
    finally:
        ended.set()
        forget()


def _check_cancelled(context: TaskContext) -> None:
    if context.cancelled.is_set():
        raise TaskCancelled(context.cancel_reason or "cancelled")


def _collect_field(spec: Mapping[str, Any], where: str) -> int:
    collect = spec.get("collect", COLLECT)
    if (
        isinstance(collect, bool)
        or not isinstance(collect, int)
        or not 0 <= collect <= COLLECT_LIMIT
    ):
        raise InvalidTask(
            f"{where}: field 'collect' must be an integer from 0 to {COLLECT_LIMIT}, "
            f"got {collect!r}"
        )
    return collect


def _jsonable(value: Any) -> Any:
    """Spark rows hold dates, decimals, bytes: make them JSON (as text where needed)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, datetime.date | datetime.datetime | datetime.time):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes | bytearray):
        return value.hex()
    if hasattr(value, "asDict"):
        return _jsonable(value.asDict(recursive=True))
    return repr(value)


def preview(frame: DataFrame, collect: int) -> dict[str, Any]:
    """A query's columns and first ``collect`` rows, as the task's result."""
    rows = frame.take(collect) if collect else []
    # The rows carry their column names: asking the DataFrame (its schema, as JSON from
    # the JVM) costs a round trip and a parse per task, so only an empty result does.
    columns = list(rows[0].__fields__) if rows else frame.columns
    return {"columns": columns, "rows": [_jsonable(r.asDict(recursive=True)) for r in rows]}


class SparkSqlKind:
    """``{"kind": "spark_sql", "sql": "statement" | [...], "args": {...},
    "output": {"table": "name" | "path": "...", "format": "parquet", "mode": "overwrite"},
    "collect": 20}``

    Statements run in order on the worker's session (``args`` fill ``:name`` markers).
    The last one's result is written to ``output`` when given, otherwise its first
    ``collect`` rows are the task's result. DDL and DML run when issued; a ``SELECT``
    runs only as the last statement (its rows are read or written).
    """

    name = "spark_sql"
    job_group = staticmethod(job_group)

    def validate(self, spec: dict[str, Any], where: str) -> dict[str, Any]:
        only_fields(spec, ("sql", "args", "output", "collect"), where)
        statements = statements_field(spec, where)
        args = spec.get("args", {})
        if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
            raise InvalidTask(f"{where}: field 'args' must be an object, got {args!r}")
        checked: dict[str, Any] = {
            "sql": statements,
            "args": args,
            "collect": _collect_field(spec, where),
        }
        output = spec.get("output")
        if output is not None:
            checked["output"] = _output(output, where)
        return checked

    def run(self, spec: Mapping[str, Any], context: TaskContext) -> Any:
        statements = spec["sql"]
        with (
            spark_job(context) as spark,
            lineage.task_run(context, spark, sql=statements) as lineage_run,
        ):
            frame = None
            for number, statement in enumerate(statements, start=1):
                _check_cancelled(context)
                try:
                    frame = spark.sql(statement, args=spec.get("args") or None)
                except Exception as exc:
                    raise SparkSqlError(_statement_error(number, len(statements), exc)) from exc
                if lineage_run is not None:
                    lineage_run.statement(frame)
            assert frame is not None
            _check_cancelled(context)
            output = spec.get("output")
            try:
                if output is not None:
                    writer = frame.write.mode(output.get("mode", "errorifexists"))
                    if "format" in output:
                        writer = writer.format(output["format"])
                    if "table" in output:
                        writer.saveAsTable(output["table"])
                    else:
                        writer.save(output["path"])
                    if lineage_run is not None:
                        lineage_run.written(output)
                    return {"statements": len(statements), "output": output}
                result = preview(frame, spec.get("collect", COLLECT))
            except Exception as exc:
                raise SparkSqlError(
                    _statement_error(len(statements), len(statements), exc)
                ) from exc
            return {"statements": len(statements), **result}

    def describe(self, spec: Mapping[str, Any]) -> str:
        return describe_statements(spec, "spark_sql")


class SparkSqlError(Exception):
    """A Spark SQL statement failed; the message names it and carries Spark's error."""


def _statement_error(number: int, count: int, exc: Exception) -> str:
    where = f"statement {number} of {count}" if count > 1 else "the statement"
    # Spark's messages may start with a line break; the first line should say it all.
    return f"{where} failed: {type(exc).__name__}: {str(exc).strip()}"


def _output(output: Any, where: str) -> dict[str, str]:
    if not isinstance(output, dict):
        raise InvalidTask(
            f"{where}: field 'output' must be an object with 'table' or 'path', got {output!r}"
        )
    unknown = sorted(set(output) - {"table", "path", "format", "mode"})
    if unknown:
        raise InvalidTask(
            f"{where}: output: unknown field(s) {unknown}; it takes table or path, format, mode"
        )
    places = [k for k in ("table", "path") if k in output]
    if len(places) != 1 or not isinstance(output[places[0]], str) or not output[places[0]]:
        raise InvalidTask(f"{where}: output needs exactly one of 'table' or 'path', got {output!r}")
    mode = output.get("mode", "errorifexists")
    if mode not in WRITE_MODES:
        raise InvalidTask(f"{where}: output mode must be one of {WRITE_MODES}, got {mode!r}")
    if "format" in output and (not isinstance(output["format"], str) or not output["format"]):
        raise InvalidTask(f"{where}: output format must name a format, got {output['format']!r}")
    return dict(output)


class PySparkKind:
    """``{"kind": "pyspark", "callable": "package.module:function", "args": [...],
    "kwargs": {...}, "collect": 20}``: ``function(spark, *args, **kwargs)`` runs in the
    task's job group; its return value is the result (a DataFrame's first ``collect``
    rows)."""

    name = "pyspark"
    job_group = staticmethod(job_group)

    def validate(self, spec: dict[str, Any], where: str) -> dict[str, Any]:
        only_fields(spec, ("callable", "args", "kwargs", "collect"), where)
        return {**callable_fields(spec, where), "collect": _collect_field(spec, where)}

    def run(self, spec: Mapping[str, Any], context: TaskContext) -> Any:
        function = resolve(spec["callable"], "pyspark task callable")
        with spark_job(context) as spark, lineage.task_run(context, spark):
            _check_cancelled(context)
            value = function(spark, *spec["args"], **spec["kwargs"])
            if hasattr(value, "take") and hasattr(value, "columns"):  # a DataFrame
                return preview(value, spec.get("collect", COLLECT))
            return _jsonable(value)

    def describe(self, spec: Mapping[str, Any]) -> str:
        return str(spec.get("callable", "pyspark"))


class SparkSubmitKind:
    """``{"kind": "spark_submit", "application": "app.py" | "app.jar",
    "application_args": [...], "conn_id": "spark_default", "conf": {...}, ...}``

    Submitted with the Spark provider's ``SparkSubmitHook`` (its other options:
    ``name``, ``java_class``, ``py_files``, ``jars``, ``packages``, memory and cores,
    ``deploy_mode``, ``env_vars``) and tracked until it ends; a non-zero exit is a failed
    task with the tail of spark-submit's log. The master comes from the Airflow connection
    ``conn_id``, which must exist (the provider would silently submit to YARN otherwise),
    e.g. ``AIRFLOW_CONN_SPARK_DEFAULT='{"conn_type": "spark", "host": "local[*]"}'``.
    Cancelling the task kills the submission (and its driver, in cluster mode).
    """

    name = "spark_submit"

    def validate(self, spec: dict[str, Any], where: str) -> dict[str, Any]:
        only_fields(spec, ("application", "application_args", "conn_id", *SUBMIT_OPTIONS), where)
        application = spec.get("application")
        if not isinstance(application, str) or not application.strip():
            raise InvalidTask(
                f"{where}: field 'application' must be the path of a .py or .jar "
                f"application, got {application!r}"
            )
        args = spec.get("application_args", [])
        if not isinstance(args, list) or not all(
            isinstance(a, str | int | float) and not isinstance(a, bool) for a in args
        ):
            raise InvalidTask(
                f"{where}: field 'application_args' must be a list of strings, got {args!r}"
            )
        conn_id = spec.get("conn_id", "spark_default")
        if not isinstance(conn_id, str) or not conn_id:
            raise InvalidTask(f"{where}: field 'conn_id' must name a connection, got {conn_id!r}")
        checked: dict[str, Any] = {
            "application": application,
            "application_args": [str(a) for a in args],
            "conn_id": conn_id,
        }
        for field, kind in SUBMIT_OPTIONS.items():
            if field in spec:
                value = spec[field]
                if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                    raise InvalidTask(
                        f"{where}: field {field!r} must be {kind.__name__}, got {value!r}"
                    )
                checked[field] = value
        return checked

    def run(self, spec: Mapping[str, Any], context: TaskContext) -> Any:
        hook = _submit_hook(spec, context)
        context.record_spark(None, f"spark_submit-{context.log_id}", None)
        forget = context.on_cancel(hook.on_kill)
        try:
            _check_cancelled(context)
            hook.submit(spec["application"])
        finally:
            forget()
        application_id = (
            getattr(hook, "_yarn_application_id", None)
            or getattr(hook, "_kubernetes_application_id", None)
            or getattr(hook, "_driver_id", None)
        )
        if application_id:
            context.record_spark(application_id, f"spark_submit-{context.log_id}", None)
        return {"application": spec["application"], "application_id": application_id}

    def describe(self, spec: Mapping[str, Any]) -> str:
        return f"spark-submit {spec.get('application', '')}".strip()


def _submit_hook(spec: Mapping[str, Any], context: TaskContext) -> Any:
    """The provider's hook, after checking its connection exists."""
    # Imported here: only spark_submit tasks need the provider (and Airflow).
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    try:
        SparkSubmitHook.get_connection(spec["conn_id"])
    except Exception as exc:
        raise InvalidTask(
            f"task {context.log_id}: spark_submit needs the Airflow connection "
            f"{spec['conn_id']!r} ({type(exc).__name__}: {exc}); without it the Spark "
            "provider submits to YARN",
            hint="e.g. AIRFLOW_CONN_SPARK_DEFAULT="
            + json.dumps(json.dumps({"conn_type": "spark", "host": "local[*]"})),
        ) from None
    options = {k: spec[k] for k in SUBMIT_OPTIONS if k in spec}
    options.setdefault("name", f"{context.task.label} (log {context.log_id})")
    return SparkSubmitHook(
        conn_id=spec["conn_id"], application_args=list(spec["application_args"]), **options
    )


KINDS = (SparkSqlKind(), PySparkKind(), SparkSubmitKind())
NAMES = tuple(k.name for k in KINDS)


def register() -> None:
    """Make the Spark kinds known in this process (importing this package does it)."""
    for kind in KINDS:
        register_kind(kind)
