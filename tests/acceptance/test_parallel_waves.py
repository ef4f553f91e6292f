"""The blog's script (waves of 4, 2, 1, 2, 1 tasks of 10.1 ... 6.5 units, a unit 1/20 s)
through the documented commands, each in its own process with its default settings and
started cold: `scheduler-lib serve` on SQLite and PostgreSQL (python tasks), and
`scheduler-lib worker` (Spark SQL tasks that sleep in the JVM). Each wave's tasks overlap
on distinct readers, the waves run in order, and the makespan stays under the ideal x 1.5
(what holds on a loaded machine; the tight figure belongs to the benchmark)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.processes import CLI, TARGET_QUEUE, Processes
from scheduler_lib.broker import Broker

SERVED = 180.0  # seconds for a command started cold to monitor its queue (a JVM's start)
UNIT = 1 / 20  # seconds per unit of the blog's WAITFOR DELAY lengths
WAVES = [[10.1, 9.9, 9.7, 9.5], [9.3, 9.1], [8.9], [8.7, 8.5], [6.5]]
IDEAL = sum(max(wave) for wave in WAVES) * UNIT


def _plan(path: Path, task: str) -> Path:
    lines = ["waves:"]
    for w, wave in enumerate(WAVES, start=1):
        for t, units in enumerate(wave, start=1):
            seconds = round(units * UNIT, 3)
            body = (
                f'{{kind: python, callable: "time:sleep", args: [{seconds}], name: w{w}t{t}}}'
                if task == "python"
                else f"{{kind: spark_sql, sql: \"SELECT java_method('java.lang.Thread', "
                f"'sleep', CAST({int(seconds * 1000)} AS BIGINT))\", name: w{w}t{t}}}"
            )
            lines.append(("  - - " if t == 1 else "    - ") + body)
    path.write_text("\n".join(lines) + "\n")
    return path


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    """The long-running commands a test starts; stopped (SIGTERM) at its end."""
    with Processes(tmp_path) as started:
        yield started


def _served(processes: Processes, url: str, *args: str) -> subprocess.Popen[bytes]:
    """``scheduler-lib ARGS... --db URL``, once it serves the target queue (its monitor
    exists): started cold, no reader."""
    process = processes.start(args[0], *args, "--db", url)
    processes.wait_monitored(process, url, SERVED)
    with Broker(url, timers=False) as broker:
        assert [t for t in broker.activated_tasks() if t["queue_name"] == TARGET_QUEUE] == []
    return process


def _seconds(iso: str) -> float:
    """A time of `run --json` (ISO 8601, UTC) in seconds since the epoch."""
    return datetime.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _check(report: dict[str, Any]) -> None:
    assert report["ok"] is True
    times = ("start_time", "end_time")
    rows = [{**t, **{k: _seconds(t[k]) for k in times}} for t in report["tasks"]]
    assert len(rows) == sum(len(w) for w in WAVES)
    by_wave: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_wave.setdefault(row["wave"], []).append(row)
    previous_end = 0.0
    for wave in sorted(by_wave):
        tasks = by_wave[wave]
        # Each wave's tasks ran together, each on its own reader
        assert len({t["worker_id"] for t in tasks}) == len(tasks), tasks
        assert max(t["start_time"] for t in tasks) < min(t["end_time"] for t in tasks), tasks
        # And after the wave before it
        assert min(t["start_time"] for t in tasks) >= previous_end, (wave, tasks)
        previous_end = max(t["end_time"] for t in tasks)
    # The makespan against the ideal: the longest task of each wave, one wave after
    # another — the blog's lengths, or what the tasks really took where a task costs more
    # than its sleep (a Spark SQL statement's own planning and scheduling)
    took = sum(max(t["end_time"] - t["start_time"] for t in by_wave[w]) for w in by_wave)
    ideal = max(IDEAL, took)
    makespan = _seconds(report["ended_at"]) - _seconds(report["started_at"])
    assert makespan < ideal * 1.5, f"makespan {makespan:.2f} s, ideal {ideal:.3f} s"


def test_serve_runs_each_wave_in_parallel(
    db_url: str, tmp_path: Path, processes: Processes
) -> None:
    init = _cli("init", "--db", db_url)
    assert init.returncode == 0, init.stderr
    _served(processes, db_url, "serve")
    run = _cli("run", str(_plan(tmp_path / "blog.yaml", "python")), "--db", db_url, "--json")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    _check(json.loads(run.stdout))


@pytest.mark.slow
def test_spark_worker_runs_each_wave_in_parallel(
    sqlite_url: str, tmp_path: Path, processes: Processes
) -> None:
    worker = _served(processes, sqlite_url, "worker", "--master", "local[4]")
    plan = _plan(tmp_path / "blog.yaml", "spark_sql")
    run = _cli("run", str(plan), "--db", sqlite_url, "--json")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + processes.output(worker)
    _check(json.loads(run.stdout))


def test_the_plan_is_the_blogs(tmp_path: Path) -> None:
    # The ideal the makespan is held to: the longest task of each wave, one after another
    assert round(IDEAL, 3) == 2.175
    assert os.path.getsize(_plan(tmp_path / "p.yaml", "python")) > 0
