"""The blog's script through the documented commands: how close the makespan comes to the
ideal when each wave's tasks run side by side.

Run from the repository root (on a quiet machine: the bound below is tight)::

    .venv/bin/python -m bench.blog_waves            # 5 runs per setup (~2 min)
    .venv/bin/python -m bench.blog_waves --quick    # 2 runs per setup

The blog's waves (seed 002): 4, 2, 1, 2, 1 tasks of 10.1, 9.9, 9.7, 9.5 / 9.3, 9.1 / 8.9 /
8.7, 8.5 / 6.5 units, a unit 1/20 s. The ideal makespan is the longest task of each wave,
one wave after another: 2.175 s. Three setups, each the documented command in its own
process with its default settings, started cold (no reader runs before the plan):

  - ``scheduler-lib serve`` on SQLite, ``python`` tasks (``time:sleep``);
  - ``scheduler-lib serve`` on PostgreSQL (a fresh database on the local server), the same;
  - ``scheduler-lib worker --master local[4]`` on SQLite, ``spark_sql`` tasks that sleep in
    the JVM (``java_method('java.lang.Thread', 'sleep', ms)``): its ideal is what the
    statements really took, wave by wave (a Spark statement costs more than its sleep).

Each run is ``scheduler-lib run PLAN --json``; the makespan is the report's own
(``ended_at - started_at``: from the scheduler's first send to its last completion, without
the command's start-up). The first run of a setup is cold (its readers start with the first
wave); the others find the readers of the run before still waiting (warm, within their
10 s idle time). Bound (issue 21): makespan <= ideal x 1.02 + 50 ms per wave.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.broker_throughput import (
    database,
    docs_section,
    finish_run,
    log,
    start_report,
)
from bench.processes import CLI, Processes, init

UNIT = 1 / 20  # seconds per unit of the blog's WAITFOR DELAY lengths
WAVES = [[10.1, 9.9, 9.7, 9.5], [9.3, 9.1], [8.9], [8.7, 8.5], [6.5]]
IDEAL = sum(max(wave) for wave in WAVES) * UNIT
PER_WAVE = 0.050  # seconds of scheduling a wave may add (issue 21)
SERVED = 180.0  # seconds for the command under test to monitor its queue (a JVM's start)


def bound(ideal: float) -> float:
    return ideal * 1.02 + PER_WAVE * len(WAVES)


def plan(path: Path, kind: str) -> Path:
    lines = ["waves:"]
    for w, wave in enumerate(WAVES, start=1):
        for t, units in enumerate(wave, start=1):
            seconds = round(units * UNIT, 3)
            if kind == "python":
                body = (
                    f'{{kind: python, callable: "time:sleep", args: [{seconds}], name: w{w}t{t}}}'
                )
            else:
                body = (
                    f"{{kind: spark_sql, sql: \"SELECT java_method('java.lang.Thread', 'sleep', "
                    f'CAST({int(seconds * 1000)} AS BIGINT))", name: w{w}t{t}}}'
                )
            lines.append(("  - - " if t == 1 else "    - ") + body)
    path.write_text("\n".join(lines) + "\n")
    return path


def one_run(url: str, plan_file: Path, kind: str) -> dict[str, float]:
    result = subprocess.run(
        [CLI, "run", str(plan_file), "--db", url, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode:
        raise RuntimeError(result.stderr[-2000:])
    report = json.loads(result.stdout)
    by_wave: dict[int, list[dict[str, Any]]] = {}
    for row in report["tasks"]:
        by_wave.setdefault(row["wave"], []).append(row)
    took = sum(
        max(seconds(t["end_time"]) - seconds(t["start_time"]) for t in rows)
        for rows in by_wave.values()
    )
    ideal = IDEAL if kind == "python" else max(IDEAL, took)
    parallel = all(len({t["worker_id"] for t in rows}) == len(rows) for rows in by_wave.values())
    return {
        "makespan": seconds(report["ended_at"]) - seconds(report["started_at"]),
        "ideal": ideal,
        "parallel": float(parallel),
    }


def seconds(when: str) -> float:
    """Seconds since the epoch of a time of ``run --json`` (ISO 8601 UTC, ``...Z``)."""
    return dt.datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()


def setup(name: str, command: list[str], url: str, kind: str, runs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        init(url)
        plan_file = plan(workdir / "blog.yaml", kind)
        with Processes(workdir) as processes:
            # The command under test, cold, until its queue monitor exists
            served = processes.start(command[0], *command, "--db", url)
            processes.wait_monitored(served, url, SERVED)
            results = []
            for r in range(runs):
                results.append(one_run(url, plan_file, kind))
                x = results[-1]
                log(
                    f"{name} run {r + 1}/{runs} ({'cold' if r == 0 else 'warm'}): makespan "
                    f"{x['makespan']:.3f} s, ideal {x['ideal']:.3f} s, "
                    f"bound {bound(x['ideal']):.3f} s"
                )
    warm = results[1:] or results
    return {
        "cold": results[0],
        "warm_makespan_median": round(statistics.median(x["makespan"] for x in warm), 3),
        "warm_makespan_max": round(max(x["makespan"] for x in warm), 3),
        "ideal": round(statistics.median(x["ideal"] for x in warm), 3),
        "every_wave_parallel": all(x["parallel"] for x in results),
        "runs": len(results),
    }


def markdown_section(report: dict[str, Any]) -> str:
    rows: list[tuple[str, Any, str, str]] = []
    for name, r in report["setups"].items():
        limit = bound(r["ideal"])
        cold = r["cold"]
        rows.append(
            (
                f"{name}: cold run, makespan s (ideal {cold['ideal']:.3f})",
                f"{cold['makespan']:.3f}",
                f"<= {bound(cold['ideal']):.3f}",
                "met" if cold["makespan"] <= bound(cold["ideal"]) else "missed",
            )
        )
        rows.append(
            (
                f"{name}: warm runs, makespan s, median (max) (ideal {r['ideal']:.3f})",
                f"{r['warm_makespan_median']:.3f} ({r['warm_makespan_max']:.3f})",
                f"<= {limit:.3f}",
                "met" if r["warm_makespan_max"] <= limit else "missed",
            )
        )
        rows.append(
            (f"{name}: each wave's tasks on distinct readers", r["every_wave_parallel"], "", "")
        )
    return docs_section(
        "The blog's waves through the documented commands",
        report,
        "The blog's script (waves of 4, 2, 1, 2, 1 tasks of 10.1 ... 6.5 units, a unit "
        f"1/20 s; ideal {IDEAL:.3f} s) through `scheduler-lib run --json`, served by "
        "`scheduler-lib serve` (SQLite, PostgreSQL; `python` sleeps) and `scheduler-lib "
        "worker --master local[4]` (SQLite; Spark SQL sleeps in the JVM, ideal = what the "
        "statements took), each started cold with its defaults; the first run cold, the "
        f"others warm ({report['runs']} runs a setup). Bound: ideal x 1.02 + 50 ms per wave. "
        "Design in `bench/blog_waves.py`'s docstring.",
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.blog_waves", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="2 runs per setup")
    parser.add_argument("--runs", type=int, help="runs per setup (default 5; quick 2)")
    parser.add_argument("--no-spark", action="store_true", help="leave out the Spark worker")
    parser.add_argument("--no-docs", action="store_true", help="do not append to the docs")
    args = parser.parse_args(argv)
    runs = args.runs or (2 if args.quick else 5)
    report, started = start_report("blog_waves", args.quick, runs=runs, setups={})
    with tempfile.TemporaryDirectory() as tmp:
        sqlite = f"sqlite:///{tmp}/serve.db"
        report["setups"]["serve, SQLite"] = setup(
            "serve, SQLite", ["serve"], sqlite, "python", runs
        )
        with database("blog_waves") as url:
            report["setups"]["serve, PostgreSQL"] = setup(
                "serve, PostgreSQL", ["serve"], url, "python", runs
            )
        if not args.no_spark:
            spark = f"sqlite:///{tmp}/spark.db"
            report["setups"]["Spark worker, SQLite"] = setup(
                "Spark worker, SQLite",
                ["worker", "--master", "local[4]"],
                spark,
                "spark_sql",
                runs,
            )
    return finish_run(report, started, None if args.no_docs else markdown_section)


if __name__ == "__main__":
    sys.exit(main())
