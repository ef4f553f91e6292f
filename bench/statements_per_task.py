"""Where the database's time goes per task in our waves workload: each statement's share
(``pg_stat_statements``) and each server process's CPU.

    .venv-bench/bin/python -m bench.statements_per_task                # ~1 min, prints it
    .venv-bench/bin/python -m bench.statements_per_task --write-docs   # and appends it

The shared server cannot load ``pg_stat_statements`` without a restart, so this runs on a
private cluster (``bench.private_postgres``) started with it preloaded
(``track_planning`` on) and ``fsync`` on, as the shared server has it. Our schema and
worker are deployed there as ``bench.peers`` deploys them (``WorkerProcess.peer``: one
process, 4 executor threads; the caller in this process). After a warm-up wave of 50 the
statistics are read, ``--runs`` runs of the peers' waves workload (5 waves x 50 no-op
tasks) go, and the statistics are read again; every figure is the difference, per task.

- **statements**: per statement, calls, execution and planning milliseconds, rows per
  call. Named after the ``-- name:`` of ``scheduler_lib``'s SQL files whose text begins
  the same (``+``: the statement is longer, another statement rides in it). Execution
  time is wall time inside the server: a backend that waits for the CPU on a busy 2-core
  machine counts.
- **server processes**: CPU milliseconds per task of each PostgreSQL process alive at
  the end (``/proc``), by what its client last ran — the worker's taking connections end
  on ``COMMIT``, its answering ones on the answer's SEND, the listeners on ``LISTEN``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import psycopg

from bench.private_postgres import PrivatePostgres

SQL_FILES = ("scheduler_lib/broker/db/sql", "scheduler_lib/scheduler/sql")
WAVES, SIZE = 5, 50  # as bench.peers' workload 2
TOP = 12  # statements shown
TICK = os.sysconf("SC_CLK_TCK")


def _normal(sql: str) -> str:
    """Text compared across sources: no comments, single spaces, parameters and constants
    as ``?`` (pg_stat_statements shows a constant as a parameter)."""
    sql = re.sub(r"--[^\n]*", " ", sql)
    sql = re.sub(r"'(?:[^']|'')*'", "?", sql)
    sql = re.sub(r"(?i)(?<!IS )(?<!NOT )\b(?:NULL|TRUE|FALSE)\b", "?", sql)
    sql = re.sub(r"\$\d+|(?<!:):[a-z_][a-z0-9_]*|(?<![\w.$])\d+(?:\.\d+)?(?![\w.])", "?", sql)
    return re.sub(r"\s+", " ", sql).strip().rstrip(";").rstrip()


def statement_names(repo: Path) -> dict[str, str]:
    """Normalized text -> name, for every ``-- name:`` block of our SQL files (their
    ``-- include:`` lines replaced by the fragments, as the broker loads them)."""
    from scheduler_lib.broker.db.queries import parse

    names: dict[str, str] = {}
    for folder in SQL_FILES:
        for path in sorted((repo / folder).glob("*.sql")):
            for name, body in parse(path.read_text()).items():
                names[_normal(body)] = name
    return names


def label(query: str, names: dict[str, str]) -> str:
    """The name of the statement whose text ``query`` shares the longest beginning with
    (``+``: not the whole of it — another statement rides in it, or it is a variant)."""
    text = _normal(query)
    if text in names:
        return names[text]
    best, shared = "", 0
    for known, name in names.items():
        n = len(os.path.commonprefix([known, text]))  # noqa: RUF071 - of text, not paths
        if n > shared:
            best, shared = name, n
    return f"{best} +" if shared >= 100 else text[:60] + "…"


def statements(url: str) -> dict[int, tuple[str, int, float, float, int]]:
    """queryid -> (text, calls, execution ms, planning ms, rows)."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT queryid, query, calls, total_exec_time, total_plan_time, rows "
            "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database "
            "WHERE datname = current_database()) AND query NOT LIKE '%pg_stat_statements%'"
        ).fetchall()
    return {r[0]: (r[1], r[2], r[3], r[4], r[5]) for r in rows}


