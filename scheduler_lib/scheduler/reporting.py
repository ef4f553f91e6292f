"""What the ``run`` and ``status`` commands show: progress while a plan runs, the
summary table after it, and the execution status (rich tables, or JSON)."""

from __future__ import annotations

import contextlib
import datetime
import json
import sys
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from scheduler_lib.broker import Broker, activation
from scheduler_lib.broker.db.connections import Availability
from scheduler_lib.broker.exceptions import BrokerError, InvalidArgument
from scheduler_lib.scheduler import catalog
from scheduler_lib.scheduler.client import Completion, RunReport, SchedulerHandle, TaskScheduler
from scheduler_lib.scheduler.errors import PlanError, WaveFailed
from scheduler_lib.scheduler.plan import Plan

MONITOR_FRESH = 10.0  # seconds: a queue monitor updated this recently is being served
READER_WAIT = 15.0  # seconds `run` waits for something to serve its target queue
READER_POLL = 0.5  # seconds between its looks


class NoReaders(BrokerError):
    """Nothing serves the plan's target queue: no `scheduler-lib serve` or `worker` runs
    for this database."""


class PlanRunner:
    """Runs a plan with a progress bar and prints what ran."""

    def __init__(
        self,
        broker: Broker,
        plan: Plan,
        *,
        policy: str | None = None,
        max_in_flight: int | None = None,
        target: str | None = None,
        serve: bool = False,
        serve_skip: Collection[str] = (),
        as_json: bool = False,
        reader_wait: float | None = READER_WAIT,
    ) -> None:
        self.broker = broker
        self.reader_wait = reader_wait  # None: wait for ever for the target's readers
        self.serve_skip = serve_skip  # activation procedures --serve leaves to others
        self.plan = plan
        self.policy = policy or plan.policy
        self.max_in_flight = max_in_flight or plan.max_in_flight
        chosen = target or plan.target
        self.scheduler = TaskScheduler(broker, target=chosen) if chosen else TaskScheduler(broker)
        self.serve = serve
        self.as_json = as_json
        self.handle: SchedulerHandle | None = None  # the plan's scheduler, once it began
        self.out = _console()
        self.err = Console(stderr=True)

    def run(self) -> int:
        target = self.scheduler.target
        for w, (tasks, lines) in enumerate(
            zip(self.plan.waves, self.plan.lines, strict=True), start=1
        ):
            for i, (task, line) in enumerate(zip(tasks, lines, strict=True), start=1):
                try:
                    self.scheduler.check_task(task)
                except InvalidArgument as exc:
                    raise PlanError(f"{self.plan.path}:{line}: wave {w}, task {i}: {exc}") from None
        queue = self.scheduler.broker.service(target)["queue_name"]
        if not self.serve:
            self._wait_for_readers(queue)
        report: RunReport | None
        error: WaveFailed | None = None
        with self._executors(), self._progress() as advance:
            try:
                report = self.scheduler.run_waves(
                    self.plan.waves,
                    policy=self.policy,
                    max_in_flight=self.max_in_flight,
                    timeout=self.plan.timeout,
                    on_completion=advance,
                    on_start=self._began,
                )
            except WaveFailed as failed:
                error, report = failed, failed.report
        assert report is not None
        rows = self._rows(report)
        if self.as_json:
            self.out.print_json(json.dumps(_json_report(report, rows, self.plan)))
        else:
            self.out.print(_summary(rows, self.plan))
            verdict = "all tasks succeeded" if report.ok else _verdict(report)
            took = report.ended_at - report.started_at
            colour = "green" if report.ok else "red"
            self.out.print(f"[{colour}]{verdict}[/] in {took:.2f} s")
            if error is not None:
                self.err.print(f"[red]stopped (fail_fast):[/] {error}")
        return 0 if report.ok else 1

    def _began(self, handle: SchedulerHandle) -> None:
        self.handle = handle

    def _wait_for_readers(self, queue: str) -> None:
        """Something must serve the target queue: a `scheduler-lib serve` or `worker`
        for this database. Waits ``reader_wait`` seconds for one (``None``: for ever),
        then refuses to send anything.

        :raises NoReaders: nothing served it in time
        """
        served, first = _served(self.broker, queue)
        if served:
            return
        url = self.broker.url.render_as_string(hide_password=True)
        how = (
            f"start `scheduler-lib serve --db {url}` (`scheduler-lib worker --db {url}` for "
            "Spark tasks), or pass --serve"
        )
        wait = "for ever" if self.reader_wait is None else f"up to {self.reader_wait:g} s"
        self.err.print(
            f"nothing serves {queue!r} yet: waiting {wait} for a reader ({how})",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        deadline = None if self.reader_wait is None else time.monotonic() + self.reader_wait
        while True:
            # A runtime stamps the monitor with its own host's clock, which may be behind
            # this one's by more than MONITOR_FRESH: a stamp that moves while we wait says
            # the queue is served whatever the clocks say.
            served, stamp = _served(self.broker, queue)
            if served or stamp not in (None, first):
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise NoReaders(
                    f"nothing served {queue!r} within {self.reader_wait:g} s, so nothing "
                    f"was sent: {how}; --wait-for-readers waits for ever"
                )
            time.sleep(READER_POLL)

    @contextlib.contextmanager
    def _executors(self) -> Iterator[None]:
        if not self.serve:
            yield
            return
        with activation.running(
            self.broker, empty_grace=0.2, check_interval=0.5, skip_procedures=self.serve_skip
        ):
            yield

    @contextlib.contextmanager
    def _progress(self) -> Iterator[Any]:
        total = self.plan.task_count
        waves = len(self.plan.waves)
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.err,
            disable=not self.err.is_terminal,
        )
        bar = progress.add_task(f"wave 1/{waves}", total=total)
        done: dict[int, int] = {}

        def advance(wave: int, completion: Completion) -> None:  # wave: from 1
            done[wave] = done.get(wave, 0) + 1
            progress.update(bar, advance=1, description=f"wave {wave}/{waves}")
            if not self.err.is_terminal and done[wave] == len(self.plan.waves[wave - 1]):
                self.err.print(f"wave {wave}/{waves} done", highlight=False)

        def outage(availability: Availability) -> None:
            # An outage is progress news, not an error: the run goes on when it ends.
            if availability.available:
                line = "database back: continuing"
            else:
                line = (
                    f"database unavailable, retrying for {availability.timeout:.0f} s "
                    f"({(availability.last_error or '').splitlines()[0][:160]})"
                )
            if self.err.is_terminal:
                progress.update(bar, description=line)
            else:
                self.err.print(line, highlight=False, markup=False, soft_wrap=True)

        self.broker.availability.watch(outage)
        with progress:
            yield advance

    def _rows(self, report: RunReport) -> list[Mapping[str, Any]]:
        return self.broker.fetch("log_of_scheduler", handle=str(report.scheduler_handle))


