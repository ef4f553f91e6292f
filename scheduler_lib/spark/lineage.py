"""OpenLineage events of Spark tasks: a run per ``spark_sql`` or ``pyspark`` task, its
START when the task begins and its COMPLETE, FAIL or ABORT (cancelled) when it ends.

Configured the OpenLineage way, with the client's own settings (``OPENLINEAGE_URL``,
``OPENLINEAGE_CONFIG`` or an ``openlineage.yml``, ``OPENLINEAGE__TRANSPORT__*``); none of
them set, or ``OPENLINEAGE_DISABLED=true``: no client, no events, no cost. The jobs'
namespace is ``OPENLINEAGE_NAMESPACE`` (as Airflow's and Spark's integrations read it),
their name ``<target service>.<task name>``.

A task sent by an Airflow task instance whose environment has Airflow's OpenLineage
provider carries that instance's OpenLineage run (``TaskContext.airflow``): it becomes the
run's ``parent`` facet (and its DAG run the ``root``), so a lineage backend shows the
task under the Airflow task that sent it.

A ``spark_sql`` task's datasets come from Spark's analyzed plan of each statement (the
tables and files it read, the table or path it wrote), named as OpenLineage's Spark
integration names them: the location (``file`` + path, ``hdfs://host`` + path...) with
the catalog's ``database.table`` as a symlink. A ``pyspark`` callable's are not known
(Python sees no plans of the jobs it runs): its run has its job and parent only.

Lineage never fails nor slows a task: events go out from one thread of their own, and an
error (configuration, a plan it cannot read, a transport) is logged once at WARNING.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import logging
import os
import queue
import threading
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from scheduler_lib.scheduler.kinds import TaskContext

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

NAMESPACE = "default"  # the jobs' namespace without OPENLINEAGE_NAMESPACE (the spec's default)
PENDING_LIMIT = 1000  # events waiting for the transport; more are dropped (and said once)
CLOSE_WAIT = 5.0  # seconds the process's exit waits for the events still waiting
PRODUCER = "urn:scheduler_lib:spark"
# Plans that write a table or files: their query is read for inputs, the output named by
# the method given (a CatalogTable, or an Option of one, or the written path)
WRITES = {
    "CreateDataSourceTableAsSelectCommand": "table",
    "CreateHiveTableAsSelectCommand": "tableDesc",
    "OptimizedCreateHiveTableAsSelectCommand": "tableDesc",
    "InsertIntoHiveTable": "table",
    "InsertIntoHadoopFsRelationCommand": "catalogTable",
}
# Settings that turn the client on (the client's own, see the module's docstring)
SETTINGS = ("OPENLINEAGE_URL", "OPENLINEAGE_CONFIG")
SETTINGS_PREFIX = "OPENLINEAGE__TRANSPORT"
CONFIG_FILES = ("openlineage.yml", os.path.join("~", ".openlineage", "openlineage.yml"))

_warned: set[str] = set()
_lock = threading.Lock()
_warned_lock = threading.Lock()
_UNSET: Any = object()
_emitter: Emitter | None = _UNSET  # the process's, once its first Spark task asked


def warn_once(what: str, message: str, *args: Any) -> None:
    """Log a lineage error at WARNING the first time (per kind of error), at DEBUG after."""
    with _warned_lock:
        first = what not in _warned
        _warned.add(what)
    log.log(logging.WARNING if first else logging.DEBUG, message, *args, exc_info=True)


def configured() -> bool:
    """Whether OpenLineage's client has a transport configured, and is not disabled."""
    if os.environ.get("OPENLINEAGE_DISABLED", "").strip().lower() == "true":
        return False
    if any(os.environ.get(name) for name in SETTINGS):
        return True
    if any(name.startswith(SETTINGS_PREFIX) for name in os.environ):
        return True
    return any(os.path.isfile(os.path.expanduser(path)) for path in CONFIG_FILES)


