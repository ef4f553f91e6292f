"""Side-by-side benchmark of scheduler_lib and the systems users would pick instead.

    make bench                                    # the whole suite (< 15 min), docs updated
    .venv-bench/bin/python -m bench.peers         # the same, once .venv-bench exists
    .venv-bench/bin/python -m bench.peers --quick # ~2 min smoke run, writes nothing
    .venv-bench/bin/python -m bench.peers --only waves,dispatch --systems ours,celery

Workloads (design in bench/peers/workloads.py; settings in SETTINGS below):
  1. queue: enqueue -> dequeue -> complete, trivial handler, 100-byte payloads, batch 1
     and batch 100 (enqueue batch and dequeue batch), 4 consumers: ours (broker level),
     procrastinate, pgqueuer, raw INSERT + DELETE ... SKIP LOCKED;
  2. waves: 5 waves x 50 no-op tasks, 4 workers: ours (run_waves), Celery group + get,
     pgqueuer (CompletionWatcher), procrastinate (polling job status);
  3. dispatch: idle workers, one task at a time, enqueue call -> handler start, beside
     two floors with no system's code (raw PostgreSQL, raw Redis);
  4. scale: dequeue + complete of one ready item with 1,000,000 completed items retained
     vs none.
Systems take turns in every round (the order rotates), measurements are repeated, and
every figure comes from a run whose counts were checked. Writes
bench/results/<UTC timestamp>.json and the block between the peers markers at the top of
docs/benchmarks.md, with a chart per workload in docs/img/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from bench.broker_throughput import (
    ADMIN_URL,
    BUSY_WARNING_PCT,
    FOREIGN_WARNING_PCT,
    busy_pct,
    log,
    machine_busy,
    machine_facts,
    percentile,
    process_cpu,
)
from bench.peers import report as docs
from bench.peers import systems, workloads

REPO = Path(__file__).resolve().parent.parent.parent
RESULTS = REPO / "bench" / "results"
DOCS = REPO / "docs" / "benchmarks.md"
IMG = REPO / "docs" / "img"
# Workloads 2 and 3 (tasks run by workers): every deployment of every task system.
TASK_SYSTEMS = [
    "ours",
    "ours_lazy",  # Target(durable_start=False): for tasks whose effects are idempotent
    "celery",
    "celery_p4",
    "pgqueuer",
    "pgqueuer_4p",
    "procrastinate",
    "procrastinate_4p",
]
ALL_SYSTEMS = {
    "queue": [
        "ours",
        "procrastinate",
        "procrastinate_4p",
        "pgqueuer",
        "pgqueuer_4p",
        "celery",
        "celery_p4",
        "raw",
    ],
    "waves": TASK_SYSTEMS,
    # with the floors: the least a dispatch does on PostgreSQL and on Redis, no system
    "dispatch": [*TASK_SYSTEMS, "raw", "raw_redis"],
    "scale": ["ours", "procrastinate", "pgqueuer", "celery"],
}
PACKAGES = (
    "scheduler_lib",
    "sqlalchemy",
    "psycopg",
    "psycopg-binary",  # its C libpq wrapper, used by ours and procrastinate
    "procrastinate",
    "psycopg-pool",
    "pgqueuer",
    "asyncpg",
    "celery",
    "kombu",
    "billiard",
    "redis",
    "hiredis",  # redis-py's C reply parser, used by Celery's client
    "matplotlib",
)
# Workload 1's shapes and their keys' prefix: enqueue while the consumers run, and
# enqueue first, then drain (issue 24: a producer bounds the concurrent shape at batch 1).
QUEUE_SHAPES = {"concurrent": "", "drain": "drain_"}
SIZES = {  # (full, quick)
    "rounds": (3, 1),
    # Workload 1 runs 2 rounds of N=1000 at batch 1: it was 16 of the suite's 23 minutes
    # at 3 rounds of N=2000 (2026-11-27 05:32), the slowest deployments at 57-75 msg/s.
    "queue_rounds": (2, 1),
    "queue_batch_1": (1000, 300),
    "queue_batch_100": (5000, 2000),
    "wave_repeats_per_round": (2, 1),
    "dispatch_samples_per_round": (67, 30),
    "retained": (1_000_000, 50_000),
    "scale_samples": (500, 100),
}


def settings_text(cfg: dict[str, Any]) -> str:
    return (
        f"Settings: {cfg['workers']}-way concurrency for every system in its natural "
        "deployment, worker sides in their own processes started and stopped by the "
        "harness, each system in its own fresh PostgreSQL database (cloned from a template "
        "with its schema) or, for Celery, an empty Redis database; each client with its C "
        "speed-ups (psycopg's binary libpq wrapper for ours and procrastinate, hiredis for "
        "Celery's redis client). "
        f"**Ours**: `ours_worker` in `bench/peers/worker.py` — one process with "
        f"{cfg['workers']} threads, each `Executor(broker, 'QueueAsyncTarget', "
        "idle_timeout=3600).serve` (workloads 2-4; its default prefetch of 4 while the "
        "tasks run short, as Celery's default prefetch multiplier is 4) or a consumer "
        "looping over "
        "`with broker.transaction() as tx: tx.receive(queue, top=batch)` (workload 1, the "
        f"producer `broker.send` / `send_many` round robin over {systems.CONVERSATIONS} "
        "conversations); in workloads 2 and 3 also with the target's `durable_start=False` "
        "(`ours_lazy`: for tasks whose effects are idempotent, a task runs without waiting "
        "for its start's WAL flush, and since 2026-12-01 its end commits without waiting "
        "for the flush too; with `retries=1`, as that target should be deployed; "
        'docs/scheduler.md, "Durable or lazy start"). '
        "**procrastinate**: one worker, `concurrency="
        f"{cfg['workers']}`, async no-op task, LISTEN/NOTIFY on, jobs kept (its default), "
        "psycopg pool of up to 10; it dequeues one job per fetch (no batch dequeue), so batch "
        f"100 batches only the enqueue (`batch_defer_async`); callers poll job status every "
        f"{int(systems.POLL * 1000)} ms (procrastinate has no completion wait); also as 4 "
        "worker processes of `concurrency=1` (`procrastinate_4p`). "
        "**pgqueuer**: one `QueueManager` on asyncpg, `batch_size` = the batch, entrypoint "
        f"`concurrency_limit` = {cfg['workers']} x batch; callers wait through "
        f"`CompletionWatcher` (debounce {int(systems.PGQ_DEBOUNCE.total_seconds() * 1000)} "
        "ms instead of its 50 ms default); also as 4 worker processes of a quarter of the "
        "concurrency each (`pgqueuer_4p`). The verdicts compare ours with the best of "
        "every peer deployment. **Celery**: prefork `--concurrency "
        f"{cfg['workers']}`, Redis broker and result backend, acks early (its default), "
        "prefetch multiplier 1 and, as a system of its own (`celery_p4`), 4 (its default, "
        "recommended for short tasks), gossip/mingle/heartbeat off; a wave "
        "is `group(...).apply_async().get()`, a batch-100 enqueue a `group` of 100 (Celery "
        "has no batched enqueue or dequeue). **raw**: 4 consumer threads on their own "
        "autocommit connections, `DELETE … WHERE id IN (SELECT … ORDER BY id LIMIT batch "
        "FOR UPDATE SKIP LOCKED) RETURNING body`, waiting for the NOTIFY of the next insert "
        "(a statement trigger) when empty. "
        f"{cfg['rounds']} round(s) ({cfg['queue_rounds']} for workload 1); in each the "
        "systems' order rotates."
    )


DESIGNS = {
    "queue": (
        "One producer (this process) enqueues N 100-byte messages (batch 1: N={b1}, one "
        "enqueue call each; batch 100: N={b100}, 100 per call, but N={b1} for "
        "procrastinate and Celery, which take one job per fetch whatever the batch, so "
        "their runs last as long as at batch 1 and the suite stays within its time) while "
        "the system's 4 "
        "consumers dequeue `batch` at a time and complete them (commit). Figure: N / (last "
        "completion - first enqueue), from the consumers' post-commit timestamps (ours, "
        "raw), Celery's handlers' end (before it stores the result), or the database's "
        "completion rows (procrastinate's `succeeded` events, "
        "pgqueuer's `successful` log). Drain shape: the N messages are enqueued first with "
        "no consumer, then the 4 consumers start and drain them; figure: the messages after "
        "the first completion / (last completion - first completion), from the handlers' "
        "timestamps (no system's start-up counted, no producer bounding it). Checked: every "
        "message handled exactly once."
    ),
    "waves": (
        "{rep} run(s) per round after a warm-up. Makespan: the caller's wall time for the 5 "
        "waves. Sync overhead: last task end of wave k → first task start of wave k+1 "
        "(timestamps taken inside the handlers, ours too), mean over the 4 boundaries — "
        "the time to see a wave complete and get the next one running. Checked: 250 tasks "
        "each ran exactly once, no task of wave k+1 started before the last of wave k "
        "ended."
    ),
    "dispatch": (
        "{samples} samples per system (after 10 warm-up tasks per round), a random 20-40 ms "
        "pause before each so the workers are idle in their wait; latency = handler start "
        "(`time.time()` inside the handler, ours too: after the start's durable commit, or "
        "after its commit without the flush with lazy start) - "
        "the instant before the enqueue call, same machine clock. Each task is waited for "
        "(the system's own way) before the next. Two floors, no system's code, the least a "
        "dispatch does on each server: **raw PostgreSQL**, one autocommit INSERT (its "
        "durable commit fires the table's NOTIFY trigger), one consumer's LISTEN woken, "
        "its `DELETE … SKIP LOCKED` committed durably, timed at the DELETE's return; **raw "
        "Redis**, an LPUSH to one consumer blocked in BRPOP, timed at the BRPOP's return. "
        "One consumer each (four LISTENing connections would all be woken by each NOTIFY); "
        "their callers look whether the task was taken 10 ms after the enqueue, then "
        "every 20 ms. The floors are no peers: the verdicts ignore them."
    ),
    "scale": (
        "Two stores per system set up alike; one preloaded with {retained:,} completed items "
        "in the system's real completed form with set-based SQL (ours: `execution_log` rows "
        "SUCCEEDED — finished conversations leave nothing else; procrastinate: `succeeded` "
        "jobs + 3 events each; pgqueuer: 3 log rows each, aggregated, + statistics; Celery: "
        "result keys with a 1-day expiry), then VACUUM ANALYZE and CHECKPOINT. Timed: the "
        "worker's dequeue + complete of one ready item (ours: `Executor.run_one` — take, "
        "start, run `abs(1)`, answer; procrastinate: `fetch_job` + `finish_job`; pgqueuer: "
        "`dequeue(batch_size=1)` + `log_jobs`; Celery: kombu `basic_get` + ack + "
        "`store_result`), {samples} each way alternating pair by pair, in this process. The "
        "raw ceiling keeps nothing (it deletes), so it has no row here."
    ),
}


class Accounting:
    """Machine CPU over a measurement: busy %, and the share of foreign work (not this
    run's processes, the bench databases' backends, PostgreSQL's or Redis's own)."""

    def __enter__(self) -> Accounting:
        self.busy0 = machine_busy()
        self.procs0 = process_cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        busy1 = machine_busy()
        procs1 = process_cpu()
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            bench = {
                r[0]
                for r in conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname LIKE 'bench_peers_%'"
                )
            }
        ours = os.getpgid(0)
        foreign = 0.0
        for pid, (cpu, ppid, pgrp, kind) in procs1.items():
            used = cpu - self.procs0[pid][0] if pid in self.procs0 else cpu
            if pgrp == ours or pid in bench or kind == "postgres-server" or ppid == 2:
                continue
            if kind == "postgres-backend" and pid not in self.procs0:
                continue  # a bench backend that ended before the snapshot
            try:
                with open(f"/proc/{pid}/comm") as fh:
                    if fh.read().strip() == "redis-server":
                        continue
            except OSError:
                pass
            foreign += used
        total = max(1e-9, busy1[1] - self.busy0[1])
        self.busy = round(100 * (busy1[0] - self.busy0[0]) / total, 1)
        self.foreign = round(100 * foreign / total, 1)


def summary(values: list[float], digits: int = 3) -> dict[str, Any]:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "runs": [round(v, digits) for v in values],
    }


def rotated(items: list[Any], r: int) -> list[Any]:
    k = r % len(items)
    return items[k:] + items[:k]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="~2 min smoke run, writes nothing")
    parser.add_argument("--only", help="workloads, comma-separated: queue,waves,dispatch,scale")
    parser.add_argument("--systems", help="systems, comma-separated (default: all)")
    parser.add_argument(
        "--rounds", type=int, help="rounds of every workload (default 3, queue 2; quick 1)"
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--retained", type=int, help="workload 4's completed items")
    parser.add_argument("--write-docs", action="store_true", help="write JSON and docs anyway")
    parser.add_argument("--no-docs", action="store_true", help="write the JSON only")
    parser.add_argument(
        "--docs-from",
        metavar="JSON",
        help="measure nothing: regenerate the docs block and charts from a stored run "
        "(a file under bench/results/)",
    )
    args = parser.parse_args(argv)
    if args.docs_from:
        stored = json.loads(Path(args.docs_from).read_text())
        docs.charts(stored, IMG)
        DOCS.write_text(docs.replace_block(DOCS.read_text(), docs.section(stored)))
        log(
            f"wrote docs/benchmarks.md (peers block) and docs/img/peers-*.png from {args.docs_from}"
        )
        return 0
    q = 1 if args.quick else 0
    size = {k: v[q] for k, v in SIZES.items()}
    if args.rounds:
        size["rounds"] = size["queue_rounds"] = args.rounds
    if args.retained:
        size["retained"] = args.retained
    only = args.only.split(",") if args.only else list(ALL_SYSTEMS)
    chosen = set(args.systems.split(",")) if args.systems else None
    for w in only:
        if w not in ALL_SYSTEMS:
            parser.error(f"unknown workload {w!r}")
    plan = {w: [s for s in ALL_SYSTEMS[w] if chosen is None or s in chosen] for w in only}
    complete = not args.only and not args.systems and not args.quick
    cfg = {"workers": args.workers, **size}

    before = busy_pct(1.0)
    if before > BUSY_WARNING_PCT:
        log(f"warning: the machine is {before}% busy before the start; figures will be noisy")
    started = time.monotonic()
    stamp = dt.datetime.now(dt.UTC)
    report: dict[str, Any] = {
        "benchmark": "peers",
        "started_at": stamp.strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python", "-m", "bench.peers", *sys.argv[1:]]),
        "quick": args.quick,
        "machine": machine_facts(),
        "config": cfg,
        "settings_text": settings_text(cfg),
        "workloads": {},
        "warnings": [],
    }
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = None
    report["machine"]["packages"] = packages
    report["machine"]["cpu_busy_pct_before_start"] = before
    report["machine"]["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    if before > BUSY_WARNING_PCT:
        report["warnings"].append(
            f"the machine was {before}% busy before the start (other work); figures are noisy."
        )
    noisy: list[str] = []

    def measured(label: str, fn: Any, *a: Any) -> Any:
        with Accounting() as acc:
            value = fn(*a)
        report.setdefault("cpu", {})[label] = {"busy_pct": acc.busy, "foreign_pct": acc.foreign}
        if acc.foreign > FOREIGN_WARNING_PCT:
            noisy.append(f"{label} ({acc.foreign}%)")
        return value

    uses_redis = any(s.startswith("celery") or s == "raw_redis" for v in plan.values() for s in v)
    redis = systems.Redis() if uses_redis else None
    ctx: dict[str, Any] = {"workers": args.workers, "celery_prefetch": 1}
    try:
        if redis is not None:
            report["machine"]["redis"] = redis.version
            redis_db = redis.database()
            ctx["redis_url"] = redis_db.__enter__()
            ctx["redis"] = redis
            ctx["redis_flush"] = lambda: redis.flush(ctx["redis_url"])
            ctx["celery"] = systems.celery_module(ctx["redis_url"], 1)
        on_redis = {"celery", "celery_p4", "raw_redis"}
        for system in sorted({s for v in plan.values() for s in v} - on_redis):
            systems.template(workloads.deployment(system)[0])
        if "queue" in plan:
            run_queue(plan["queue"], size, cfg, ctx, report, measured)
        if "waves" in plan:
            run_waves(plan["waves"], size, ctx, report, measured)
        if "dispatch" in plan:
            run_dispatch(plan["dispatch"], size, ctx, report, measured)
        if "scale" in plan:
            run_scale(plan["scale"], size, ctx, report, measured)
    finally:
        systems.drop_templates()
        if redis is not None:
            if "redis_url" in ctx:
                redis_db.__exit__(None, None, None)
            redis.close()
    if noisy:
        report["warnings"].append(
            f"foreign work took more than {FOREIGN_WARNING_PCT}% of the machine's CPU during "
            f"{len(noisy)} measurement(s): {', '.join(noisy[:6])}; those figures are noisy."
        )
    report["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    report["results_file"] = stamp.strftime("%Y%m%dT%H%M%SZ") + ".json"
    text = json.dumps(report, indent=2)
    if (complete or args.write_docs) and not (args.quick and not args.write_docs):
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / report["results_file"]).write_text(text + "\n")
        log(f"wrote bench/results/{report['results_file']}")
        if not args.no_docs:
            docs.charts(report, IMG)
            DOCS.write_text(docs.replace_block(DOCS.read_text(), docs.section(report)))
            log("wrote docs/benchmarks.md (peers block) and docs/img/peers-*.png")
    print(text)
    log(f"done in {report['elapsed_s']} s")
    return 0


def run_queue(
    names: list[str],
    size: dict[str, Any],
    cfg: dict[str, Any],
    ctx: dict[str, Any],
    report: dict[str, Any],
    measured: Any,
) -> None:
    n = {1: size["queue_batch_1"], 100: size["queue_batch_100"]}

    def messages(system: str, batch: int) -> int:
        # A system that takes one job per fetch runs batch 100 at its batch-1 pace:
        # N=5000 would only lengthen its runs (procrastinate's to ~25 s each).
        return n[1] if system in workloads.ONE_PER_FETCH else n[batch]

    cases = [(s, shape, b) for s in names for shape in QUEUE_SHAPES for b in (1, 100)]
    results: dict[tuple[str, str, int], list[dict[str, Any]]] = {c: [] for c in cases}
    for r in range(size["queue_rounds"]):
        for system, shape, batch in rotated(cases, r * 3):
            key = QUEUE_SHAPES[shape] + f"batch_{batch}"
            label = f"queue/{system}/{key}/round_{r + 1}"
            if system in workloads.CELERY_PREFETCH:
                got = measured(
                    label,
                    workloads.queue_celery,
                    messages(system, batch),
                    batch,
                    cfg["workers"],
                    shape,
                    workloads.celery_ctx(system, ctx),
                )
            else:
                got = measured(
                    label,
                    workloads.queue_run,
                    system,
                    messages(system, batch),
                    batch,
                    cfg["workers"],
                    shape,
                )
            results[(system, shape, batch)].append(got)
            log(f"queue round {r + 1}: {system} {key}: {got['messages_per_s']} msg/s")
    out: dict[str, Any] = {}
    for system in names:
        out[system] = {}
        for shape, prefix in QUEUE_SHAPES.items():
            for batch in (1, 100):
                runs = results[(system, shape, batch)]
                out[system][f"{prefix}batch_{batch}"] = {
                    **summary([x["messages_per_s"] for x in runs], 1),
                    "details": runs,
                }
    report["workloads"]["queue"] = {
        "design": DESIGNS["queue"].format(b1=n[1], b100=n[100]),
        "systems": out,
    }


def run_waves(
    names: list[str],
    size: dict[str, Any],
    ctx: dict[str, Any],
    report: dict[str, Any],
    measured: Any,
) -> None:
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in names}
    for r in range(size["rounds"]):
        for system in rotated(names, r):
            runs = measured(
                f"waves/{system}/round_{r + 1}",
                workloads.waves_run,
                system,
                5,
                50,
                size["wave_repeats_per_round"],
                ctx,
            )
            results[system].extend(runs)
            log(
                f"waves round {r + 1}: {system}: "
                + ", ".join(f"{x['makespan_s']:.3f} s" for x in runs)
            )
    report["workloads"]["waves"] = {
        "design": DESIGNS["waves"].format(rep=size["wave_repeats_per_round"]),
        "systems": {
            s: {
                "makespan_s": summary([x["makespan_s"] for x in runs], 3),
                "sync_overhead_ms": summary([x["sync_overhead_ms"] for x in runs], 2),
                "runs": runs,
            }
            for s, runs in results.items()
        },
    }


def run_dispatch(
    names: list[str],
    size: dict[str, Any],
    ctx: dict[str, Any],
    report: dict[str, Any],
    measured: Any,
) -> None:
    results: dict[str, list[float]] = {s: [] for s in names}
    for r in range(size["rounds"]):
        for system in rotated(names, r):
            got = measured(
                f"dispatch/{system}/round_{r + 1}",
                workloads.dispatch_run,
                system,
                size["dispatch_samples_per_round"],
                ctx,
            )
            results[system].extend(got)
            log(f"dispatch round {r + 1}: {system}: p50 {statistics.median(got):.2f} ms")
    out = {}
    for s, values in results.items():
        out[s] = {
            "samples": len(values),
            "p50_ms": round(percentile(values, 50), 2),
            "p90_ms": round(percentile(values, 90), 2),
            "p99_ms": round(percentile(values, 99), 2),
            "max_ms": round(max(values), 2),
            "min_ms": round(min(values), 2),
        }
    report["workloads"]["dispatch"] = {
        "design": DESIGNS["dispatch"].format(
            samples=size["dispatch_samples_per_round"] * size["rounds"]
        ),
        "systems": out,
    }


def run_scale(
    names: list[str],
    size: dict[str, Any],
    ctx: dict[str, Any],
    report: dict[str, Any],
    measured: Any,
) -> None:
    out = {}
    for system in names:
        got = measured(
            f"scale/{system}",
            workloads.scale_run,
            system,
            size["retained"],
            size["scale_samples"],
            ctx,
        )
        out[system] = got
        log(
            f"scale: {system}: {got['ms_none']} ms none, {got['ms_retained']} ms with "
            f"{got['retained']:,} retained (ratio {got['ratio']})"
        )
    report["workloads"]["scale"] = {
        "design": DESIGNS["scale"].format(retained=size["retained"], samples=size["scale_samples"]),
        "systems": out,
    }


if __name__ == "__main__":
    sys.exit(main())
