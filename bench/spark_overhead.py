"""Spark overhead: trivial Spark SQL tasks through the scheduler and its Spark worker vs.
the same statements submitted directly from a thread pool of the same size, on the same
SparkSession, in the same run.

Run from the repository root::

    .venv/bin/python -m bench.spark_overhead                 # PostgreSQL (~5 min)
    .venv/bin/python -m bench.spark_overhead --db sqlite     # SQLite, a temporary file
    .venv/bin/python -m bench.spark_overhead --db both       # one after the other
    .venv/bin/python -m bench.spark_overhead --quick         # ~1 min smoke run

    # what produced the figures in docs/benchmarks.md (~10 min)
    .venv/bin/python -m bench.spark_overhead --db both --rounds 7 --profile --wait-idle 300

One SparkSession (``scheduler_lib.spark.session.build``: FAIR pools; master --master,
``local[2]``; UI off) serves both sides. Per backend, a fresh database (PostgreSQL:
created, afterwards dropped; SQLite: a file in a temporary directory) and one Spark
worker (``scheduler_lib.spark.Worker``, --readers (4) readers: threads on that session,
started by activation) that stays up for the whole run, as a user's worker would; the
caller is a ``TaskScheduler`` on the same broker. The readers' idle timeout
(``SCHEDULER_LIB_EXECUTOR_IDLE``) is --reader-idle (2 s) so that they leave between
measurements quickly.

The workload: --tasks (200) statements ``SELECT count(*) AS n FROM range(1000 + i)``,
each distinct, each returning one row.

  - direct: the statements through a ``ThreadPoolExecutor`` of --readers threads, each
    doing what the ``spark_sql`` kind does with a query — ``spark.sql(s).take(1)`` — with
    no job group and no pool set. The pool lives for the whole run and its threads are
    warm: the best case for the direct side;
  - ours, cold: one ``run_waves([tasks])`` of ``spark_sql`` tasks (``collect: 1``) while
    the worker has no reader running: the readers' ramp-up (activation checks every
    0.25 s) is in the figure, as a user pays it;
  - ours, warm: the same wave again at once after the cold one, its readers still up.

Both ``ours`` figures are the wall time of ``run_waves`` (check, send in one
transaction, run, every completion received). Before direct and before cold the worker's
readers have left. Rounds (--rounds, 5) take turns: direct, cold, warm in even rounds;
cold, warm, direct in odd ones; with --wait-idle, each round first waits (up to that
long) for the machine to be quiet. Before the rounds, --warmup (3) uncounted passes of
each side warm up the JVM, the connections and the imports: Spark keeps getting faster
(JIT) for the first ~2,000 queries: with one warm-up pass of each side, the direct passes
of rounds 1, 2, 3 took 10.9, 8.5 and 7.9 s on a quiet 2-core machine.
Reported: the median of each side, the ratios of medians (ours / direct; target <= 1.10,
the issue's acceptance point), and each round's own ratio. From ``execution_log``
(``sent_at``, ``start_time``, ``end_time`` and ``worker_id`` per task) each wave also
splits into: dispatch (wave start -> first task start), ramp-up (-> every reader has
started a task), a task's time on its reader (start -> end: ``start_time`` is taken just
before the durable start commit and ``end_time`` as the finish transaction begins, so this
is the start commit, the job group's setup and the Spark work), the gap between two tasks
on a reader (the finish and answer transaction, the next take, the task's parsing) and
the tail (last task end -> ``run_waves`` returned). Each side's CPU is accounted as in
``bench.broker_throughput`` and split into the Python driver (this process), the JVM (the
rest of its process group: Spark's driver and, in local mode, executors) and the
database's backends (PostgreSQL; SQLite works inside this process); foreign work
(another Spark application, say) is reported, as it makes the figures noisy.

--profile adds an instrumented pass after the rounds (not counted in the figures): the
executor, the broker and the ``spark_sql`` kind are wrapped from this script (nothing in
``scheduler_lib`` changes) to time each step of a task on its reader, in wall time and
in the reader thread's CPU time.

Prints one JSON object on stdout, progress on stderr, and appends a dated section to
docs/benchmarks.md (unless --no-docs).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import datetime as dt
import itertools
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.broker_throughput import (
    BUSY_WARNING_PCT,
    FOREIGN_WARNING_PCT,
    busy_pct,
    cpu_accounts,
    database,
    docs_section,
    finish_run,
    log,
    machine_facts,
    our_backends,
    percentile,
    process_cpu,
)
from scheduler_lib.broker import Broker

BACKENDS = ("postgresql", "sqlite")
TASKS = 200
READERS = 4
ROUNDS = 5
WARMUP = 3  # uncounted passes of each side: the JIT keeps speeding Spark up for ~2000 queries
MASTER = "local[2]"
READER_IDLE = 2.0  # seconds a reader waits for work before it leaves
STATEMENT = "SELECT count(*) AS n FROM range({rows})"
FIRST_ROWS = 1000  # task i counts FIRST_ROWS + i rows
COLLECT = 1  # rows each statement returns, both sides
TARGET_RATIO = 1.10  # ours / direct wall time, at most
DRAIN_TIMEOUT = 60.0  # seconds to wait for the readers to leave between measurements
WAVE_TIMEOUT = 600.0  # seconds run_waves may wait for one completion
SIDES = ("direct", "cold", "warm")


def statements(count: int) -> list[str]:
    return [STATEMENT.format(rows=FIRST_ROWS + i) for i in range(count)]


@contextlib.contextmanager
def backend_database(backend: str) -> Iterator[str]:
    if backend == "postgresql":
        with database("spark") as url:
            yield url
    else:
        with tempfile.TemporaryDirectory(prefix="bench_spark_") as tmp:
            yield f"sqlite:///{tmp}/broker.db"


# --- the two sides ---------------------------------------------------------------------


class Direct:
    """The direct side: a warm thread pool on the session."""

    def __init__(self, spark: Any, threads: int) -> None:
        self.spark = spark
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="direct")
        # Start every thread (and its pinned JVM thread) before anything is timed.
        barrier = threading.Barrier(threads)
        list(self.pool.map(lambda _: barrier.wait(30), range(threads)))

    def one(self, statement: str) -> tuple[float, float, int]:
        """What the ``spark_sql`` kind does with a query: (sql s, take s, the count)."""
        t0 = time.perf_counter()
        frame = self.spark.sql(statement)
        t1 = time.perf_counter()
        rows = frame.take(COLLECT)
        return t1 - t0, time.perf_counter() - t1, rows[0]["n"]

    def run(self, stmts: list[str]) -> dict[str, Any]:
        started = time.perf_counter()
        calls = list(self.pool.map(self.one, stmts))
        wall = time.perf_counter() - started
        for i, (_, _, n) in enumerate(calls):
            assert n == FIRST_ROWS + i, f"direct: statement {i} counted {n}"
        return {
            "wall_s": wall,
            "statement_ms_p50": 1000 * statistics.median(a + b for a, b, _ in calls),
            "sql_ms_p50": 1000 * statistics.median(a for a, _, _ in calls),
            "take_ms_p50": 1000 * statistics.median(b for _, b, _ in calls),
        }

    def close(self) -> None:
        self.pool.shutdown()


class Ours:
    """The scheduler's side: waves of ``spark_sql`` tasks to the worker."""

    def __init__(self, broker: Broker, worker: Any) -> None:
        from scheduler_lib.scheduler import TaskScheduler

        self.broker = broker
        self.worker = worker
        self.scheduler = TaskScheduler(broker)

    def readers(self) -> int:
        return int(self.worker.runtime.readers_of(self.worker.queue))

    def drain(self) -> None:
        """Wait until every reader has left (they do after ``READER_IDLE`` idle)."""
        deadline = time.monotonic() + DRAIN_TIMEOUT
        while self.readers():
            if time.monotonic() > deadline:
                raise RuntimeError(f"readers still running after {DRAIN_TIMEOUT} s idle")
            time.sleep(0.05)

    def run(self, stmts: list[str]) -> dict[str, Any]:
        tasks = [{"kind": "spark_sql", "sql": s, "collect": COLLECT} for s in stmts]
        readers_at_start = self.readers()
        wall_start = time.time()
        started = time.perf_counter()
        report = self.scheduler.run_waves([tasks], timeout=WAVE_TIMEOUT)
        wall = time.perf_counter() - started
        wall_end = wall_start + wall
        assert report.ok and len(report.completions) == len(tasks), "ours: a task failed"
        counts = sorted(c.result["rows"][0]["n"] for c in report.completions)
        assert counts == [FIRST_ROWS + i for i in range(len(tasks))], "ours: wrong counts"
        rows = self.broker.fetch("log_of_scheduler", handle=str(report.scheduler_handle))
        return {
            "wall_s": wall,
            "readers_at_start": readers_at_start,
            **timeline(rows, wall_start, wall_end),
        }