def _console() -> Console:
    """Standard output; wide when it is not a terminal, so logs and pipes get whole rows."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def _served(broker: Broker, queue: str) -> tuple[bool, float | None]:
    """Whether a runtime serves ``queue`` — a reader of it running, or its monitor written
    in the last ``MONITOR_FRESH`` seconds (each runtime vouches for its monitors at every
    heartbeat, idle or not) — and when its monitor was last written (epoch seconds, by the
    writer's clock; ``None`` without one: no runtime ever served the queue)."""
    now = time.time()
    stamp = next(
        (float(m["updated_at"]) for m in broker.queue_monitors() if m["queue_name"] == queue),
        None,
    )
    if stamp is not None and now - stamp < MONITOR_FRESH:
        return True, stamp
    return any(t["queue_name"] == queue for t in broker.activated_tasks()), stamp


def _verdict(report: RunReport) -> str:
    statuses = [c.status for c in report.completions]
    not_sent = sum(len(w.not_sent) for w in report.waves)
    return (
        f"{statuses.count('FAILED')} failed, {statuses.count('CANCELLED')} cancelled, "
        f"{not_sent} not sent, {statuses.count('SUCCEEDED')} succeeded"
    )


def utc(seconds: float, timespec: str = "seconds") -> str:
    """A time (seconds since the epoch) as every output of the command line writes it:
    ISO 8601 in UTC, ``2026-11-25T17:30:05Z``.

    :param timespec: as :meth:`datetime.datetime.isoformat`: ``"seconds"`` in tables,
        ``"milliseconds"`` where tasks a few ms apart are told apart (``run``, ``status``),
        ``"microseconds"`` in JSON
    """
    moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return moment.replace(tzinfo=None).isoformat(timespec=timespec) + "Z"


def json_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row for ``--json``: its columns as they are, but times — the columns named
    ``*_at`` and ``*_time``, seconds since the epoch — as :func:`utc` with microseconds."""
    return {
        key: utc(value, "microseconds")
        if value is not None and key.endswith(("_at", "_time"))
        else value
        for key, value in row.items()
    }


def write_json(document: Any) -> None:
    """Print a ``--json`` document on standard output (UUIDs and the like as text)."""
    sys.stdout.write(json.dumps(document, indent=2, default=str) + "\n")


def _clock(seconds: float | None) -> str:
    return "-" if seconds is None else utc(seconds, "milliseconds")


def _summary(rows: Sequence[Mapping[str, Any]], plan: Plan) -> Table:
    table = Table(title=f"execution_log of {plan.path}")
    for column in ("wave", "log id", "task", "status", "worker", "started", "seconds", "error"):
        table.add_column(column, overflow="fold")
    styles = {"SUCCEEDED": "green", "FAILED": "red", "CANCELLED": "yellow"}
    for r in rows:
        wave = r["wave"]
        known = wave is not None and 1 <= wave <= len(plan.wave_names)
        name = plan.wave_names[wave - 1] if known else None
        seconds = (
            f"{r['end_time'] - r['start_time']:.2f}"
            if r["end_time"] is not None and r["attempts"]
            else "-"
        )
        table.add_row(
            "-" if wave is None else f"{wave}" + (f" {name}" if name else ""),
            str(r["log_id"]),
            r["task_name"],
            f"[{styles.get(r['status'], 'white')}]{r['status']}[/]",
            r["worker_id"] or "-",
            _clock(r["start_time"] if r["attempts"] else None),
            seconds,
            (r["error"] or "").splitlines()[0][:80] if r["error"] else "",
        )
    return table


def _json_report(
    report: RunReport, rows: Sequence[Mapping[str, Any]], plan: Plan
) -> dict[str, Any]:
    return {
        "plan": plan.path,
        "ok": report.ok,
        "scheduler_handle": str(report.scheduler_handle),
        "started_at": utc(report.started_at, "microseconds"),
        "ended_at": utc(report.ended_at, "microseconds"),
        "not_sent": [[t.to_dict() for t in w.not_sent] for w in report.waves],
        "tasks": [json_row(r) for r in rows],
    }


def _spark(row: Any) -> str:
    """Where a running Spark task can be watched: its job group and the Spark UI."""
    if not row["spark_job_group"]:
        return "-"
    return " ".join(str(v) for v in (row["spark_job_group"], row["spark_ui_url"]) if v)


def print_status(broker: Broker, *, limit: int = 20, as_json: bool = False) -> None:
    """The execution_status view, the most recent log rows and the semaphores.

    It only reads, and so neither creates nor upgrades the scheduler's schema: the
    command checks that it is current first.
    """
    broker.use_queries(catalog.QUERIES)
    with broker.transaction() as tx:
        running = tx.fetch("status_list")
        recent = tx.fetch("log_recent", limit=limit)
        semaphores = tx.fetch("semaphore_list", now=time.time())
    if as_json:
        write_json(
            {
                "execution_status": [json_row(r) for r in running],
                "recent": [json_row(r) for r in recent],
                "semaphores": [json_row(r) for r in semaphores],
            }
        )
        return
    out = _console()
    now_running = Table(title="execution status: activated readers and what they run")
    for column in (
        "reader",
        "queue",
        "host",
        "pid",
        "log id",
        "task",
        "status",
        "since",
        "spark job group / UI",
        "dag / run / task",
    ):
        now_running.add_column(column, overflow="fold")
    for r in running:
        airflow = " / ".join(str(r[k]) for k in ("dag_id", "run_id", "task_id") if r[k])
        now_running.add_row(
            r["reader_name"],
            r["queue_name"],
            r["host_name"],
            str(r["process_id"]),
            "-" if r["log_id"] is None else str(r["log_id"]),
            r["task_name"] or "(idle)",
            r["status"] or "-",
            _clock(r["start_time"]),
            _spark(r),
            airflow or "-",
        )
    out.print(now_running)
    log = Table(title=f"execution_log: the last {limit}")
    for column in (
        "log id",
        "scheduler",
        "wave",
        "task",
        "status",
        "worker",
        "started",
        "seconds",
        "error",
    ):
        log.add_column(column, overflow="fold")
    for r in recent:
        seconds = (
            f"{r['end_time'] - r['start_time']:.2f}" if r["end_time"] and r["attempts"] else "-"
        )
        log.add_row(
            str(r["log_id"]),
            str(r["scheduler_handle"])[:8],
            "-" if r["wave"] is None else str(r["wave"]),
            r["task_name"],
            r["status"],
            r["worker_id"] or "-",
            _clock(r["start_time"]),
            seconds,
            (r["error"] or "").splitlines()[0][:60] if r["error"] else "",
        )
    out.print(log)
    applications = {
        r["spark_application_id"]: r["spark_ui_url"] for r in recent if r["spark_application_id"]
    }
    for application, ui_url in applications.items():
        out.print(f"Spark application {application}: UI {ui_url or 'not recorded'}")
    if semaphores:
        table = Table(title="semaphores")
        for column in ("semaphore", "permits", "held"):
            table.add_column(column)
        for r in semaphores:
            table.add_row(r["semaphore_name"], str(r["permits"]), str(r["held"]))
        out.print(table)
