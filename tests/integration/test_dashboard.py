"""docs/grafana/scheduler_lib.json: a dashboard Grafana imports (its variables, its grid),
whose every expression names a metric that a real ``scheduler-lib serve --metrics-port``
(or a process running waves) exports — so a renamed metric cannot leave a panel silently empty."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.processes import Processes, init
from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import Task, TaskScheduler, metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "scheduler_lib.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# A metric name right before a selector, or one of ours wherever it stands (label_values)
SELECTED = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{")
OURS = re.compile(r"\b(?:scheduler_lib|process)_[a-zA-Z0-9_]+")
# What each type of family exports, by the names a query uses
SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count", ""),
}


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def expressions(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    found = [
        (f"panel {p['title']!r} {t['refId']}", t["expr"])
        for p in board["panels"]
        for t in p.get("targets", [])
    ]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            found.append((f"variable {variable['name']!r}", variable["query"]["query"]))
    return found


def metric_names(expr: str) -> set[str]:
    return set(SELECTED.findall(expr)) | set(OURS.findall(expr))


def exported_names(text: str) -> set[str]:
    """The series names a scrape offers to queries: a family's samples, and for a family
    without any yet (a labelled counter nothing counted) the names its type gives."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(sample.name for sample in family.samples)
        names.update(family.name + s for s in SAMPLE_SUFFIXES.get(family.type, ("",)))
    return names


def test_the_dashboard_is_one_grafana_imports() -> None:
    board = dashboard()
    # Given the JSON; Then it has a current schema, the datasource, job, instance and
    # queue variables, and every panel queries the chosen Prometheus
    assert board["schemaVersion"] >= 39 and board["uid"] and board["title"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"job", "instance"} <= variables.keys()
    assert (
        variables["queue"]["query"]["query"] == "label_values(scheduler_lib_queue_messages, queue)"
    )
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"{panel['title']!r} has no query"
        for target in [panel, *panel["targets"]]:
            assert target["datasource"] == DATASOURCE, panel["title"]
    # And every expression names at least one metric (else the check below proves nothing)
    for where, expr in expressions(board):
        assert metric_names(expr), f"{where}: no metric name found in {expr!r}"


@pytest.mark.timeout(120)
def test_every_metric_the_dashboard_queries_is_one_serve_exports(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'broker.db'}"
    init(url)
    with Processes(tmp_path) as processes:
        # Given `scheduler-lib serve --metrics-port 0` on a fresh broker
        serve = processes.start("serve", "serve", "--db", url, "--metrics-port", "0")
        processes.wait_said(serve, "health on /healthz", 60)
        said = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", processes.stdout(serve))
        assert said is not None, processes.output(serve)
        # When it has run one task, so the tasks' series exist, of a wave this process ran
        # and serves the metrics of (the wave's makespan is known where it is awaited)
        with Broker(url) as broker, metrics.serving(broker, 0, {}) as (_, here):
            report = TaskScheduler(broker).run_waves([[Task.python("math:sqrt", 4.0)]])
            assert [c.ok for c in report.completions] == [True]
            exported: set[str] = set()
            for scraped in (said.group(1), f"http://127.0.0.1:{here}/metrics"):
                with urllib.request.urlopen(scraped, timeout=30) as response:
                    exported |= exported_names(response.read().decode())
    # Then every metric the dashboard's expressions name is one of the scrapes'
    missing = {
        name: sorted(
            where for where, expr in expressions(dashboard()) if name in metric_names(expr)
        )
        for name in sorted(set().union(*(metric_names(e) for _, e in expressions(dashboard()))))
        if name not in exported
    }
    assert not missing, "metrics the dashboard queries that serve does not export:\n" + "\n".join(
        f"  {name} (in {', '.join(places)})" for name, places in missing.items()
    )
