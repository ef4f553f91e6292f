"""The task scheduler's full loop on PostgreSQL: exec_async -> executor -> AsyncDone ->
synchronization, with trivial tasks and 4 readers.

Run from the repository root::

    .venv/bin/python -m bench.scheduler_loop            # full run (~1 min)
    .venv/bin/python -m bench.scheduler_loop --quick    # ~20 s smoke run

A fresh PostgreSQL database (created, afterwards dropped) with the scheduler's catalog
(``init``). A spawned child process — the worker side, as ``scheduler-lib serve`` would be
— runs 4 executor threads (``Executor.serve``, the target queue's activation procedure)
on one broker. This process is the caller, on a broker of its own. Tasks are
``python`` tasks calling ``builtins:abs(1)``: the loop is all there is to measure.

Measured, in this order:
  - waves: the mission's peer comparison — 5 waves of 50 no-op tasks, each wave sent in
    one transaction (``run_waves``), the next wave after the previous completed; seconds
    for the 5 waves (repeated, median reported);
  - burst: one wave of N tasks (2000; quick 500): tasks/s from the first send to the
    last completion;
  - dispatch: single tasks one after another: exec_async called -> the executor's start
    (``execution_log.start_time``, the same machine's clock) p50/p99, and the full
    round trip exec_async called -> synchronization returned.

Targets (issue 6): dispatch p50 <= 10 ms. Peers on this kind of machine (from the
mission statement, not measured here): five waves of 50 no-op tasks take Celery 0.40 s,
procrastinate 0.45 s, plain Airflow 6-10 s.
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing
import os
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.broker_throughput import (
    BUSY_WARNING_PCT,
    busy_pct,
    database,
    docs_section,
    finish_run,
    log,
    machine_facts,
    percentile,
)
from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import Executor, Target, Task, TaskScheduler, init

READERS = 4
NO_OP = Task.python("builtins:abs", 1, name="no-op")


def serve(url: str, readers: int, ready: Any, stop: Any) -> None:
    """The worker process: ``readers`` executor threads until ``stop`` is set."""
    with Broker(url, migrate=False, timers=True) as broker:
        halt = threading.Event()
        threads = [
            threading.Thread(
                target=Executor(broker, "QueueAsyncTarget", idle_timeout=3600).serve,
                args=(halt,),
                name=f"reader-{i}",
                daemon=True,
            )
            for i in range(readers)
        ]
        for thread in threads:
            thread.start()
        ready.set()
        stop.wait()
        halt.set()
        for thread in threads:
            thread.join(10)


def measure(url: str, quick: bool) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    worker = ctx.Process(target=serve, args=(url, READERS, ready, stop))
    worker.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the worker process did not start")
        with Broker(url) as broker:
            scheduler = TaskScheduler(broker)
            # Warm-up: connections, imports, the executors' first receive
            scheduler.run_waves([[NO_OP] * 20] * 2)

            repeats = 3 if quick else 10
            waves = []
            for _ in range(repeats):
                started = time.monotonic()
                report = scheduler.run_waves([[NO_OP] * 50] * 5)
                waves.append(time.monotonic() - started)
                assert report.ok
            log(f"5 waves of 50: median {statistics.median(waves):.3f} s")

            burst_n = 500 if quick else 2000
            started = time.monotonic()
            report = scheduler.run_waves([[NO_OP] * burst_n])
            burst_s = time.monotonic() - started
            assert report.ok
            log(f"burst of {burst_n}: {burst_n / burst_s:.0f} tasks/s")

            samples = 60 if quick else 300
            dispatch, round_trip = [], []
            with scheduler.scheduler() as handle:
                for _ in range(samples):
                    called = time.time()
                    log_id = scheduler.exec_async(handle, NO_OP)
                    done = scheduler.synchronization(handle, timeout=30)
                    returned = time.time()
                    assert done.ok
                    with broker.transaction() as tx:
                        row = tx.fetch_one("log_get", log_id=log_id)
                    assert row is not None
                    dispatch.append(1000 * (row["start_time"] - called))
                    round_trip.append(1000 * (returned - called))
            log(
                f"dispatch p50 {statistics.median(dispatch):.2f} ms, "
                f"round trip p50 {statistics.median(round_trip):.2f} ms"
            )
    finally:
        stop.set()
        worker.join(30)
        if worker.is_alive():
            worker.kill()

    def ms(values: list[float]) -> dict[str, float]:
        return {
            "p50_ms": round(percentile(values, 50), 2),
            "p90_ms": round(percentile(values, 90), 2),
            "p99_ms": round(percentile(values, 99), 2),
            "max_ms": round(max(values), 2),
        }

    return {
        "five_waves_of_50_s": {
            "median": round(statistics.median(waves), 3),
            "min": round(min(waves), 3),
            "max": round(max(waves), 3),
            "runs": [round(w, 3) for w in waves],
        },
        "burst": {
            "tasks": burst_n,
            "seconds": round(burst_s, 3),
            "tasks_per_s": round(burst_n / burst_s),
        },
        "dispatch": {"samples": samples, **ms(dispatch)},
        "round_trip": {"samples": samples, **ms(round_trip)},
    }


def markdown_section(report: dict[str, Any]) -> str:
    r = report["postgresql"]
    waves, dispatch, trip = r["five_waves_of_50_s"], r["dispatch"], r["round_trip"]
    rows: list[tuple[str, Any, str, str]] = [
        (
            "5 waves of 50 no-op tasks, s (median of runs)",
            f"{waves['median']} (min {waves['min']}, max {waves['max']})",
            "Celery 0.40, procrastinate 0.45, Airflow 6-10 (mission statement, not run here)",
            "beats all" if waves["median"] < 0.40 else "slower than Celery/procrastinate",
        ),
        ("burst of no-op tasks, tasks/s", r["burst"]["tasks_per_s"], "", ""),
        (
            "dispatch exec_async -> task start, p50 ms",
            dispatch["p50_ms"],
            "<= 10",
            "met" if dispatch["p50_ms"] <= 10 else "**missed**",
        ),
        (
            "dispatch p90 / p99 / max ms",
            f"{dispatch['p90_ms']} / {dispatch['p99_ms']} / {dispatch['max_ms']}",
            "",
            "",
        ),
        (
            "round trip exec_async -> synchronization returned, p50 / p99 ms",
            f"{trip['p50_ms']} / {trip['p99_ms']}",
            "",
            "",
        ),
    ]
    return docs_section(
        "scheduler_loop",
        report,
        f"PostgreSQL; {READERS} executor threads in a spawned worker process, the caller in "
        "this one; no-op `python` tasks (`builtins:abs(1)`) through exec_async -> executor "
        "-> AsyncDone -> synchronization. Design in `bench/scheduler_loop.py`'s docstring.",
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scheduler_loop", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="~20 s smoke run")
    parser.add_argument("--no-docs", action="store_true", help="do not append to the docs")
    args = parser.parse_args(argv)
    idle_check = busy_pct(1.0)
    if idle_check > BUSY_WARNING_PCT:
        log(f"warning: the machine is {idle_check}% busy before the start; figures will be noisy")
    started = time.monotonic()
    report: dict[str, Any] = {
        "benchmark": "scheduler_loop",
        "started_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(
            [Path(sys.executable).name, "-m", "bench.scheduler_loop", *sys.argv[1:]]
        ),
        "quick": args.quick,
        "machine": machine_facts(),
        "config": {"readers": READERS, "task": NO_OP.to_dict()},
    }
    report["machine"]["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    report["machine"]["cpu_busy_pct_before_start"] = idle_check
    with database("scheduler") as url:
        with Broker(url) as broker:
            init(broker, targets=[Target(activation=False)])
        report["postgresql"] = measure(url, args.quick)
    return finish_run(report, started, None if args.no_docs else markdown_section)


if __name__ == "__main__":
    sys.exit(main())
