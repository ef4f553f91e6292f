"""Task kinds: what a task is, how it is checked, how it runs.

A task is a JSON object with ``kind``, an optional ``name`` and ``semaphore``, and the
kind's own fields. The caller checks a task before anything is sent (malformed tasks and
kinds the target does not run are refused there); the executor runs it. Kinds are
pluggable: the Spark layer registers ``spark_sql``, ``pyspark`` and ``spark_submit``
with :func:`register_kind` without touching this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import sqlalchemy as sa

from scheduler_lib.broker.db import engine as engines
from scheduler_lib.broker.exceptions import InvalidArgument
from scheduler_lib.broker.validation import resolve
from scheduler_lib.scheduler.errors import InvalidTask, UnknownKind

log = logging.getLogger(__name__)

COMMON_FIELDS = ("kind", "name", "semaphore")
# Levels of lists and objects a task's field (``args``, ``kwargs``...) may nest: deeper
# ones are refused (a recursive encoder would run out of stack on them). Below the
# broker's JSON limit (validation.MAX_JSON_DEPTH): the task travels inside a message.
MAX_TASK_DEPTH = 100


@dataclasses.dataclass(frozen=True)
class Task:
    """One task: its kind, the kind's fields, a name for the log, and optionally a named
    semaphore it must hold while it runs."""

    kind: str
    spec: Mapping[str, Any]
    name: str | None = None
    semaphore: str | None = None

    @classmethod
    def python(
        cls,
        target: str,
        *args: Any,
        name: str | None = None,
        semaphore: str | None = None,
        **kwargs: Any,
    ) -> Task:
        """A ``python`` task: ``target`` (``package.module:function``) called with JSON
        arguments."""
        return cls(
            "python", {"callable": target, "args": list(args), "kwargs": kwargs}, name, semaphore
        )

    @classmethod
    def sql(cls, *statements: str, name: str | None = None, semaphore: str | None = None) -> Task:
        """An ``sql`` task: statements run in one transaction (the blog's ``exec(@SQL)``)."""
        return cls("sql", {"sql": list(statements)}, name, semaphore)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "task") -> Task:
        """A task from its JSON form; ``where`` names it in errors."""
        if not isinstance(data, Mapping):
            raise InvalidTask(f"{where}: a task is an object with a 'kind', got {data!r}")
        kind = data.get("kind")
        if not isinstance(kind, str) or not kind:
            raise InvalidTask(f"{where}: field 'kind' must name a task kind, got {kind!r}")
        name = data.get("name")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise InvalidTask(f"{where}: field 'name' must be non-empty text, got {name!r}")
        semaphore = data.get("semaphore")
        if semaphore is not None and (not isinstance(semaphore, str) or not semaphore.strip()):
            raise InvalidTask(
                f"{where}: field 'semaphore' must name a semaphore, got {semaphore!r}"
            )
        spec = {k: v for k, v in data.items() if k not in COMMON_FIELDS}
        return cls(kind, spec, name, semaphore)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"kind": self.kind, **self.spec}
        if self.name is not None:
            data["name"] = self.name
        if self.semaphore is not None:
            data["semaphore"] = self.semaphore
        return data

    @property
    def label(self) -> str:
        """The name the log shows: the task's name, else one made from its kind."""
        if self.name:
            return self.name
        describe = KINDS[self.kind].describe if self.kind in KINDS else None
        return describe(self.spec) if describe else self.kind


