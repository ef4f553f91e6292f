"""Where our dispatch latency goes (workload 3 of ``bench.peers``, ours only).

    .venv-bench/bin/python -m bench.dispatch_breakdown            # ~1 min, prints a table
    .venv-bench/bin/python -m bench.dispatch_breakdown --write-docs   # and appends it

Three parts, each on a fresh database cloned from the peers benchmark's template:

1. **The caller alone** (no worker; the tasks just queue): ``exec_async`` back to back, then
   after the same 20-40 ms idle pause the peers benchmark makes before each task, then
   after the pause with ``synchronous_commit = off`` on the caller's connections (an
   experiment: it gives up the durability of the send); then the worker's take alone,
   back to back, on the tasks those calls queued.
2. **The whole path** with the peers benchmark's worker (4 executor threads in another
   process), split where the worker process can see it: the call to the NOTIFY reaching
   the worker's listener, the listener to the take being issued, the take's round trip
   (the take and the task's durable start, two statements in one round trip), the take's
   return to the first line of the task's handler (``bench.peers.handlers.noop``, where
   ``bench.peers`` times every system). The worker here is ``bench.peers.worker``'s, with two
   timestamps added by wrapping ``Wakeups.notify`` and ``ops.leases.take_fast`` (diagnostic
   only: internal names, so this script may need updating when they change).

3. **The floor** of this machine, no scheduler_lib code at all, with the same pauses: one
   round trip to an idle server (PostgreSQL ``SELECT 1``, Redis ``PING``) after the pause
   against back to back, which is what each wake-up of an idle process costs here; then
   the least a dispatch can do on each server, caller in this process and one consumer
   process waiting: on PostgreSQL one autocommit statement that INSERTs the task and
   NOTIFYs (a durable commit, as every PostgreSQL system's enqueue), the consumer's LISTEN
   woken, and one ``DELETE ... FOR UPDATE SKIP LOCKED`` take — on another connection or on
   the LISTEN one, its commit without the WAL flush or with it (where the take records the
   start durably, as ours does by default); on Redis an ``LPUSH`` to a consumer blocked in
   ``BRPOP`` (Celery's transport, without Celery). Timed from before the enqueue to the
   take's return, p50 and p99.

Times are ``time.time()`` on one machine; medians over ``--samples`` tasks after 10
warm-up ones, and over the slowest tenth of them (by the whole path): which step the
tail (the p99 of ``bench.peers``' dispatch) grows in.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from bench.broker_throughput import log, percentile, publish
from bench.peers import systems
from bench.peers.systems import WorkerProcess, drop_templates, fresh_db, jitter
from bench.peers.worker import TASK_QUEUE
from bench.peers.workloads import WARM_DISPATCH, no_op, ours_dispatch_calls

TAKE_ALONE = "the worker's take alone, back to back (on the tasks queued above)"


def caller_alone(samples: int) -> dict[str, float]:
    """Median ms of ``exec_async`` with no worker: back to back, after an idle pause, and
    after an idle pause without waiting for the WAL flush; then of the worker's take
    alone."""
    from scheduler_lib.broker import Broker
    from scheduler_lib.scheduler import TaskScheduler

    task = no_op()
    out: dict[str, float] = {}
    cases: list[tuple[str, bool, dict[str, Any]]] = [
        ("exec_async, back to back", False, {}),
        ("exec_async after a 20-40 ms pause", True, {}),
        (
            "exec_async after a pause, synchronous_commit = off",
            True,
            {"connect_args": {"options": "-c synchronous_commit=off"}},
        ),
    ]
    with fresh_db("ours") as url:
        for name, pause, engine in cases:
            with Broker(url, migrate=False, engine_options=engine) as broker:
                scheduler = TaskScheduler(broker)
                with scheduler.scheduler() as handle:
                    times = []
                    for i in range(WARM_DISPATCH + samples):
                        if pause:
                            jitter()
                        started = time.perf_counter()
                        scheduler.exec_async(handle, task)
                        if i >= WARM_DISPATCH:
                            times.append(time.perf_counter() - started)
            out[name] = 1000 * statistics.median(times)
            log(f"caller alone, {name}: p50 {out[name]:.2f} ms")
        # The worker's take with nothing else running: the tasks queued above, taken back
        # to back as an executor takes them (the one statement, no WAL flush).
        with Broker(url, migrate=False) as broker:
            times = []
            for _ in range(samples):
                started = time.perf_counter()
                if not broker.take(TASK_QUEUE, timeout=0, durable=False):
                    raise RuntimeError("dispatch breakdown: the queued tasks are gone")
                times.append(time.perf_counter() - started)
        out[TAKE_ALONE] = 1000 * statistics.median(times)
        log(f"caller alone, {TAKE_ALONE}: p50 {out[TAKE_ALONE]:.2f} ms")
    return out


TAIL = 0.1  # the slowest share of the tasks (by their whole path) the tail column is of


def whole_path(samples: int) -> dict[str, tuple[float, float]]:
    """Median ms of each step from the call to the handler's start, with a worker: over
    every task, and over the slowest tenth (by their whole path; what the p99 is made
    of)."""
    fd, record = tempfile.mkstemp(prefix="bench-dispatch-", suffix=".json")
    os.close(fd)
    with fresh_db("ours") as url:
        worker = WorkerProcess(
            [sys.executable, "-m", "bench.dispatch_breakdown", "--worker", url, record]
        )
        try:
            calls = ours_dispatch_calls(url, samples)
        finally:
            worker.stop()
    with open(record) as fh:
        seen = json.load(fh)
    os.unlink(record)
    notified = sorted(seen["notify"])
    takes = sorted(zip(seen["take_issued"], seen["take_done"], strict=True))
    handled = {tag: start for tag, start, _ in seen["records"]}
    steps: dict[str, list[float]] = {
        "exec_async (the caller's call)": [],
        "call -> NOTIFY seen by the worker": [],
        "NOTIFY -> take issued": [],
        "take + durable start (one round trip)": [],
        "take returned -> handler start": [],
        "total: call -> handler start": [],
    }
    for tag, _, called, returned in calls:
        if int(tag) < WARM_DISPATCH:
            continue
        notice = notified[bisect.bisect_left(notified, called)]
        issued, taken = takes[bisect.bisect_left(takes, (called,))]
        start = handled[tag]
        for name, ms in zip(
            steps,
            (
                returned - called,
                notice - called,
                issued - notice,
                taken - issued,
                start - taken,
                start - called,
            ),
            strict=True,
        ):
            steps[name].append(1000 * ms)
    total = steps["total: call -> handler start"]
    slowest = sorted(range(len(total)), key=total.__getitem__)[-max(1, round(TAIL * len(total))) :]
    out = {
        name: (statistics.median(values), statistics.median(values[i] for i in slowest))
        for name, values in steps.items()
    }
    for name, (ms, tail) in out.items():
        log(f"whole path, {name}: p50 {ms:.2f} ms (slowest tenth: {tail:.2f} ms)")
    return out


def instrumented_worker(url: str, record: str) -> None:
    """``bench.peers.worker``'s executors, with the listener's wakeups and the takes
    timed; writes them to ``record`` when stopped (SIGTERM)."""
    import signal
    import threading

    from bench.peers.worker import ours_worker
    from scheduler_lib.broker.db import wakeup
    from scheduler_lib.broker.ops import leases

    seen: dict[str, list[Any]] = {"notify": [], "take_issued": [], "take_done": []}
    notify: Callable[..., Any] = wakeup.Wakeups.notify
    take: Callable[..., Any] = leases.take_fast

    def timed_notify(self: Any, queues: Any) -> None:
        seen["notify"].append(time.time())
        notify(self, queues)

    def timed_take(*args: Any, **kwargs: Any) -> Any:
        issued = time.time()
        taken = take(*args, **kwargs)
        if taken:
            seen["take_issued"].append(issued)
            seen["take_done"].append(time.time())
        return taken

    wakeup.Wakeups.notify = timed_notify  # type: ignore[method-assign]
    leases.take_fast = timed_take
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # prints READY (for WorkerProcess) once running; the handlers' [tag, start, end]
    seen["records"] = ours_worker(url, 4, stop, role="tasks")
    with open(record, "w") as fh:
        json.dump(seen, fh)


# --- 3. the floor ------------------------------------------------------------------------

FLOOR_TABLE = "bench_floor_tasks"
FLOOR_CHANNEL = "bench_floor"
FLOOR_LIST = "bench-floor-tasks"
FLOOR_TAKE = (
    f"DELETE FROM {FLOOR_TABLE} WHERE id = (SELECT id FROM {FLOOR_TABLE} ORDER BY id LIMIT 1 "
    "FOR UPDATE SKIP LOCKED) RETURNING sent"
)
# (name, the take's connection, its commit waits for the WAL flush)
FLOOR_POSTGRESQL = [
    ("PostgreSQL: INSERT + NOTIFY, LISTEN, take on another connection, no flush", "other", False),
    ("PostgreSQL: the same, the take on the LISTEN connection", "listen", False),
    ("PostgreSQL: the same, the take's commit flushed (a durable start)", "other", True),
]
FLOOR_REDIS = "Redis: LPUSH to a consumer in BRPOP"


def round_trips(samples: int, url: str, redis_url: str) -> dict[str, tuple[float, float]]:
    """p50 and p99 ms of one round trip to an idle server, back to back and after the
    pause: PostgreSQL ``SELECT 1`` and Redis ``PING``."""
    import psycopg
    import redis

    out: dict[str, tuple[float, float]] = {}
    with psycopg.connect(url, autocommit=True) as conn:
        client = redis.Redis.from_url(redis_url)
        calls: list[tuple[str, Callable[[], Any]]] = [
            ("PostgreSQL SELECT 1", lambda: conn.execute("SELECT 1").fetchone()),
            ("Redis PING", client.ping),
        ]
        for name, call in calls:
            for pause in (False, True):
                times = []
                for i in range(WARM_DISPATCH + samples):
                    if pause:
                        jitter()
                    started = time.perf_counter()
                    call()
                    if i >= WARM_DISPATCH:
                        times.append(1000 * (time.perf_counter() - started))
                key = f"round trip, {name}, " + ("after the pause" if pause else "back to back")
                out[key] = p50_p99(times)
                log(f"floor, {key}: p50 {out[key][0]:.2f} ms, p99 {out[key][1]:.2f} ms")
        client.close()
    return out


def floor_consumer(kind: str, url: str, take_on: str, flushed: bool, ready: Any, done: Any) -> None:
    """The floor's consumer process: takes tasks as they come (PostgreSQL: LISTEN, then
    the take; Redis: BRPOP) until the caller's stop, then puts ``[sent, taken]`` of each
    on ``done``."""
    got: list[tuple[float, float]] = []
    if kind == "redis":
        import redis

        client = redis.Redis.from_url(url)
        ready.put("ready")
        while True:
            _, body = client.brpop([FLOOR_LIST])
            taken = time.time()
            if body == b"stop":
                break
            got.append((float(body), taken))
        done.put(got)
        return
    import psycopg

    with psycopg.connect(url, autocommit=True) as listen:
        take = listen if take_on == "listen" else psycopg.connect(url, autocommit=True)
        if not flushed:
            take.execute("SET synchronous_commit = off")
        listen.execute(f"LISTEN {FLOOR_CHANNEL}")
        ready.put("ready")
        while True:
            for _ in listen.notifies(stop_after=1):
                pass
            row = take.execute(FLOOR_TAKE).fetchone()
            taken = time.time()
            if row is None:
                continue
            if row[0] < 0:  # the caller's stop
                break
            got.append((row[0], taken))
        if take is not listen:
            take.close()
    done.put(got)


def floor(samples: int) -> dict[str, tuple[float, float]]:
    """p50 and p99 ms of the round trips and of the floor's dispatches (module docstring,
    part 3)."""
    import psycopg
    import redis

    spawn = multiprocessing.get_context("spawn")
    out: dict[str, tuple[float, float]] = {}
    server = systems.Redis()
    with contextlib.ExitStack() as stack:
        stack.callback(server.close)
        url = stack.enter_context(fresh_db("ours"))
        redis_url = stack.enter_context(server.database())
        out.update(round_trips(samples, url, redis_url))
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {FLOOR_TABLE} (id bigserial PRIMARY KEY, sent float8)")
            enqueue = (
                f"WITH t AS (INSERT INTO {FLOOR_TABLE} (sent) VALUES (%s)) "
                f"SELECT pg_notify('{FLOOR_CHANNEL}', 'tasks')"
            )
            for name, take_on, flushed in FLOOR_POSTGRESQL:
                out[name] = floor_run(
                    name,
                    spawn,
                    ("postgresql", url, take_on, flushed),
                    lambda sent: conn.execute(enqueue, (sent,)),
                    samples,
                )
        client = redis.Redis.from_url(redis_url)
        out[FLOOR_REDIS] = floor_run(
            FLOOR_REDIS,
            spawn,
            ("redis", redis_url, "", False),
            lambda sent: client.lpush(FLOOR_LIST, repr(sent)),
            samples,
            stop=lambda: client.lpush(FLOOR_LIST, "stop"),
        )
        client.close()
    return out


def floor_run(
    name: str,
    spawn: Any,
    consumer: tuple[str, str, str, bool],
    enqueue: Callable[[float], Any],
    samples: int,
    stop: Callable[[], Any] | None = None,
) -> tuple[float, float]:
    """One floor dispatch: a consumer process, then a task after each pause (the pause,
    20-40 ms, is the only wait for the take before it: nothing else checks it), then the
    consumer's stop; raises unless it took every task."""
    ready, done = spawn.Queue(), spawn.Queue()
    process = spawn.Process(target=floor_consumer, args=(*consumer, ready, done), daemon=True)
    process.start()
    try:
        ready.get(timeout=60)
        for _ in range(WARM_DISPATCH + samples):
            jitter()
            enqueue(time.time())
        # a sentinel the consumer stops at, once everything before it is taken
        (stop or (lambda: enqueue(-1.0)))()
        got = done.get(timeout=60)
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
    if len(got) != WARM_DISPATCH + samples:
        raise RuntimeError(f"dispatch floor {consumer[0]}: {len(got)} tasks taken")
    times = [1000 * (taken - sent) for sent, taken in got[WARM_DISPATCH:]]
    result = p50_p99(times)
    log(f"floor, {name}: p50 {result[0]:.2f} ms, p99 {result[1]:.2f} ms")
    return result


