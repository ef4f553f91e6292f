"""What the demo shows on the terminal: live progress while the waves run, then the
``execution_log`` rows of the run and the final report's rows (rich)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from demo import runs
from scheduler_lib.broker import Broker
from scheduler_lib.scheduler import Completion, RunReport

STYLES = {"SUCCEEDED": "green", "FAILED": "red", "CANCELLED": "yellow"}


def console() -> Console:
    """Standard output; wide when it is not a terminal, so logs get whole rows."""
    out = Console(highlight=False)
    return out if out.is_terminal else Console(width=200, highlight=False)


class LiveProgress:
    """A progress bar over all tasks, naming the running wave, and a line per completion
    as it arrives. Without a terminal, the lines only.

    :param out: where to show it
    :param broker: to read how long each completed task ran
    :param waves: the tasks of each wave (their names)
    """

    def __init__(
        self, out: Console, broker: Broker, waves: Sequence[Sequence[Mapping[str, Any]]]
    ) -> None:
        self.out = out
        self.broker = broker
        self.names = [[str(t.get("name", t["kind"])) for t in wave] for wave in waves]
        self.done = [0] * len(waves)
        self.failed = False
        self.started = time.monotonic()
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=out,
            disable=not out.is_terminal,
        )
        self.bar = self.progress.add_task(f"wave 1/{len(waves)}", total=sum(len(w) for w in waves))

    def __enter__(self) -> LiveProgress:
        self.started = time.monotonic()
        self.progress.start()
        self._announce(1)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.progress.stop()

    def on_completion(self, wave: int, completion: Completion) -> None:
        """``run_waves``' callback: ``wave`` is the wave's number (the first is 1)."""
        run = None if completion.log_id is None else runs.fetch_one(self.broker, completion.log_id)
        seconds = "" if run is None or run.seconds is None else f"{run.seconds:6.2f} s"
        style = STYLES.get(completion.status, "white")
        name = escape(completion.task_name or str(completion.log_id))
        self._say(
            f"  wave {wave}  {name:<22} [{style}]{completion.status:<9}[/] {seconds}"
            + (f"  [red]{_first_line(completion.error)}[/]" if completion.error else "")
        )
        names = self.names[wave - 1]
        self.done[wave - 1] += 1
        self.failed = self.failed or not completion.ok
        self.progress.advance(self.bar)
        # After a failure nothing more is sent (fail fast): no next wave to announce.
        last = self.done[wave - 1] == len(names)
        if last and not self.failed and wave < len(self.names):
            self._announce(wave + 1)

    def _announce(self, wave: int) -> None:
        """Say that wave number ``wave`` (from 1) is sent."""
        count = len(self.names)
        names = self.names[wave - 1]
        self.progress.update(self.bar, description=f"wave {wave}/{count}")
        self._say(f"[bold]wave {wave}/{count}[/]: {len(names)} task(s) — " + ", ".join(names))

    def _say(self, text: str) -> None:
        self.out.print(f"[dim]{time.monotonic() - self.started:6.1f} s[/] {text}")


def print_runs(out: Console, task_runs: Sequence[runs.TaskRun]) -> None:
    """The run's ``execution_log`` rows; times in seconds since the first task was sent."""
    if not task_runs:
        out.print("execution_log: no rows")
        return
    origin = min(r.sent_at for r in task_runs)
    labels = runs.reader_labels(list(task_runs))
    table = Table(title="execution_log of this run (times: seconds since the first send)")
    for column in ("wave", "log id", "task", "status", "reader", "worker_id", "start", "end"):
        table.add_column(column, overflow="fold")
    table.add_column("seconds", justify="right")
    table.add_column("error", overflow="fold", max_width=60)
    for r in task_runs:
        started = r.worker_id is not None
        table.add_row(
            str(r.wave),
            str(r.log_id),
            escape(r.task_name),
            f"[{STYLES.get(r.status, 'white')}]{r.status}[/]",
            labels.get(r.reader or "", "-"),
            r.worker_id or "-",
            f"{r.start_time - origin:.2f}" if started else "-",
            "-" if r.end_time is None else f"{r.end_time - origin:.2f}",
            "-" if r.seconds is None else f"{r.seconds:.2f}",
            _first_line(r.error),
        )
    out.print(table)


def print_result(out: Console, title: str, result: Any) -> None:
    """A ``spark_sql`` task's collected rows (``{"columns": [...], "rows": [...]}``)."""
    if not isinstance(result, Mapping) or "rows" not in result:
        out.print(f"{title}: {result!r}")
        return
    columns = list(result.get("columns") or (result["rows"][0] if result["rows"] else []))
    first = result["rows"][0] if result["rows"] else {}
    table = Table(title=title)
    for column in columns:  # text to the left, numbers to the right
        table.add_column(column, justify="left" if isinstance(first.get(column), str) else "right")
    for row in result["rows"]:
        table.add_row(*(escape(_cell(row.get(c))) for c in columns))
    out.print(table)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "-" if value is None else str(value)


def _first_line(text: str | None) -> str:
    """An error's first line, shortened, safe to print as rich markup."""
    lines = (text or "").strip().splitlines()
    return escape(lines[0][:120]) if lines else ""


def verdict(run: RunReport) -> str:
    """How the run ended, in counts."""
    statuses = [c.status for c in run.completions]
    not_sent = sum(len(w.not_sent) for w in run.waves)
    return (
        f"{statuses.count('SUCCEEDED')} succeeded, {statuses.count('FAILED')} failed, "
        f"{statuses.count('CANCELLED')} cancelled, {not_sent} not sent"
    )