def as_task(task: Task | Mapping[str, Any], where: str = "task") -> Task:
    """A :class:`Task` from a task or its JSON form, checked by its kind when this process
    knows the kind (the executor checks again before running it)."""
    checked = task if isinstance(task, Task) else Task.from_dict(task, where)
    kind = KINDS.get(checked.kind)
    if kind is not None:
        spec = kind.validate(dict(checked.spec), where)
        checked = dataclasses.replace(checked, spec=spec)
    for field, value in checked.spec.items():
        if _nested_deeper(value, MAX_TASK_DEPTH):
            raise InvalidTask(
                f"{where}: field {field!r} nests lists and objects more than "
                f"{MAX_TASK_DEPTH} levels deep"
            )
    try:
        json.dumps(checked.to_dict())
    except (TypeError, ValueError) as exc:
        raise InvalidTask(f"{where}: a task must be JSON (its arguments too): {exc}") from None
    return checked


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether lists, tuples and dicts nest in ``value`` more than ``limit`` levels deep
    (walked level by level, without recursion, and no further than the limit)."""
    containers = [value] if isinstance(value, list | tuple | dict) else []
    for _ in range(limit):
        if not containers:  # shallower than the limit: done (most tasks, at once)
            return False
        containers = [
            item
            for c in containers
            for item in (c.values() if isinstance(c, dict) else c)
            if isinstance(item, list | tuple | dict)
        ]
    return bool(containers)


@dataclasses.dataclass
class TaskContext:
    """What a running task may know and use.

    A task is cancelled when its scheduler fails fast or is released while it runs: the
    worker calls :meth:`cancel`, which sets :attr:`cancelled` and runs the callbacks kinds
    registered with :meth:`on_cancel` (a Spark task cancels its job group). Kinds that
    cannot be interrupted (``sql``, ``python``) may look at :attr:`cancelled` instead.
    """

    log_id: int
    task: Task
    sql_url: str  # where ``sql`` tasks run
    record_spark: Callable[[str | None, str | None, str | None], None]
    """(application id, job group, Spark UI URL): where the task runs, for the log (a
    no-op when the start already recorded the same)."""
    priority: int = 5  # the conversation's priority level (1..10)
    service: str | None = None  # the target service the task was sent to
    airflow: Mapping[str, Any] | None = None
    """The Airflow task instance that sent the task (``dag_id``, ``run_id``, ``task_id``,
    ``try_number``, ``map_index``, its OpenLineage run ``lineage_*``: those the sender
    set, see ``client.INSTANCE_FIELDS``); ``None`` from a sender without Airflow."""
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    cancel_reason: str | None = None
    _callbacks: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` when the task is cancelled (at once if it already is).

        :return: a function that unregisters it
        """
        with self._lock:
            if not self.cancelled.is_set():
                self._callbacks.append(callback)
                return lambda: self._forget(callback)
        callback()
        return lambda: None

    def cancel(self, reason: str) -> None:
        """Ask the task to stop (idempotent)."""
        with self._lock:
            if self.cancelled.is_set():
                return
            self.cancel_reason = reason
            self.cancelled.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.warning("task %s: a cancel callback failed", self.log_id, exc_info=True)

    def _forget(self, callback: Callable[[], None]) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._callbacks.remove(callback)


class TaskKind(Protocol):
    """What a kind provides."""

    name: str

    def validate(self, spec: dict[str, Any], where: str) -> dict[str, Any]:
        """The spec, checked and normalized; raise :class:`InvalidTask` naming the field."""
        ...

    def run(self, spec: Mapping[str, Any], context: TaskContext) -> Any:
        """Run the task; return a JSON-serialisable result or raise."""
        ...

    def describe(self, spec: Mapping[str, Any]) -> str:
        """A short label for the log when the task has no name."""
        ...


def job_group_of(kind: TaskKind, log_id: int) -> str | None:
    """The Spark job group a kind runs a task in, when it says so up front (an optional
    ``job_group(log_id)`` method): the executor records it with the task's start."""
    job_group = getattr(kind, "job_group", None)
    return None if job_group is None else job_group(log_id)


KINDS: dict[str, TaskKind] = {}


def register_kind(kind: TaskKind) -> None:
    """Make a task kind known in this process (the executor runs only known kinds)."""
    if not isinstance(getattr(kind, "name", None), str) or not kind.name:
        raise InvalidArgument(f"a task kind needs a name, got {kind!r}")
    KINDS[kind.name] = kind


def get_kind(name: str) -> TaskKind:
    kind = KINDS.get(name)
    if kind is None:
        raise UnknownKind(
            f"unknown task kind {name!r}; this process knows {sorted(KINDS)}",
            hint="a kind is known once its module called register_kind in this process",
        )
    return kind