def timeline(rows: list[Any], wall_start: float, wall_end: float) -> dict[str, Any]:
    """Where a wave's time went, from its ``execution_log`` rows (ms)."""
    by_reader: dict[str, list[Any]] = collections.defaultdict(list)
    for row in rows:
        by_reader[row["worker_id"]].append(row)
    gaps = []
    for tasks in by_reader.values():
        tasks.sort(key=lambda r: r["start_time"])
        gaps += [b["start_time"] - a["end_time"] for a, b in itertools.pairwise(tasks)]
    firsts = sorted(tasks[0]["start_time"] for tasks in by_reader.values())
    on_reader = [r["end_time"] - r["start_time"] for r in rows]
    return {
        "readers_used": len(by_reader),
        "send_ms": round(1000 * (min(r["sent_at"] for r in rows) - wall_start), 2),
        "first_start_ms": round(1000 * (firsts[0] - wall_start), 2),
        "all_readers_started_ms": round(1000 * (firsts[-1] - wall_start), 2),
        "reader_first_starts_ms": [round(1000 * (t - wall_start), 1) for t in firsts],
        "task_on_reader_ms_p50": round(1000 * statistics.median(on_reader), 2),
        "gap_between_tasks_ms_p50": round(1000 * statistics.median(gaps), 2) if gaps else None,
        "gap_between_tasks_ms_p90": round(1000 * percentile(gaps, 90), 2) if gaps else None,
        "tail_ms": round(1000 * (wall_end - max(r["end_time"] for r in rows)), 2),
    }


