"""Plan files for ``scheduler-lib run``: waves of tasks in YAML.

.. code-block:: yaml

    target: ServiceAsyncTarget   # optional: the target service
    policy: fail_fast            # or: continue
    max_in_flight: 3             # optional
    timeout: 3600                # optional: seconds to wait for any one completion
    waves:
      - - {kind: sql, sql: "CREATE TABLE t AS SELECT 1 AS x"}
      - - {kind: python, callable: "time:sleep", args: [1.5], name: nap}
        - {kind: sql, sql: ["INSERT INTO t VALUES (2)", "INSERT INTO t VALUES (3)"]}

A wave is a list of tasks, or ``{name: ..., tasks: [...]}``. Every error names the file,
the line and the field.

A plan is UTF-8 text of at most 1 MiB (:data:`MAX_PLAN_SIZE`), nested at most 200 levels
deep (:data:`MAX_PLAN_DEPTH`; a task's ``args`` at most 100, ``kinds.MAX_TASK_DEPTH``);
it has no YAML aliases (``*name``: each would copy its anchor, so a few lines could
expand to gigabytes) and no key twice in one mapping.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from scheduler_lib.broker import validation as checks
from scheduler_lib.broker.exceptions import InvalidArgument
from scheduler_lib.scheduler.client import POLICIES
from scheduler_lib.scheduler.errors import PlanError
from scheduler_lib.scheduler.kinds import Task, as_task

TOP_FIELDS = ("target", "policy", "max_in_flight", "timeout", "waves")
MAX_PLAN_SIZE = 1024 * 1024  # bytes
MAX_PLAN_DEPTH = 200  # levels of nested lists and mappings


class _Refused(yaml.YAMLError):
    """What the plan's YAML may not do, at a line (said as is, not as invalid YAML)."""

    def __init__(self, message: str, node_or_event: yaml.Node | yaml.Event) -> None:
        super().__init__(message)
        self.message = message
        self.problem_mark = node_or_event.start_mark


