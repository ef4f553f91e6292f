"""Recovery from a PostgreSQL restart: how soon the scheduler is back to work once the
server accepts connections again, on a warm ``scheduler-lib serve`` and on a warm
``scheduler-lib worker`` (Spark, ``local[2]``).

Run from the repository root::

    .venv/bin/python -m bench.recovery            # 5 rounds per side (~3 min)
    .venv/bin/python -m bench.recovery --quick    # 2 rounds per side

A private PostgreSQL cluster (``bench/private_postgres.py``: initdb into a temporary
directory, a free port; the shared server is never restarted) with a fresh database per
side, prepared by ``scheduler-lib init``. The side under test runs as the documented
command in its own process, with its default settings. This process is the caller: a
``TaskScheduler`` on a broker of its own runs 3 waves of 4 ``python`` tasks sleeping
0.3 s (``time:sleep``; the same tasks on both sides, so the two compare: a Spark task's
own time would only add to both).

Each round, in this order:
  - baseline: the 3 waves with no restart (seconds);
  - restart: the same 3 waves; when wave 1 has completed, the server is restarted
    (``pg_ctl restart -m fast``, so wave 2's tasks end while it is away and their answers
    must wait for it). ``back`` is when ``pg_ctl`` returned, having seen the server accept
    connections (it polls every 50 ms: ``back`` may be up to 50 ms late, which flatters
    the figures below by as much).

Measured from ``back``: the first completion the caller receives (``synchronization``
returned), and the end of the run; and what the restart cost the run: restart round -
baseline (the outage included; tasks go on running while the server is away, so it can
be less than the outage). Goal (issue 20): first completion <= 1 s after the server is
back.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.broker_throughput import (
    docs_section,
    finish_run,
    log,
    start_report,
)
from bench.private_postgres import PrivatePostgres
from bench.processes import Processes, init, wait_for
from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import Completion, Task, TaskScheduler

WAVES, TASKS, TASK_SECONDS = 3, 4, 0.3
GOAL = 1.0  # seconds from the server back to the first completion (issue 20)
SIDES = {
    "serve": ["serve"],
    "spark worker": ["worker", "--master", "local[2]"],
}


def _plan() -> list[list[Task]]:
    return [
        [Task.python("time:sleep", TASK_SECONDS, name=f"w{w}t{t}") for t in range(TASKS)]
        for w in range(WAVES)
    ]


def _round(scheduler: TaskScheduler, server: PrivatePostgres | None) -> dict[str, float]:
    """One run of the waves; with ``server``, restarted once wave 1 has completed."""
    seen: list[tuple[int, float]] = []  # (wave, wall clock the caller received it)
    first_wave_done = threading.Event()

    def on_completion(wave: int, completion: Completion) -> None:
        if not completion.ok:
            raise RuntimeError(f"a task failed: {completion.error}")
        seen.append((wave, time.time()))
        if sum(1 for w, _ in seen if w == 1) == TASKS:  # waves are numbered from 1
            first_wave_done.set()

    result: dict[str, Any] = {}

    def run() -> None:
        try:
            started = time.time()
            scheduler.run_waves(_plan(), on_completion=on_completion)
            result["took"] = time.time() - started
            result["ended"] = time.time()
        except BaseException as exc:
            result["error"] = exc

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    figures: dict[str, float] = {}
    if server is not None:
        if not first_wave_done.wait(120):
            raise RuntimeError(f"wave 1 did not complete: {result.get('error')!r}")
        time.sleep(0.1)  # wave 2 is sent and running (its tasks last 0.3 s)
        down = time.time()
        server.restart(mode="fast")
        back = time.time()
        figures["outage"] = back - down
    runner.join(300)
    if "error" in result or "took" not in result:
        raise RuntimeError(f"the run failed: {result.get('error')!r}")
    figures["took"] = result["took"]
    if server is not None:
        after = [t for _, t in seen if t >= back]
        figures["first_completion"] = min(after) - back
        figures["run_end"] = result["ended"] - back
    return figures


def measure(server: PrivatePostgres, side: str, rounds: int, workdir: Path) -> dict[str, Any]:
    name = f"recovery_{side.replace(' ', '_')}"
    url = server.create_database(name)
    init(url)
    with Processes(workdir) as processes, Broker(url, timers=False) as broker:
        # The documented command under test, in its own process
        process = processes.start(name, *SIDES[side], "--db", url)
        scheduler = TaskScheduler(broker)
        log(f"{side}: warming up")

        def warm() -> bool:
            with contextlib.suppress(Exception):
                scheduler.run_waves([[Task.python("builtins:abs", 1)]], timeout=5)
                return True
            return False

        # the side is up (a Spark worker's JVM takes a while) and warm
        wait_for(warm, 180, f"{side} to run a task", check=lambda: processes.check_alive(process))
        _round(scheduler, None)
        baselines, restarts = [], []
        for r in range(rounds):
            baselines.append(_round(scheduler, None))
            restarts.append(_round(scheduler, server))
            log(
                f"{side} round {r + 1}/{rounds}: outage {restarts[-1]['outage']:.2f} s, "
                f"first completion {restarts[-1]['first_completion']:.3f} s after, "
                f"run end {restarts[-1]['run_end']:.2f} s after"
            )
        if process.poll() is not None:
            raise RuntimeError(f"{side} died during the run")
    server.drop_database(name)
    base = statistics.median(b["took"] for b in baselines)
    cost = [x["took"] - base for x in restarts]  # the restart's cost, its outage included

    def spread(values: list[float]) -> dict[str, float]:
        return {
            "median": round(statistics.median(values), 3),
            "min": round(min(values), 3),
            "max": round(max(values), 3),
        }

    return {
        "baseline_s": spread([b["took"] for b in baselines]),
        "outage_s": spread([x["outage"] for x in restarts]),
        "first_completion_after_back_s": spread([x["first_completion"] for x in restarts]),
        "run_end_after_back_s": spread([x["run_end"] for x in restarts]),
        "restart_cost_s": spread(cost),
    }


def markdown_section(report: dict[str, Any]) -> str:
    rows: list[tuple[str, Any, str, str]] = []
    for side, r in report["sides"].items():

        def fmt(d: dict[str, float]) -> str:
            return f"{d['median']:.3f} (min {d['min']:.3f}, max {d['max']:.3f})"

        first = r["first_completion_after_back_s"]
        rows += [
            (f"{side}: outage (restart), s", fmt(r["outage_s"]), "", ""),
            (
                f"{side}: server back → first completion, s",
                fmt(first),
                f"<= {GOAL}",
                "met" if first["max"] <= GOAL else "missed",
            ),
            (f"{side}: server back → run end, s", fmt(r["run_end_after_back_s"]), "", ""),
            (
                f"{side}: run with the restart - run without, s "
                f"(without: {r['baseline_s']['median']})",
                fmt(r["restart_cost_s"]),
                "",
                "",
            ),
        ]
    return docs_section(
        "Recovery from a PostgreSQL restart",
        report,
        f"A private PostgreSQL cluster restarted (`pg_ctl restart -m fast`) while wave 2 of "
        f"{WAVES} waves x {TASKS} `python` tasks (0.3 s each) runs, on a warm "
        "`scheduler-lib serve` and a warm `scheduler-lib worker --master local[2]`, each "
        f"its documented command with default settings; {report['rounds']} rounds per side, "
        "medians (min, max). Design in `bench/recovery.py`'s docstring.",
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.recovery", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds per side")
    parser.add_argument("--rounds", type=int, help="rounds per side (default 5; quick 2)")
    parser.add_argument("--side", choices=sorted(SIDES), action="append", help="default: both")
    parser.add_argument("--no-docs", action="store_true", help="do not append to the docs")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    report, started = start_report("recovery", args.quick, rounds=rounds, sides={})
    with PrivatePostgres() as server:
        workdir = Path(server.root)
        for side in args.side or list(SIDES):
            report["sides"][side] = measure(server, side, rounds, workdir)
    return finish_run(report, started, None if args.no_docs else markdown_section)


if __name__ == "__main__":
    sys.exit(main())