# --- CPU accounting --------------------------------------------------------------------


class CpuWindow:
    """This run's and foreign CPU over one measurement, as shares of the machine."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> CpuWindow:
        self.before = process_cpu()
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        after = process_cpu()
        backends = our_backends(self.url) if self.url.startswith("postgresql") else set()
        accounts = cpu_accounts(self.before, after, backends)
        machine = (time.monotonic() - self.t0) * (os.cpu_count() or 1)
        self.pct = {k: round(100 * v / machine, 1) for k, v in accounts.items()}
        # This run's CPU seconds: the Python driver, its JVM (the rest of the process
        # group: Spark's driver and executors in local mode) and its PostgreSQL backends.
        me = os.getpid()
        python = after[me][0] - self.before[me][0]
        self.seconds = {
            "total": round(accounts["clients"] + accounts["backends"], 2),
            "python": round(python, 2),
            "jvm": round(accounts["clients"] - python, 2),
            "backends": round(accounts["backends"], 2),
        }


# --- the run ---------------------------------------------------------------------------


def wait_quiet(limit: float | None) -> float:
    """Wait up to ``limit`` seconds for the machine to be under ``BUSY_WARNING_PCT`` busy;
    its busy percentage at the end."""
    busy = busy_pct(1.0)
    until = time.monotonic() + (limit or 0)
    while busy > BUSY_WARNING_PCT and time.monotonic() < until:
        log(f"the machine is {busy}% busy; waiting for it to go quiet")
        busy = busy_pct(5.0)
    return busy


def measure(backend: str, spark: Any, direct: Direct, args: argparse.Namespace) -> dict[str, Any]:
    from scheduler_lib import spark as sl_spark

    stmts = statements(args.tasks)
    samples: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    quiet: list[float] = []  # the machine's CPU busy % before each round
    with backend_database(backend) as url, Broker(url) as broker:
        worker = sl_spark.Worker(broker, spark=spark, max_readers=args.readers).start()
        try:
            ours = Ours(broker, worker)
            for w in range(args.warmup):
                log(f"{backend}: warm-up {w + 1}/{args.warmup} (an uncounted pass of each side)")
                direct.run(stmts)
                ours.run(stmts)

            def side(name: str) -> None:
                if name != "warm":
                    ours.drain()
                with CpuWindow(url) as cpu:
                    result = direct.run(stmts) if name == "direct" else ours.run(stmts)
                result["cpu_pct"], result["cpu_s"] = cpu.pct, cpu.seconds
                samples[name].append(result)
                log(
                    f"{backend}: round {len(samples[name])}/{args.rounds} {name}: "
                    f"{result['wall_s']:.2f} s (foreign CPU {cpu.pct['foreign']}%)"
                )

            for r in range(args.rounds):
                ours.drain()
                quiet.append(wait_quiet(args.wait_idle))
                for name in SIDES if r % 2 == 0 else (*SIDES[1:], SIDES[0]):
                    side(name)
            out = summarize(samples)
            out["busy_pct_before_rounds"] = quiet
            if args.profile:
                ours.drain()
                log(f"{backend}: instrumented pass (--profile; not in the figures)")
                out["profile"] = profile_pass(spark, direct, ours, stmts)
        finally:
            worker.stop()
    return out


def summarize(samples: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    walls = {side: [s["wall_s"] for s in samples[side]] for side in SIDES}
    medians = {side: statistics.median(walls[side]) for side in SIDES}
    out: dict[str, Any] = {}
    for side in SIDES:
        out[side] = {
            "median_s": round(medians[side], 3),
            "min_s": round(min(walls[side]), 3),
            "max_s": round(max(walls[side]), 3),
            "runs_s": [round(w, 3) for w in walls[side]],
            "foreign_cpu_pct_mean": round(
                statistics.mean(s["cpu_pct"]["foreign"] for s in samples[side]), 1
            ),
            "foreign_cpu_pct_max": max(s["cpu_pct"]["foreign"] for s in samples[side]),
            "cpu_s_median": {
                part: round(statistics.median(s["cpu_s"][part] for s in samples[side]), 2)
                for part in samples[side][0]["cpu_s"]
            },
            "rounds": samples[side],
        }
    for side in ("cold", "warm"):
        per_round = [o / d for o, d in zip(walls[side], walls["direct"], strict=True)]
        out[f"ratio_{side}"] = {
            "of_medians": round(medians[side] / medians["direct"], 3),
            "per_round_median": round(statistics.median(per_round), 3),
            "per_round_min": round(min(per_round), 3),
            "per_round_max": round(max(per_round), 3),
            "target": f"<= {TARGET_RATIO}",
            "met": medians[side] / medians["direct"] <= TARGET_RATIO,
        }
        for key in (
            "send_ms",
            "first_start_ms",
            "all_readers_started_ms",
            "task_on_reader_ms_p50",
            "gap_between_tasks_ms_p50",
            "tail_ms",
        ):
            values = [s[key] for s in samples[side] if s[key] is not None]
            out[side][key] = round(statistics.median(values), 2) if values else None
    out["direct"]["statement_ms_p50"] = round(
        statistics.median(s["statement_ms_p50"] for s in samples["direct"]), 2
    )
    return out


# --- --profile -------------------------------------------------------------------------


class Profile:
    """Times the steps of a task on its reader — wall time, and the reader thread's own
    CPU time (Python; not the JVM's, not the database's) — by wrapping, for one pass, the
    executor's, the broker's and the ``spark_sql`` kind's methods (restored after)."""

    def __init__(self) -> None:
        self.samples: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        self.local = threading.local()
        self.lock = threading.Lock()
        self.saved: list[tuple[Any, str, Any]] = []

    def reader(self) -> bool:
        return getattr(self.local, "task", False)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            sample = (time.perf_counter() - wall, time.thread_time() - cpu)
            with self.lock:
                self.samples[name].append(sample)

    def wrap(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        self.saved.append((owner, attr, vars(owner).get(attr)))
        setattr(owner, attr, make(getattr(owner, attr)))

    def restore(self) -> None:
        for owner, attr, value in reversed(self.saved):
            if value is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, value)
        self.saved.clear()

    def timed(self, name: str | Callable[..., str]) -> Callable[[Any], Any]:
        """A wrapper factory: the step's time, in readers only (``name`` may be a function
        of the call's arguments)."""

        def make(original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if not self.reader():
                    return original(*args, **kwargs)
                with self.step(name if isinstance(name, str) else name(*args, **kwargs)):
                    return original(*args, **kwargs)

            return wrapper

        return make

    def install(self, spark: Any) -> None:
        from scheduler_lib.broker import END_DIALOG, ERROR
        from scheduler_lib.scheduler.executor import Executor
        from scheduler_lib.spark import kinds

        profile, local = self, self.local

        def run_one(original: Any) -> Any:
            def wrapper(executor: Any, *args: Any, **kwargs: Any) -> Any:
                local.task, local.ran = True, False
                wall, cpu = time.perf_counter(), time.thread_time()
                try:
                    took = original(executor, *args, **kwargs)
                finally:
                    local.task = False
                if local.ran:
                    sample = (time.perf_counter() - wall, time.thread_time() - cpu)
                    with self.lock:
                        self.samples["whole task on the reader (run_one)"].append(sample)
                return took

            return wrapper

        def take(original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if not self.reader():
                    return original(*args, **kwargs)
                wall, cpu = time.perf_counter(), time.thread_time()
                leases = original(*args, **kwargs)
                if leases:  # an empty take is a reader waiting for work, not overhead
                    sample = (time.perf_counter() - wall, time.thread_time() - cpu)
                    with self.lock:
                        self.samples["take (lease)"].append(sample)
                return leases

            return wrapper

        def start_step(executor: Any, lease: Any) -> str:
            if lease.message.message_type_name in (END_DIALOG, ERROR):
                return "EndDialog of a released scheduler (end_conversation)"
            return "start (parse, check, log_start commit)"

        def kind_run(original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                try:
                    with self.step("kind.run (spark_sql)"):
                        return original(*args, **kwargs)
                finally:
                    local.ran = True

            return wrapper

        class TimedFinish:
            """The finish transaction: log_finish, AsyncDone, complete the lease."""

            def __init__(self, inner: Any) -> None:
                self.inner = inner
                self.step = profile.step("finish + answer transaction")

            def __enter__(self) -> Any:
                self.step.__enter__()
                return self.inner.__enter__()

            def __exit__(self, *exc: Any) -> Any:
                try:
                    return self.inner.__exit__(*exc)
                finally:
                    self.step.__exit__(None, None, None)

        def transaction(original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                cm = original(*args, **kwargs)
                return TimedFinish(cm) if self.reader() and local.ran else cm

            return wrapper

        def spark_job(original: Any) -> Any:
            @contextlib.contextmanager
            def wrapper(context: Any) -> Iterator[Any]:
                entering = self.step("spark_job enter (job group, pool; log_spark if any)")
                entering.__enter__()
                with original(context) as session:
                    entering.__exit__(None, None, None)
                    try:
                        yield session
                    finally:
                        leaving = self.step("spark_job exit")
                        leaving.__enter__()
                leaving.__exit__(None, None, None)

            return wrapper

        self.wrap(Executor, "run_one", run_one)
        self.wrap(Executor, "_start", self.timed(start_step))
        self.wrap(Broker, "take", take)
        self.wrap(Broker, "run", self.timed(lambda broker, query, **_: f"broker.run {query}"))
        self.wrap(Broker, "transaction", transaction)
        self.wrap(kinds.SparkSqlKind, "run", kind_run)
        self.wrap(kinds, "spark_job", spark_job)
        self.wrap(kinds, "preview", self.timed("preview (take, columns, rows)"))
        self.wrap(spark, "sql", self.timed("spark.sql (parse, analyze)"))

    def summary(self) -> dict[str, Any]:
        """Per step: wall mean and p50 ms, the reader thread's CPU mean ms, over the tasks
        it was timed in (on a warm wave a reader's first task began before the wrappers
        were in place: fewer samples)."""
        return {
            name: {
                "mean_ms": round(1000 * statistics.mean(w for w, _ in values), 2),
                "p50_ms": round(1000 * statistics.median(w for w, _ in values), 2),
                "max_ms": round(1000 * max(w for w, _ in values), 2),
                "cpu_mean_ms": round(1000 * statistics.mean(c for _, c in values), 2),
                "count": len(values),
            }
            for name, values in self.samples.items()
        }


def profile_pass(spark: Any, direct: Direct, ours: Ours, stmts: list[str]) -> dict[str, Any]:
    """One cold wave, one warm wave and one direct pass with the steps timed."""
    out: dict[str, Any] = {}
    for name in ("cold", "warm"):
        profile = Profile()
        profile.install(spark)
        try:
            result = ours.run(stmts)
        finally:
            profile.restore()
        out[name] = {"wall_s": round(result["wall_s"], 3), "steps": profile.summary()}
        log(f"profile {name}: {result['wall_s']:.2f} s")
    ours.drain()
    result = direct.run(stmts)
    out["direct"] = {k: round(v, 3) for k, v in result.items()}
    log(f"profile direct: {result['wall_s']:.2f} s")
    return out


# --- report ----------------------------------------------------------------------------

PROFILE_STEPS = {  # step -> its name in the docs, in the order a task goes through them
    "take (lease)": "take",
    "start (parse, check, log_start commit)": "start (log_start commit)",
    "broker.run log_spark": "log_spark",
    "spark_job enter (job group, pool; log_spark if any)": "job group set (log_spark incl.)",
    "spark.sql (parse, analyze)": "spark.sql",
    "preview (take, columns, rows)": "take(1) + rows",
    "spark_job exit": "job group left",
    "finish + answer transaction": "finish + answer txn",
    "whole task on the reader (run_one)": "whole task",
}
END_DIALOG_STEP = "EndDialog of a released scheduler (end_conversation)"


def profile_rows(name: str, profile: dict[str, Any]) -> list[tuple[str, Any, str, str]]:
    """The --profile pass's steps, one row per wave, and the direct side's split."""
    rows: list[tuple[str, Any, str, str]] = []
    for wave in ("cold", "warm"):
        steps = profile[wave]["steps"]
        rows.append(
            (
                f"{name}, --profile {wave} wave ({profile[wave]['wall_s']} s), per task, mean "
                "wall ms (reader thread's CPU ms): " + " / ".join(PROFILE_STEPS.values()),
                " / ".join(
                    f"{steps[s]['mean_ms']} ({steps[s]['cpu_mean_ms']})" if s in steps else "-"
                    for s in PROFILE_STEPS
                ),
                "",
                "",
            )
        )
        if END_DIALOG_STEP in steps:
            ended = steps[END_DIALOG_STEP]
            rows.append(
                (
                    f"{name}, --profile {wave} wave: a reader ending the previous wave's "
                    "scheduler conversation (EndDialog), wall ms, max (count)",
                    f"{ended['max_ms']} ({ended['count']})",
                    "",
                    "",
                )
            )
    d = profile["direct"]
    rows.append(
        (
            f"{name}, --profile direct pass ({d['wall_s']} s), p50 ms: spark.sql / take(1)",
            f"{d['sql_ms_p50']} / {d['take_ms_p50']}",
            "",
            "",
        )
    )
    return rows


def markdown_section(report: dict[str, Any]) -> str:
    c = report["config"]
    rows: list[tuple[str, Any, str, str]] = []
    for backend in c["backends"]:
        r = report[backend]
        name = {"postgresql": "PostgreSQL", "sqlite": "SQLite"}[backend]

        def wall(side: str, r: dict[str, Any] = r) -> str:
            s = r[side]
            return f"{s['median_s']} ({s['min_s']}..{s['max_s']})"

        def ratio(side: str, r: dict[str, Any] = r) -> tuple[str, str]:
            x = r[f"ratio_{side}"]
            return (
                f"{x['of_medians']} (per round {x['per_round_median']}, "
                f"{x['per_round_min']}..{x['per_round_max']})",
                "met" if x["met"] else "**missed**",
            )

        cold, warm, direct = r["cold"], r["warm"], r["direct"]
        rows += [
            (
                f"{name}: direct, thread pool of {c['readers']}, s median (min..max)",
                wall("direct"),
                "",
                "",
            ),
            (f"{name}: ours, readers started by the wave (cold), s", wall("cold"), "", ""),
            (
                f"{name}: ratio cold / direct, of medians (per round: median, min..max)",
                ratio("cold")[0],
                f"<= {TARGET_RATIO}",
                ratio("cold")[1],
            ),
            (f"{name}: ours, readers already running (warm), s", wall("warm"), "", ""),
            (
                f"{name}: ratio warm / direct, of medians (per round: median, min..max)",
                ratio("warm")[0],
                f"<= {TARGET_RATIO}",
                ratio("warm")[1],
            ),
            (
                f"{name}: per statement p50 ms, direct / task start -> end on its reader, "
                "cold ; warm",
                f"{direct['statement_ms_p50']} / {cold['task_on_reader_ms_p50']} ; "
                f"{warm['task_on_reader_ms_p50']}",
                "",
                "",
            ),
            (
                f"{name}: gap between two tasks on a reader (finish, take, start) p50 ms, "
                "cold ; warm",
                f"{cold['gap_between_tasks_ms_p50']} ; {warm['gap_between_tasks_ms_p50']}",
                "",
                "",
            ),
            (
                f"{name}: cold wave: first task started / all {c['readers']} readers started, "
                "ms after run_waves was called",
                f"{cold['first_start_ms']} / {cold['all_readers_started_ms']}",
                "",
                "",
            ),
            (
                f"{name}: tail, last task ended -> run_waves returned, ms, cold ; warm",
                f"{cold['tail_ms']} ; {warm['tail_ms']}",
                "",
                "",
            ),
            (
                f"{name}: CPU s per pass, median, all of this run (Python driver + JVM + "
                "its backends), direct / cold / warm",
                " / ".join(str(r[s]["cpu_s_median"]["total"]) for s in SIDES),
                "",
                "",
            ),
            (
                f"{name}: of which Python driver ; JVM ; backends, direct / cold / warm",
                " ; ".join(
                    " / ".join(str(r[s]["cpu_s_median"][part]) for s in SIDES)
                    for part in ("python", "jvm", "backends")
                ),
                "",
                "",
            ),
            (
                f"{name}: foreign CPU, % of the machine, mean direct / cold / warm",
                " / ".join(str(r[s]["foreign_cpu_pct_mean"]) for s in SIDES),
                "",
                "",
            ),
        ]
        if "profile" in r:
            rows += profile_rows(name, r["profile"])
    notes = []
    foreign = max(report[b][s]["foreign_cpu_pct_max"] for b in c["backends"] for s in SIDES)
    if foreign > FOREIGN_WARNING_PCT:
        notes.append(
            f"Warning: foreign work (other programs) took up to {foreign}% of the machine's "
            "CPU during a measurement; the figures are noisy."
        )
    return docs_section(
        "spark_overhead",
        report,
        f"{c['tasks']} trivial Spark SQL statements (`{STATEMENT.format(rows='1000 + i')}`, "
        f"take({COLLECT})) on one SparkSession (master {c['master']}): through the "
        f"scheduler (`run_waves`, one wave of `spark_sql` tasks, a Spark worker with "
        f"{c['readers']} readers) vs. a thread pool of {c['readers']} on the same session; "
        f"{c['rounds']} rounds taking turns, after {c['warmup_passes']} uncounted passes "
        "of each. Cold: no "
        "reader running when the wave is sent (ramp-up included); warm: the readers of the "
        "cold wave still up. Design in `bench/spark_overhead.py`'s docstring.",
        rows,
        notes,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.spark_overhead", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--db", choices=[*BACKENDS, "both"], default="postgresql", help="the broker's database"
    )
    parser.add_argument("--quick", action="store_true", help="~1 min smoke run")
    parser.add_argument("--tasks", type=int, help=f"statements per wave (default {TASKS})")
    parser.add_argument("--readers", type=int, default=READERS, help="readers = pool threads")
    parser.add_argument("--rounds", type=int, help=f"rounds (default {ROUNDS}; quick 1)")
    parser.add_argument(
        "--warmup", type=int, help=f"uncounted passes of each side (default {WARMUP}; quick 1)"
    )
    parser.add_argument("--master", default=MASTER, help="Spark master")
    parser.add_argument(
        "--reader-idle", type=float, default=READER_IDLE, help="seconds before a reader leaves"
    )
    parser.add_argument("--profile", action="store_true", help="add an instrumented pass")
    parser.add_argument(
        "--wait-idle",
        type=float,
        metavar="SECONDS",
        help=f"wait up to this long for the machine to be under {BUSY_WARNING_PCT}%% busy, "
        "before the start and before each round",
    )
    parser.add_argument("--no-docs", action="store_true", help="do not append to the docs")
    args = parser.parse_args(argv)
    args.tasks = args.tasks or (40 if args.quick else TASKS)
    args.rounds = args.rounds or (1 if args.quick else ROUNDS)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else WARMUP)
    backends = BACKENDS if args.db == "both" else (args.db,)
    # Read by each executor when it starts: set before the worker starts any.
    os.environ["SCHEDULER_LIB_EXECUTOR_IDLE"] = str(args.reader_idle)

    waiting = time.monotonic()
    idle_check = wait_quiet(args.wait_idle)
    if idle_check > BUSY_WARNING_PCT:
        log(f"warning: the machine is {idle_check}% busy before the start; figures will be noisy")
    started = time.monotonic()
    report: dict[str, Any] = {
        "benchmark": "spark_overhead",
        "started_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(
            [Path(sys.executable).name, "-m", "bench.spark_overhead", *sys.argv[1:]]
        ),
        "quick": args.quick,
        "machine": machine_facts(),
        "config": {
            "backends": list(backends),
            "tasks": args.tasks,
            "readers": args.readers,
            "rounds": args.rounds,
            "warmup_passes": args.warmup,
            "master": args.master,
            "reader_idle_s": args.reader_idle,
            "statement": STATEMENT,
            "collect": COLLECT,
        },
    }
    report["machine"]["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    report["machine"]["cpu_busy_pct_before_start"] = idle_check
    report["waited_for_quiet_s"] = round(started - waiting, 1)

    import pyspark

    from scheduler_lib.spark import session as sl_session

    log(f"SparkSession, master {args.master}")
    spark = sl_session.build(master=args.master, conf={"spark.ui.enabled": "false"})
    try:
        spark.sparkContext.setLogLevel("ERROR")
        jvm: Any = spark.sparkContext._jvm
        java = jvm.System.getProperty("java.version")
        report["machine"]["packages"].update({"pyspark": pyspark.__version__, "java": java})
        direct = Direct(spark, args.readers)
        try:
            for backend in backends:
                report[backend] = measure(backend, spark, direct, args)
                r = report[backend]
                log(
                    f"{backend}: direct {r['direct']['median_s']} s, "
                    f"cold {r['cold']['median_s']} s "
                    f"(ratio {r['ratio_cold']['of_medians']}), warm {r['warm']['median_s']} s "
                    f"(ratio {r['ratio_warm']['of_medians']})"
                )
        finally:
            direct.close()
    finally:
        spark.stop()
    return finish_run(report, started, None if args.no_docs else markdown_section)


if __name__ == "__main__":
    sys.exit(main())
