"""``python -m demo``: the blog's scheduler test — waves of 4, 2, 1, 2, 1 tasks of
decreasing length — run as Spark SQL by a ``scheduler-lib worker``, with live progress,
the run's ``execution_log`` and a timeline picture."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape

# The scheduler checks tasks before sending them; importing the Spark layer makes it know
# the spark_sql kind (pyspark itself is only imported by the worker).
import scheduler_lib.spark  # noqa: F401
from demo import report, runs, tasks, timeline
from demo.worker import WorkerFailed, WorkerProcess
from scheduler_lib.broker import Broker, BrokerError
from scheduler_lib.scheduler import RunReport, TaskScheduler, WaveFailed

TASK_TIMEOUT = 120.0  # seconds to wait for any one completion before giving up on the worker
# Small data on a few cores: 200 shuffle partitions (Spark's default) would be mostly
# scheduling overhead.
SHUFFLE_PARTITIONS = 8
DB_FILE = "demo.db"
WAREHOUSE = "demo-warehouse"
WORKER_LOG = "demo-worker.log"
PICTURE = "demo-timeline.png"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m demo", description=__doc__)
    parser.add_argument("--db", help=f"SQLAlchemy URL (default: a fresh SQLite file OUT/{DB_FILE})")
    parser.add_argument(
        "--out", default=".", type=Path, help="directory for the database, log, picture"
    )
    parser.add_argument("--master", default="local[*]", help="Spark master of the worker")
    parser.add_argument(
        "--readers", type=_positive_int, default=4, help="tasks the worker runs at once"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; 0 when every task succeeded, 1 otherwise."""
    args = build_parser().parse_args(argv)
    begun = time.monotonic()
    out_dir: Path = args.out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    db = args.db or _fresh_sqlite(out_dir / DB_FILE)
    # The worker's tables are files here; last run's would make CREATE TABLE fail.
    warehouse = out_dir / WAREHOUSE
    shutil.rmtree(warehouse, ignore_errors=True)
    out = report.console()
    worker = WorkerProcess(
        db,
        out_dir / WORKER_LOG,
        master=args.master,
        readers=args.readers,
        conf=[
            f"spark.sql.warehouse.dir={warehouse}",
            "spark.ui.enabled=false",
            f"spark.sql.shuffle.partitions={SHUFFLE_PARTITIONS}",
        ],
    )
    out.print(
        f"starting a Spark worker ({args.master}, {args.readers} readers) on {db}; "
        f"its log: {worker.log_path}"
    )
    waves = tasks.waves()
    try:
        with worker:
            out.print(f"ready after {time.monotonic() - begun:.1f} s: {worker.banner}")
            with Broker(db) as broker:
                run_report, failed = _run(broker, out, waves)
                task_runs = runs.fetch(broker, run_report.scheduler_handle)
            out.print("stopping the worker …")
    except (WorkerFailed, BrokerError) as exc:
        what = str(exc) if isinstance(exc, WorkerFailed) else f"{type(exc).__name__}: {exc}"
        out.print(f"[red]{what}[/]; the end of {worker.log_path}:")
        out.print(worker.tail(), markup=False)
        cause = worker.first_error()
        if cause is not None:
            out.print(f"[red]the first error in the log:[/] {escape(cause)}")
        return 1
    except KeyboardInterrupt:
        out.print("[yellow]interrupted: running tasks cancelled, worker stopped[/]")
        return 130
    out.print(f"worker stopped (exit code {worker.returncode})")

    report.print_runs(out, task_runs)
    last = run_report.waves[-1].completions
    if last and last[0].ok:
        report.print_result(out, f"{last[0].task_name} (wave {len(waves)})", last[0].result)
    picture = timeline.draw(
        task_runs,
        out_dir / PICTURE,
        title=f"make demo: the blog's scheduler test as Spark SQL ({args.master})",
    )
    out.print(f"timeline: {picture}")
    took = run_report.ended_at - run_report.started_at
    total = time.monotonic() - begun
    if failed is not None or not run_report.ok:
        out.print(f"[red]the demo failed[/] after {took:.1f} s: {report.verdict(run_report)}")
        for c in run_report.failures:
            if c.error:
                out.print(f"\n{c.task_name} {c.status}:\n{c.error}", markup=False)
        return 1
    out.print(
        f"[green]all {len(task_runs)} tasks succeeded[/]: waves took {took:.1f} s, "
        f"the demo {total:.1f} s"
    )
    return 0


def _run(
    broker: Broker, out: Console, waves: list[list[dict[str, object]]]
) -> tuple[RunReport, WaveFailed | None]:
    """Run the waves with live progress: the report, and the failure when one stopped
    them (fail fast)."""
    scheduler = TaskScheduler(broker)
    with report.LiveProgress(out, broker, waves) as live:
        try:
            return (
                scheduler.run_waves(
                    waves,
                    policy="fail_fast",
                    timeout=TASK_TIMEOUT,
                    on_completion=live.on_completion,
                ),
                None,
            )
        except WaveFailed as failed:
            assert failed.report is not None  # run_waves always attaches its report
            return failed.report, failed


def _fresh_sqlite(path: Path) -> str:
    """The URL of ``path``, after removing the last run's database there."""
    for leftover in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        with contextlib.suppress(FileNotFoundError):
            os.remove(leftover)
    return f"sqlite:///{path}"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value