class _PlanLoader(yaml.SafeLoader):
    """The safe loader, refusing aliases, duplicate keys and deep nesting (each would
    otherwise cost gigabytes, silently drop a value, or overflow the stack)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._field: str | None = None  # the key of the innermost mapping composed

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        outer = self._field
        if isinstance(index, yaml.ScalarNode):  # a mapping's value: its key is the field
            self._field = index.value
        field = "" if self._field is None else f"field {self._field!r}: "
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _Refused(
                f"{field}YAML aliases (*{event.anchor}) are not allowed in a plan: "
                "write the value out",
                event,
            )
        self._depth += 1
        try:
            if self._depth > MAX_PLAN_DEPTH:
                raise _Refused(
                    f"{field}the plan nests more than {MAX_PLAN_DEPTH} levels deep",
                    self.peek_event(),
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._field = outer

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        # No merge keys (<<): without aliases they have nothing to merge.
        mapping: dict[Any, Any] = {}
        first: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                raise _Refused(f"a mapping key must be a plain value, got {key!r}", key_node)
            if key in mapping:
                raise _Refused(
                    f"field {key!r} is given twice (first on line {first[key]})", key_node
                )
            first[key] = key_node.start_mark.line + 1
            mapping[key] = self.construct_object(value_node, deep=deep)
        return mapping


@dataclasses.dataclass(frozen=True)
class Plan:
    path: str
    waves: list[list[Task]]
    wave_names: list[str | None]
    target: str | None = None
    policy: str = "fail_fast"
    max_in_flight: int | None = None
    timeout: float | None = None
    lines: list[list[int]] = dataclasses.field(default_factory=list)  # of each task

    @property
    def task_count(self) -> int:
        return sum(len(w) for w in self.waves)


def load_plan(path: str | Path) -> Plan:
    """Read and check a plan file.

    :raises PlanError: naming the file, line and field of the first problem
    """
    where = str(path)
    try:
        with Path(path).open("rb") as file:
            data = file.read(MAX_PLAN_SIZE + 1)
    except OSError as exc:
        raise PlanError(f"{where}: cannot read the plan: {exc.strerror or exc}") from None
    if len(data) > MAX_PLAN_SIZE:
        raise PlanError(f"{where}: a plan is at most {MAX_PLAN_SIZE} bytes; this one is larger")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise PlanError(
            f"{where}:{line}: a plan is UTF-8 text; byte {exc.object[exc.start]:#04x} "
            f"(offset {exc.start}) is not"
        ) from None
    return parse_plan(text, where)


def parse_plan(text: str, where: str = "<plan>") -> Plan:
    """Check a plan given as YAML text (``where`` names it in errors)."""
    if len(text) > MAX_PLAN_SIZE:
        raise PlanError(f"{where}: a plan is at most {MAX_PLAN_SIZE} characters")
    loader: _PlanLoader | None = None
    try:
        loader = _PlanLoader(text)
        root = loader.get_single_node()
        data = None if root is None else loader.construct_document(root)
    except _Refused as exc:
        raise PlanError(f"{where}:{exc.problem_mark.line + 1}: {exc.message}") from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow
        line = text.count("\n", 0, exc.position) + 1
        raise PlanError(
            f"{where}:{line}: not valid YAML: character U+{exc.character:04X} is not allowed"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise PlanError(f"{where}{at}: not valid YAML: {problem}") from None
    finally:
        if loader is not None:
            loader.dispose()
    if root is None or not isinstance(data, dict):
        raise PlanError(
            f"{where}:1: a plan is a mapping with 'waves' (and optional {list(TOP_FIELDS[:-1])})"
        )
    assert isinstance(root, yaml.MappingNode)

    def fail(node: yaml.Node, message: str) -> PlanError:
        return PlanError(f"{where}:{node.start_mark.line + 1}: {message}")

    keys = {k.value: (k, v) for k, v in root.value}
    for key, (knode, _) in keys.items():
        if key not in TOP_FIELDS:
            raise fail(knode, f"unknown field {key!r}; a plan has {list(TOP_FIELDS)}")
    if "waves" not in keys:
        raise fail(root, "field 'waves' is missing: a list of waves, each a list of tasks")
    policy = data.get("policy", "fail_fast")
    if policy not in POLICIES:
        raise fail(keys["policy"][1], f"field 'policy' must be one of {POLICIES}, got {policy!r}")
    target = data.get("target")
    if target is not None and (not isinstance(target, str) or not target.strip()):
        raise fail(keys["target"][1], f"field 'target' must name a service, got {target!r}")
    max_in_flight = data.get("max_in_flight")
    if max_in_flight is not None and (
        isinstance(max_in_flight, bool)
        or not isinstance(max_in_flight, int)
        or not 1 <= max_in_flight <= checks.INT_MAX
    ):
        raise fail(
            keys["max_in_flight"][1],
            f"field 'max_in_flight' must be an integer from 1 to {checks.INT_MAX}, "
            f"got {str(max_in_flight)[:40]}",
        )
    timeout = data.get("timeout")
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise fail(keys["timeout"][1], f"field 'timeout' must be seconds > 0, got {timeout!r}")
    waves_node = keys["waves"][1]
    raw_waves = data["waves"]
    if not isinstance(raw_waves, list) or not raw_waves:
        raise fail(waves_node, "field 'waves' must be a non-empty list of waves")
    assert isinstance(waves_node, yaml.SequenceNode)
    waves: list[list[Task]] = []
    names: list[str | None] = []
    lines: list[list[int]] = []
    for w, (wnode, wave) in enumerate(zip(waves_node.value, raw_waves, strict=True), start=1):
        name = None
        tasks_node = wnode
        if isinstance(wave, dict):
            wkeys = {k.value: (k, v) for k, v in wnode.value}
            for key, (knode, _) in wkeys.items():
                if key not in ("name", "tasks"):
                    raise fail(
                        knode, f"wave {w}: unknown field {key!r}; a wave has 'name', 'tasks'"
                    )
            if "tasks" not in wkeys:
                raise fail(wnode, f"wave {w}: field 'tasks' is missing")
            name = wave.get("name")
            tasks_node, wave = wkeys["tasks"][1], wave["tasks"]
        if not isinstance(wave, list) or not wave:
            raise fail(tasks_node, f"wave {w} must be a non-empty list of tasks")
        checked = []
        for i, (tnode, task) in enumerate(zip(tasks_node.value, wave, strict=True), start=1):
            label = f"wave {w}, task {i}"
            try:
                checked.append(as_task(task, label))
            except InvalidArgument as exc:
                raise fail(_field_node(tnode, str(exc)), str(exc)) from None
        waves.append(checked)
        names.append(None if name is None else str(name))
        lines.append([t.start_mark.line + 1 for t in tasks_node.value])
    return Plan(where, waves, names, target, policy, max_in_flight, timeout, lines)


def _field_node(task: yaml.Node, message: str) -> yaml.Node:
    """The node of the field an error names ("field 'x'"), else the task's."""
    found = re.search(r"field '(\w+)'", message)
    if found and isinstance(task, yaml.MappingNode):
        for key, value in task.value:
            if key.value == found.group(1):
                return value
    return task
