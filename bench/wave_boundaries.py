"""Where our waves makespan goes between the waves (workload 2 of ``bench.peers``, ours only).

    .venv-bench/bin/python -m bench.wave_boundaries                # ~1 min, prints a table
    .venv-bench/bin/python -m bench.wave_boundaries --write-docs   # and appends it

The waves workload exactly as ``bench.peers`` deploys it for us (5 waves x 50 no-op tasks,
``bench.peers.worker``'s process of 4 executor threads, a fresh database cloned from the
peers benchmark's template), ``--runs`` times, with ``TaskScheduler.run_waves`` and
``TaskScheduler._send`` wrapped to timestamp them (diagnostic only: ``_send`` is an internal
name, so this script may need updating when it changes). Per wave, medians over the runs:

- **send**: the wave's ``exec_async`` (its rows and messages in one transaction, durably
  committed), which starts when the caller has the wave before it complete;
- **send -> first start**: its commit returning to the first of its tasks in its handler
  (the NOTIFY, a reader's take and the task's durable start);
- **previous last end -> send**: the last task of the wave before it leaving its handler to
  this send starting (that task's answer, and the caller receiving it);
- **in the wave**: its first task's start to its last task's end.

And per run: the call of ``run_waves`` to its first send (the scheduler's conversation
begun), and the last task's end to ``run_waves`` returning (the last answer received and
the scheduler released). Times are ``time.time()`` on one machine; the handlers time
themselves as every system's do in ``bench.peers``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from bench.broker_throughput import publish
from bench.peers import systems, workloads

WAVES, SIZE = 5, 50  # as bench.peers' workload 2


def measure(runs: int) -> tuple[dict[str, list[float]], list[dict[str, list[float]]]]:
    """Milliseconds per run (head, tail) and per wave (send, lag, gap, span), each a list
    over the runs."""
    from scheduler_lib.scheduler import TaskScheduler

    calls: list[tuple[float, float]] = []
    sends: list[tuple[int, float, float]] = []
    run_waves, send = TaskScheduler.run_waves, TaskScheduler._send

    def timed_run_waves(self: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.time()
        try:
            return run_waves(self, *args, **kwargs)
        finally:
            calls.append((began, time.time()))

    def timed_send(self: Any, handle: Any, tasks: Any, wave: Any) -> Any:
        began = time.time()
        try:
            return send(self, handle, tasks, wave)
        finally:
            sends.append((len(tasks), began, time.time()))

    TaskScheduler.run_waves = timed_run_waves  # type: ignore[method-assign]
    TaskScheduler._send = timed_send  # type: ignore[method-assign]
    try:
        systems.template(workloads.deployment("ours")[0])
        out = workloads.WAVES["ours"](WAVES, SIZE, runs, {"workers": 4})
    finally:
        TaskScheduler.run_waves, TaskScheduler._send = run_waves, send  # type: ignore[method-assign]
    calls, sends = calls[1:], sends[1:]  # the warm-up run_waves: one wave of 20
    if len(calls) != runs or len(sends) != runs * WAVES or any(n != SIZE for n, _, _ in sends):
        raise RuntimeError(f"{len(calls)} runs and {len(sends)} sends seen, not {runs} of {WAVES}")
    per_run: dict[str, list[float]] = defaultdict(list)
    per_wave: list[dict[str, list[float]]] = [defaultdict(list) for _ in range(WAVES)]
    for r, (_makespan, records) in enumerate(out):
        waves: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for k, start, end in records:
            waves[k].append((start, end))
        began, returned = calls[r]
        per_run["head"].append(ms(sends[r * WAVES][1] - began))
        per_run["tail"].append(ms(returned - max(end for _, end in waves[WAVES - 1])))
        for k in range(WAVES):
            _, sent, committed = sends[r * WAVES + k]
            first = min(start for start, _ in waves[k])
            per_wave[k]["send"].append(ms(committed - sent))
            per_wave[k]["lag"].append(ms(first - committed))
            per_wave[k]["span"].append(ms(max(end for _, end in waves[k]) - first))
            if k:
                per_wave[k]["gap"].append(ms(sent - max(end for _, end in waves[k - 1])))
    return per_run, per_wave


def ms(seconds: float) -> float:
    return round(1000 * seconds, 2)


def markdown(
    per_run: dict[str, list[float]], per_wave: list[dict[str, list[float]]], runs: int
) -> str:
    med = statistics.median
    lines = [
        "",
        f"## Wave boundaries — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"Command: `python -m bench.wave_boundaries --runs {runs}` (design in its docstring). "
        f"Ours only, {WAVES} waves x {SIZE} no-op tasks as `bench.peers` runs them; ms, "
        f"medians over {runs} runs.",
        "",
        "| wave | previous last end -> send | send | send -> first start | in the wave |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for k, wave in enumerate(per_wave, start=1):
        gap = f"{med(wave['gap']):.1f}" if wave["gap"] else "-"
        lines.append(
            f"| {k} | {gap} | {med(wave['send']):.1f} | {med(wave['lag']):.1f} "
            f"| {med(wave['span']):.1f} |"
        )
    lines += [
        "",
        f"run_waves called -> first send: {med(per_run['head']):.1f} ms; "
        f"last task's end -> run_waves returned: {med(per_run['tail']):.1f} ms.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--write-docs", action="store_true", help="append to benchmarks.md")
    args = parser.parse_args()
    try:
        per_run, per_wave = measure(args.runs)
    finally:
        systems.drop_templates()  # the template database fresh_db cloned from
    publish(markdown(per_run, per_wave, args.runs), args.write_docs)


if __name__ == "__main__":
    main()