class Emitter:
    """The process's OpenLineage client and the thread that sends its events, in order."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.pending: queue.Queue[Any] = queue.Queue(PENDING_LIMIT)
        self.thread = threading.Thread(target=self._send, name="openlineage", daemon=True)
        self.thread.start()

    def emit(self, event: Any) -> None:
        try:
            self.pending.put_nowait(event)
        except queue.Full:
            warn_once(
                "full", "OpenLineage: %s events wait for the transport: dropped", PENDING_LIMIT
            )

    def _send(self) -> None:
        while True:
            event = self.pending.get()
            if event is None:
                return
            try:
                self.client.emit(event)
            except Exception:
                warn_once("emit", "OpenLineage: an event could not be sent")

    def close(self, timeout: float = CLOSE_WAIT) -> None:
        """Send what waits (up to ``timeout``), then stop the thread."""
        with contextlib.suppress(queue.Full):
            self.pending.put(None, timeout=timeout)
        self.thread.join(timeout)
        with contextlib.suppress(Exception):
            self.client.close(timeout)


def emitter() -> Emitter | None:
    """The process's emitter, made at its first Spark task: ``None`` without OpenLineage
    settings (or when its client cannot be made, said once)."""
    global _emitter
    if _emitter is not _UNSET:
        return _emitter
    with _lock:  # readers start their first tasks together: one client
        if _emitter is _UNSET:
            _emitter = _make_emitter()
        return _emitter


def _make_emitter() -> Emitter | None:
    if not configured():
        return None
    try:
        from openlineage.client import OpenLineageClient

        made = Emitter(OpenLineageClient())
    except Exception:
        warn_once("client", "OpenLineage is configured, but its client cannot be made")
        return None
    atexit.register(made.close)
    return made


def reset() -> None:
    """Forget the process's emitter (its settings changed: tests), sending what waits."""
    global _emitter
    with _lock:
        made, _emitter = _emitter, _UNSET
        _warned.clear()
    if isinstance(made, Emitter):
        made.close()


@contextlib.contextmanager
def task_run(
    context: TaskContext, spark: SparkSession, *, sql: Sequence[str] | None = None
) -> Iterator[TaskRun | None]:
    """The task's OpenLineage run around the block: START now, then COMPLETE — or FAIL
    (ABORT when the task was cancelled) when the block raises. ``None`` without
    OpenLineage (or when its START could not be made)."""
    sender = emitter()
    run: TaskRun | None = None
    if sender is not None:
        try:
            run = TaskRun(sender, context, spark, sql)
            run.send("START")
        except Exception:
            warn_once("start", "OpenLineage: task %s: no lineage run", context.log_id)
            run = None
    if run is None:
        yield None
        return
    try:
        yield run
    except BaseException as exc:
        run.end("ABORT" if context.cancelled.is_set() else "FAIL", exc)
        raise
    run.end("COMPLETE", None)