class PythonKind:
    """``{"kind": "python", "callable": "package.module:function", "args": [...],
    "kwargs": {...}}``: the function's return value is the result."""

    name = "python"

    def validate(self, spec: dict[str, Any], where: str) -> dict[str, Any]:
        only_fields(spec, ("callable", "args", "kwargs"), where)
        return callable_fields(spec, where)

    def run(self, spec: Mapping[str, Any], context: TaskContext) -> Any:
        function = resolve(spec["callable"], "task callable")
        return function(*spec["args"], **spec["kwargs"])

    def describe(self, spec: Mapping[str, Any]) -> str:
        return str(spec.get("callable", "python"))


class SqlKind:
    """``{"kind": "sql", "sql": "statement" | ["statement", ...]}``: run in one
    transaction on the executor's SQL database; the result is the rows changed (or
    returned) by each statement."""

    name = "sql"

    def validate(self, spec: dict[str, Any], where: str) -> dict[str, Any]:
        only_fields(spec, ("sql",), where)
        return {"sql": statements_field(spec, where)}

    def run(self, spec: Mapping[str, Any], context: TaskContext) -> Any:
        counts = []
        with _sql_engine(context.sql_url).begin() as conn:
            for statement in spec["sql"]:
                result = conn.exec_driver_sql(statement)
                counts.append(len(result.fetchall()) if result.returns_rows else result.rowcount)
        return counts

    def describe(self, spec: Mapping[str, Any]) -> str:
        return describe_statements(spec, "sql")


@functools.cache
def _sql_engine(url: str) -> sa.Engine:
    # The user's database, not the broker's store: the blog's exec(@SQL) runs the task's
    # own statements there (with the broker's engine settings: WAL and BEGIN IMMEDIATE
    # on SQLite, psycopg on PostgreSQL).
    return engines.create_engine(url, pool_pre_ping=True, broker=False)


def statements_field(spec: Mapping[str, Any], where: str) -> list[str]:
    """A task's ``sql``: one statement or a non-empty list of them, as a list."""
    statements = spec.get("sql")
    if isinstance(statements, str):
        statements = [statements]
    if (
        not isinstance(statements, list)
        or not statements
        or not all(isinstance(s, str) and s.strip() for s in statements)
    ):
        raise InvalidTask(
            f"{where}: field 'sql' must be a statement or a non-empty list of them, "
            f"got {spec.get('sql')!r}"
        )
    return statements


def describe_statements(spec: Mapping[str, Any], default: str) -> str:
    """A statement task's label: its first statement, on one line, at most 60 characters."""
    first = " ".join(str(spec.get("sql", [default])[0]).split())
    return first if len(first) <= 60 else first[:57] + "..."


def callable_fields(spec: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A task's ``callable`` (a dotted path), ``args`` (a list) and ``kwargs`` (an
    object), checked: what kinds that call a function take (``python``, ``pyspark``)."""
    target = spec.get("callable")
    if not isinstance(target, str) or not target.replace(":", ".").count("."):
        raise InvalidTask(
            f"{where}: field 'callable' must be a dotted path like "
            f"'package.module:function', got {target!r}"
        )
    args = spec.get("args", [])
    if not isinstance(args, list):
        raise InvalidTask(f"{where}: field 'args' must be a list, got {args!r}")
    kwargs = spec.get("kwargs", {})
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidTask(f"{where}: field 'kwargs' must be an object, got {kwargs!r}")
    return {"callable": target, "args": args, "kwargs": kwargs}


def only_fields(spec: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    """Refuse fields a kind does not take, naming them."""
    unknown = sorted(set(spec) - set(allowed))
    if unknown:
        raise InvalidTask(
            f"{where}: unknown field(s) {unknown}; this kind takes {list(allowed)} "
            f"and {list(COMMON_FIELDS)}"
        )


register_kind(PythonKind())
register_kind(SqlKind())