def server_cpu() -> dict[int, float]:
    """pid -> CPU seconds of every live process named ``postgres``."""
    out: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            text = open(f"/proc/{entry}/stat").read()  # noqa: SIM115 - read at once
            name, rest = text[text.index("(") + 1 : text.rindex(")")], text.rsplit(")", 1)[1]
            if name == "postgres":
                fields = rest.split()
                out[int(entry)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def activity(url: str) -> dict[int, str]:
    """pid -> what the process is (its backend type) and its client last ran."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid, coalesce(backend_type, '') || ': ' || left(coalesce(query, ''), 200) "
            "FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
        ).fetchall()
    return {pid: what for pid, what in rows}


def measure(runs: int) -> tuple[list[tuple[str, float, float, float, float]], list[str], float]:
    """Run the workload on a private cluster; the statement rows, the process rows (as
    table lines) and the wall seconds per run."""
    with PrivatePostgres(start=False) as pg:
        with (pg.datadir / "postgresql.conf").open("a") as conf:
            conf.write(
                "shared_preload_libraries = 'pg_stat_statements'\n"
                "pg_stat_statements.track_planning = on\n"
            )
        pg.start()
        with psycopg.connect(pg.url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET fsync = on")  # the private cluster starts without
            conn.execute("SELECT pg_reload_conf()")
        # bench.peers reads the server's address when first imported
        os.environ["SCHEDULER_LIB_BENCH_POSTGRES"] = pg.url
        from bench.peers import handlers, systems
        from scheduler_lib.broker import Broker
        from scheduler_lib.scheduler import TaskScheduler

        try:
            with systems.fresh_db("ours") as url:
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute("CREATE EXTENSION pg_stat_statements")
                worker = systems.WorkerProcess.peer("ours", url, "tasks", concurrency=4)
                try:
                    with Broker(url, migrate=False) as broker:
                        scheduler = TaskScheduler(broker)
                        scheduler.run_waves([[handlers.task(f"warm:{i}") for i in range(SIZE)]])
                        before, cpu_before = statements(url), server_cpu()
                        started = time.monotonic()
                        for r in range(runs):
                            plan = [
                                [handlers.task(f"{r}:{k}:{i}") for i in range(SIZE)]
                                for k in range(WAVES)
                            ]
                            if not scheduler.run_waves(plan).ok:
                                raise RuntimeError("a task of the waves failed")
                        wall = (time.monotonic() - started) / runs
                        after, cpu_after = statements(url), server_cpu()
                        last = activity(pg.url)
                finally:
                    worker.stop()
        finally:
            systems.drop_templates()
    tasks = runs * WAVES * SIZE
    names = statement_names(Path(__file__).resolve().parent.parent)
    rows = []
    for queryid, (query, calls, exec_ms, plan_ms, nrows) in after.items():
        _, calls0, exec0, plan0, rows0 = before.get(queryid, (query, 0, 0.0, 0.0, 0))
        if calls > calls0:
            rows.append(
                (
                    label(query, names),
                    (calls - calls0) / tasks,
                    (exec_ms - exec0) / tasks,
                    (plan_ms - plan0) / tasks,
                    (nrows - rows0) / (calls - calls0),
                )
            )
    rows.sort(key=lambda r: r[2] + r[3], reverse=True)
    processes = []
    for pid, seconds in sorted(
        cpu_after.items(), key=lambda p: p[1] - cpu_before.get(p[0], 0.0), reverse=True
    ):
        ms = 1000 * (seconds - cpu_before.get(pid, 0.0)) / tasks
        if ms >= 0.005:
            what = last.get(pid, "(the postmaster)")
            what = re.sub(r"\s+", " ", what)
            processes.append(f"| {ms:.3f} | {what[:70].replace('|', '/')} |")
    return rows, processes, wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.statements_per_task", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--runs", type=int, default=6, help="runs of the 5 waves measured")
    parser.add_argument("--write-docs", action="store_true", help="append to benchmarks.md")
    args = parser.parse_args(argv)
    if args.runs < 1:
        print("--runs must be at least 1", file=sys.stderr)
        return 2
    started = time.monotonic()
    rows, processes, wall = measure(args.runs)
    total = sum(r[2] + r[3] for r in rows)
    table = [
        "| statement | calls per task | execution ms per task | planning ms per task | "
        "rows per call |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(
            f"| {name.replace('|', '/')} | {calls:.2f} | {ex:.3f} | {pl:.3f} | {nrows:.2f} |"
            for name, calls, ex, pl, nrows in rows[:TOP]
        ),
        f"| (all {len(rows)} statements) | {sum(r[1] for r in rows):.2f} | "
        f"{sum(r[2] for r in rows):.3f} | {sum(r[3] for r in rows):.3f} | |",
    ]
    cpu = ["| CPU ms per task | process: what its client last ran |", "| ---: | --- |"]
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    section = (
        f"\n## statements_per_task — {stamp}\n\n"
        f"Command: `python -m bench.statements_per_task --runs {args.runs}` (took "
        f"{time.monotonic() - started:.0f} s; design in `bench/statements_per_task.py`'s "
        f"docstring). Machine: {os.cpu_count()} cores; git "
        f"{os.popen('git rev-parse --short=10 HEAD').read().strip()}.\n\n"
        f"Our waves workload (5 x 50 no-op tasks, 4 executor threads) on a private cluster "
        f"with pg_stat_statements: {wall:.3f} s per run of the 5 waves; the statements' "
        f"time inside the server, {total:.3f} ms per task in all, the first {TOP}:\n\n"
        + "\n".join(table)
        + "\n\nThe server's processes, CPU per task:\n\n"
        + "\n".join(cpu + processes[:TOP])
        + "\n"
    )
    print(section)
    if args.write_docs:
        from bench.broker_throughput import append_docs

        append_docs(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