def p50_p99(times: list[float]) -> tuple[float, float]:
    return percentile(times, 50), percentile(times, 99)


def markdown(
    alone: dict[str, float],
    path: dict[str, tuple[float, float]],
    floor_ms: dict[str, tuple[float, float]],
    samples: int,
) -> str:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"\n## Where our dispatch latency goes — {when}\n",
        "Command: `.venv-bench/bin/python -m bench.dispatch_breakdown` (design in "
        "`bench/dispatch_breakdown.py`; ours only, the peers benchmark's worker and pauses; "
        f"medians of {samples} tasks).\n",
        "| the caller alone (no worker) | p50 ms |",
        "| --- | ---: |",
        *[f"| {name} | {ms:.2f} |" for name, ms in alone.items()],
        "",
        "| the whole path (worker: 4 executor threads in another process) | p50 ms | "
        f"median of the slowest {TAIL:.0%} ms |",
        "| --- | ---: | ---: |",
        *[f"| {name} | {ms:.2f} | {tail:.2f} |" for name, (ms, tail) in path.items()],
        "",
        f"The last column: the same steps' medians over the slowest {TAIL:.0%} of the tasks "
        "(by their whole path), the tail a p99 is made of.\n",
        "| the floor (no scheduler_lib code; the same pauses) | p50 ms | p99 ms |",
        "| --- | ---: | ---: |",
        *[f"| {name} | {p50:.2f} | {p99:.2f} |" for name, (p50, p99) in floor_ms.items()],
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--write-docs", action="store_true", help="append to benchmarks.md")
    parser.add_argument("--worker", nargs=2, metavar=("URL", "RECORD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        instrumented_worker(*args.worker)
        return
    try:
        alone = caller_alone(args.samples)
        path = whole_path(args.samples)
        floor_ms = floor(args.samples)
    finally:
        drop_templates()  # the template database fresh_db cloned from
    publish(markdown(alone, path, floor_ms, args.samples), args.write_docs)


if __name__ == "__main__":
    main()
