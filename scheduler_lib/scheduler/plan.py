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
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import yaml

from scheduler_lib.broker.exceptions import InvalidArgument
from scheduler_lib.scheduler.client import POLICIES
from scheduler_lib.scheduler.errors import PlanError
from scheduler_lib.scheduler.kinds import Task, as_task

TOP_FIELDS = ("target", "policy", "max_in_flight", "timeout", "waves")


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
        text = Path(path).read_text()
    except OSError as exc:
        raise PlanError(f"{where}: cannot read the plan: {exc.strerror or exc}") from None
    return parse_plan(text, where)


def parse_plan(text: str, where: str = "<plan>") -> Plan:
    """Check a plan given as YAML text (``where`` names it in errors)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise PlanError(f"{where}{line}: not valid YAML: {problem}") from None
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
        isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1
    ):
        raise fail(
            keys["max_in_flight"][1],
            f"field 'max_in_flight' must be an integer >= 1, got {max_in_flight!r}",
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
