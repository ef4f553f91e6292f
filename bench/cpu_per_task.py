"""CPU spent per task in the waves workload of ``bench.peers``, split by process kind.

    .venv-bench/bin/python -m bench.cpu_per_task                 # ~3 min, prints a table
    .venv-bench/bin/python -m bench.cpu_per_task --write-docs    # and appends it

Each system runs ``bench.peers``' waves workload exactly as that benchmark deploys it
(``bench.peers.workloads.WAVES``: 5 waves x 50 no-op tasks, 4-way concurrency, worker
processes of its own), once with 1 run of the 5 waves and once with ``1 + --runs``; the
difference of the two, divided by the tasks the extra runs made, is the CPU per task with
every start-up cost (imports, connecting, warm-up, the first run) taken out. Three
figures per task:

- **workers**: the worker processes' CPU (this process's reaped children, from
  ``os.times()``: their own children too, e.g. Celery's pool);
- **caller**: this process's CPU (the caller's sends and completion waits; the harness's
  one check query per run is in it too, the same for every system);
- **PostgreSQL**: every process of the PostgreSQL server (``/proc``), background
  processes included (the WAL writer, the checkpointer): the machine must be quiet.

On a machine whose cores are all busy during a run, the total CPU per task bounds the
throughput: what it says is where a system spends what it spends, not which waits it has.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import statistics
import sys
import time
from datetime import UTC, datetime

from bench.broker_throughput import append_docs, log
from bench.peers import systems, workloads

WAVES, SIZE = 5, 50  # as bench.peers' workload 2
SYSTEMS = ["ours", "procrastinate", "procrastinate_4p", "pgqueuer"]
TICK = os.sysconf("SC_CLK_TCK")


def postgres_cpu() -> float:
    """Seconds of CPU of the PostgreSQL server: every live process named ``postgres``, and
    the ones that ended (a backend whose connection closed), which the postmaster reaped
    into its children's times (``cutime``, ``cstime``)."""
    total = 0.0
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError):
            text = open(stat).read()  # noqa: SIM115 - /proc files are read at once
            name, rest = text[text.index("(") + 1 : text.rindex(")")], text.rsplit(")", 1)[1]
            if name == "postgres":
                fields = rest.split()
                total += sum(int(f) for f in fields[11:15]) / TICK
    return total


def cpu_now() -> dict[str, float]:
    times = os.times()
    return {
        "workers": times.children_user + times.children_system,
        "caller": time.process_time(),
        "postgresql": postgres_cpu(),
        "wall": time.monotonic(),
    }


def measure(system: str, runs: int) -> dict[str, float]:
    """CPU seconds (and wall seconds) of the waves workload of ``system`` with ``runs``
    runs, its workers' start and stop included."""
    systems.template(workloads.deployment(system)[0])  # made once, before any measurement
    before = cpu_now()
    workloads.WAVES[system](WAVES, SIZE, runs, {"workers": 4})
    after = cpu_now()
    return {k: after[k] - before[k] for k in before}


def per_task(system: str, runs: int) -> dict[str, float]:
    """Milliseconds per task of the ``runs`` extra runs (the difference of two
    measurements, so that start-up costs cancel)."""
    short = measure(system, 1)
    long = measure(system, 1 + runs)
    tasks = runs * WAVES * SIZE
    out = {k: 1000 * (long[k] - short[k]) / tasks for k in short}
    out["total"] = out["workers"] + out["caller"] + out["postgresql"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cpu_per_task", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--runs", type=int, default=8, help="extra runs of the 5 waves")
    parser.add_argument("--rounds", type=int, default=2, help="rounds the systems take turns in")
    parser.add_argument("--write-docs", action="store_true", help="append to benchmarks.md")
    args = parser.parse_args(argv)
    names = [s for s in args.systems.split(",") if s]
    unknown = [s for s in names if s not in workloads.WAVES or s.startswith("celery")]
    if unknown:
        print(f"unknown systems {unknown}: choose from {SYSTEMS}", file=sys.stderr)
        return 2
    started = time.monotonic()
    results: dict[str, list[dict[str, float]]] = {s: [] for s in names}
    try:
        for r in range(args.rounds):
            for system in names[r % len(names) :] + names[: r % len(names)]:
                results[system].append(per_task(system, args.runs))
                log(f"round {r + 1}: {system}: {results[system][-1]}")
    finally:
        systems.drop_templates()
    rows = [
        "| system | workers | caller | PostgreSQL | total | wall per task |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for system in names:
        med = {k: statistics.median(x[k] for x in results[system]) for k in results[system][0]}
        rows.append(
            f"| {system} | {med['workers']:.2f} | {med['caller']:.2f} | "
            f"{med['postgresql']:.2f} | {med['total']:.2f} | {med['wall']:.2f} |"
        )
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    systems_arg = "" if names == SYSTEMS else f" --systems {','.join(names)}"
    section = (
        f"\n## cpu_per_task — {stamp}\n\n"
        f"Command: `python -m bench.cpu_per_task{systems_arg} --runs {args.runs} "
        f"--rounds {args.rounds}` "
        f"(took {time.monotonic() - started:.0f} s; design in `bench/cpu_per_task.py`'s "
        f"docstring). Machine: {os.cpu_count()} cores; git "
        f"{os.popen('git rev-parse --short=10 HEAD').read().strip()}.\n\n"
        "The waves workload of the peers benchmark (5 x 50 no-op tasks, 4-way concurrency), "
        "CPU milliseconds per task, median of the rounds; each figure from the difference "
        f"of a run of 1 and of {1 + args.runs} repetitions, so start-up costs cancel.\n\n"
        + "\n".join(rows)
        + "\n"
    )
    print(section)
    if args.write_docs:
        append_docs(section)
        log("appended to docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