class TaskRun:
    """One task's lineage run: its job, its parent, the datasets it read and wrote."""

    def __init__(
        self,
        emitter: Emitter,
        context: TaskContext,
        spark: SparkSession,
        sql: Sequence[str] | None,
    ) -> None:
        from openlineage.client.uuid import generate_new_uuid

        self.emitter = emitter
        self.context = context
        self.spark = spark
        self.sql = sql
        self.run_id = str(generate_new_uuid())
        service = context.service
        self.job_name = f"{service}.{context.task.label}" if service else context.task.label
        self.namespace = os.environ.get("OPENLINEAGE_NAMESPACE") or NAMESPACE
        self.inputs: dict[tuple[str, str], Any] = {}
        self.outputs: dict[tuple[str, str], Any] = {}

    # --- datasets ----------------------------------------------------------------------

    def statement(self, frame: DataFrame) -> None:
        """Add the datasets a statement's DataFrame read and wrote (from its analyzed
        plan; a plan it cannot read is said once and adds nothing)."""
        try:
            plan = frame._jdf.queryExecution().analyzed()
            if _class(plan) == "CommandResult":
                plan = plan.commandLogicalPlan()
            kind = _class(plan)
            query = plan.query() if kind in WRITES else plan
            if kind in WRITES:
                written = getattr(plan, WRITES[kind])()
                if _class(written) in ("Some", "None$"):  # an Option of a CatalogTable
                    written = written.get() if written.isDefined() else None
                if written is not None:
                    self.table_written(written.identifier())
                else:  # a path with no table (INSERT OVERWRITE DIRECTORY)
                    self._add(self.outputs, self._file(plan.outputPath().toString()))
            for read in self._relations(query):
                self._add(self.inputs, read)
        except Exception:
            warn_once("plan", "OpenLineage: task %s: a plan's datasets", self.context.log_id)

    def written(self, output: Mapping[str, str]) -> None:
        """Add a ``spark_sql`` task's ``output`` (a table or a path) as an output."""
        try:
            if "table" in output:
                parser = self.spark._jsparkSession.sessionState().sqlParser()
                self.table_written(parser.parseTableIdentifier(output["table"]))
            else:
                self._add(self.outputs, self._file(output["path"]))
        except Exception:
            warn_once("plan", "OpenLineage: task %s: its output's dataset", self.context.log_id)

    def table_written(self, identifier: Any) -> None:
        """Add the catalog table ``identifier`` (a JVM ``TableIdentifier``) as an output,
        where the catalog says it is now."""
        catalog = self.spark._jsparkSession.sessionState().catalog()
        self._add(self.outputs, self._table(catalog.getTableMetadata(identifier)))

    def _relations(self, plan: Any) -> Iterator[Any]:
        """The datasets an analyzed plan reads: its leaves (and its subqueries' leaves)
        that are catalog tables or files."""
        plans = [plan]
        subqueries = plan.subqueriesAll()
        plans += [subqueries.apply(i) for i in range(subqueries.size())]
        for each in plans:
            leaves = each.collectLeaves()
            for i in range(leaves.size()):
                leaf = leaves.apply(i)
                kind = _class(leaf)
                if kind == "HiveTableRelation":
                    yield self._table(leaf.tableMeta())
                elif kind == "LogicalRelation":
                    table = leaf.catalogTable()
                    if table.isDefined():
                        yield self._table(table.get())
                        continue
                    paths = leaf.relation().location().rootPaths()  # files read by path
                    for j in range(paths.size()):
                        yield self._file(paths.apply(j).toString())

    def _add(self, into: dict[tuple[str, str], Any], dataset: Any) -> None:
        into.setdefault((dataset.namespace, dataset.name), dataset)

    def _table(self, table: Any) -> Any:
        """A catalog table as a dataset: its location, its ``database.table`` as a symlink
        in the warehouse's namespace (as OpenLineage's Spark integration does)."""
        from openlineage.client.event_v2 import Dataset
        from openlineage.client.facet_v2 import symlinks_dataset

        identifier = table.identifier()
        database = identifier.database()
        name = identifier.table()
        if database.isDefined():
            name = f"{database.get()}.{name}"
        namespace, path = dataset_id(table.location().toString())
        symlink = symlinks_dataset.Identifier(namespace=self._warehouse, name=name, type="TABLE")
        return Dataset(
            namespace=namespace,
            name=path,
            facets={"symlinks": symlinks_dataset.SymlinksDatasetFacet(identifiers=[symlink])},
        )

    def _file(self, location: str) -> Any:
        from openlineage.client.event_v2 import Dataset

        namespace, path = dataset_id(location)
        return Dataset(namespace=namespace, name=path)

    @functools.cached_property
    def _warehouse(self) -> str:
        """The namespace of the catalog's tables: the warehouse's location, as a URI."""
        location = self.spark.conf.get("spark.sql.warehouse.dir") or ""
        if "://" not in location and not location.startswith("file:"):
            location = "file:" + os.path.abspath(location)
        return location.rstrip("/")

    # --- events ------------------------------------------------------------------------

    def end(self, state: str, error: BaseException | None) -> None:
        try:
            self.send(state, error)
        except Exception:
            warn_once("end", "OpenLineage: task %s: no %s event", self.context.log_id, state)

    def send(self, state: str, error: BaseException | None = None) -> None:
        from openlineage.client.event_v2 import (
            InputDataset,
            Job,
            OutputDataset,
            Run,
            RunEvent,
            RunState,
        )
        from openlineage.client.facet_v2 import error_message_run, job_type_job, sql_job

        job_facets: dict[str, Any] = {
            "jobType": job_type_job.JobTypeJobFacet(
                processingType="BATCH", integration="SPARK", jobType="TASK"
            )
        }
        if self.sql:
            job_facets["sql"] = sql_job.SQLJobFacet(query=";\n".join(self.sql), dialect="spark")
        run_facets = self._run_facets()
        if error is not None:
            run_facets["errorMessage"] = error_message_run.ErrorMessageRunFacet(
                message=f"{type(error).__name__}: {error}"[:4000], programmingLanguage="PYTHON"
            )
        event = RunEvent(
            eventType=RunState[state],
            eventTime=datetime.datetime.now(datetime.timezone.utc).isoformat(),
            run=Run(runId=self.run_id, facets=run_facets),
            job=Job(namespace=self.namespace, name=self.job_name, facets=job_facets),
            inputs=[
                InputDataset(d.namespace, d.name, facets=d.facets) for d in self.inputs.values()
            ],
            outputs=[
                OutputDataset(d.namespace, d.name, facets=d.facets) for d in self.outputs.values()
            ],
            producer=PRODUCER,
        )
        self.emitter.emit(event)

    def _run_facets(self) -> dict[str, Any]:
        from openlineage.client.facet_v2 import processing_engine_run, tags_run

        facets: dict[str, Any] = {
            "processing_engine": processing_engine_run.ProcessingEngineRunFacet(
                version=self.spark.version, name="spark"
            )
        }
        airflow = self.context.airflow or {}
        parent = parent_facet(airflow)
        if parent is not None:
            facets["parent"] = parent
        tags = [("scheduler_lib.log_id", str(self.context.log_id))] + [
            (f"airflow.{k}", str(airflow[k]))
            for k in ("dag_id", "task_id", "run_id", "try_number", "map_index")
            if airflow.get(k) is not None
        ]
        facets["tags"] = tags_run.TagsRunFacet(
            tags=[tags_run.TagsRunFacetFields(k, v, "SCHEDULER_LIB") for k, v in tags]
        )
        return facets


def parent_facet(airflow: Mapping[str, Any]) -> Any:
    """The ``parent`` run facet naming the Airflow task instance's OpenLineage run (and
    its DAG run as ``root``), or ``None`` when the sender did not know its run."""
    from openlineage.client.facet_v2 import parent_run

    names = ("lineage_job_namespace", "lineage_job_name", "lineage_run_id")
    if not all(airflow.get(k) for k in names):
        return None
    root = None
    roots = ("lineage_root_job_namespace", "lineage_root_job_name", "lineage_root_run_id")
    if all(airflow.get(k) for k in roots):
        root = parent_run.Root(
            run=parent_run.RootRun(runId=airflow["lineage_root_run_id"]),
            job=parent_run.RootJob(
                namespace=airflow["lineage_root_job_namespace"],
                name=airflow["lineage_root_job_name"],
            ),
        )
    return parent_run.ParentRunFacet(
        run=parent_run.Run(runId=airflow["lineage_run_id"]),
        job=parent_run.Job(
            namespace=airflow["lineage_job_namespace"], name=airflow["lineage_job_name"]
        ),
        root=root,
    )


def dataset_id(location: str) -> tuple[str, str]:
    """(namespace, name) of the files at ``location``, per OpenLineage's naming: ``file``
    and the path; ``s3://bucket`` or ``gs://bucket`` and the key; ``scheme://authority``
    and the path otherwise."""
    parts = urllib.parse.urlsplit(location)
    scheme = parts.scheme or "file"
    path = parts.path.rstrip("/") or "/"
    if scheme == "file":
        return "file", path
    if scheme in ("s3", "s3a", "s3n", "gs"):
        return f"{'gs' if scheme == 'gs' else 's3'}://{parts.netloc}", path.lstrip("/")
    return (f"{scheme}://{parts.netloc}" if parts.netloc else scheme), path


def _class(obj: Any) -> str:
    return str(obj.getClass().getSimpleName())
