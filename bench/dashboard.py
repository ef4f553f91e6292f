"""The picture of the Grafana dashboard in the docs (``docs/img/dashboard.png``), drawn from
a real run: the dashboard's own PromQL evaluated by a real Prometheus that scraped a real
``scheduler-lib serve`` while it ran waves of tasks.

Run from the repository root (about 100 s, a minute of it the workload)::

    .venv/bin/python -m bench.dashboard                  # SQLite in a temporary folder
    .venv/bin/python -m bench.dashboard --db postgresql+psycopg://...   # an empty database

It needs ``prometheus`` on the PATH (Debian: ``apt-get install prometheus``; only the
binary is used, as a process of this script's own, never the system service) and
matplotlib (the ``demo`` extra).

What it does, in order: ``scheduler-lib init``, a second target (``ServiceReports``, two
readers) and a semaphore (``warehouse``, two permits); ``scheduler-lib serve
--metrics-port 0`` and this process's own metrics (it runs the waves: their makespans,
its broker's sends); Prometheus scraping both every second into a temporary folder; the
workload (:func:`workload`: waves from three schedulers at once with a few failing tasks, a
backlog on the two-reader target, tasks queuing for the semaphore, messages held while a
queue is off); then, for every panel of ``docs/grafana/scheduler_lib.json``, its
expressions with the dashboard's variables substituted (``$job`` the job scraped,
``$instance`` and ``$queue`` all) through ``/api/v1/query_range``, drawn in the
dashboard's grid (24 columns) with each panel's title, unit and legend. Panels whose
metrics this build does not export yet say "No data", as Grafana does.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.processes import HarnessError, Processes, init, wait_for
from scheduler_lib.broker import Broker, Message, Transaction
from scheduler_lib.broker.poison import PoisonDetector, PoisonPolicy
from scheduler_lib.scheduler import Semaphores, Target, Task, TaskScheduler, metrics
from scheduler_lib.scheduler import init as init_scheduler

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docs" / "grafana" / "scheduler_lib.json"
PICTURE = ROOT / "docs" / "img" / "dashboard.png"
JOB = "scheduler-lib"
SCRAPE_INTERVAL = 1  # seconds
# What $__rate_interval becomes. Grafana makes it at least four scrape intervals and grows
# it with the time range; over a run of two minutes, windows of 10 s show the waves
# without drawing every scrape's jitter.
RATE_INTERVAL = "10s"
STEP = 1  # seconds between two points of a query_range
TAIL = 12.0  # seconds scraped after the workload, so the rates come back down
REPORTS = Target(service="ServiceReports", queue="QueueReports", max_readers=2)
SEMAPHORE, PERMITS = "warehouse", 2

# Grafana's dark theme, near enough
BACKGROUND, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3036"
PALETTE = [  # Grafana's classic palette
    "#7eb26d",
    "#eab839",
    "#6ed0e0",
    "#ef843c",
    "#e24d42",
    "#1f78c1",
    "#ba43a9",
    "#705da0",
    "#508642",
    "#cca300",
    "#447ebc",
    "#c15c17",
    "#890f02",
    "#0a437c",
    "#6d1f62",
    "#584477",
]
GRID_COLUMNS = 24
INCHES_PER_COLUMN = 0.8
INCHES_PER_ROW = 0.4  # one unit of gridPos.h (Grafana: 30 px + margin, a column ~79 px)


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def free_port() -> int:
    """A port free now on 127.0.0.1 (Prometheus cannot say which one it took)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def prometheus(folder: Path, *metrics_ports: int) -> Iterator[str]:
    """A Prometheus of our own scraping ``127.0.0.1:<each port>`` every second; yields its
    base URL and stops it when the block ends."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise HarnessError("no prometheus on the PATH (Debian: apt-get install prometheus)")
    config = folder / "prometheus.yml"
    targets = ", ".join(f"'127.0.0.1:{port}'" for port in metrics_ports)
    config.write_text(
        "global:\n"
        f"  scrape_interval: {SCRAPE_INTERVAL}s\n"
        f"  evaluation_interval: {SCRAPE_INTERVAL}s\n"
        "scrape_configs:\n"
        f"  - job_name: {JOB}\n"
        "    static_configs:\n"
        f"      - targets: [{targets}]\n"
    )
    port = free_port()
    log = (folder / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={folder / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:

        def alive() -> None:
            if process.poll() is not None:
                tail = (folder / "prometheus.log").read_text(errors="replace")[-2000:]
                raise HarnessError(f"prometheus exited with {process.returncode}:\n{tail}")

        wait_for(lambda: _get(f"{base}/-/ready") is not None, 60, "prometheus ready", check=alive)
        wait_for(
            lambda: instant(base, f'up{{job="{JOB}"}}') == 1.0,
            30,
            "prometheus's first scrape of serve",
            check=alive,
        )
        yield base
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)
        log.close()


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return bytes(response.read())
    except OSError:
        return None


def _api(base: str, path: str, **params: str) -> Any:
    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    body = _get(url)
    if body is None:
        raise HarnessError(f"prometheus did not answer {url}")
    answer = json.loads(body)
    if answer.get("status") != "success":
        raise HarnessError(f"prometheus refused {params}: {answer}")
    return answer["data"]


def instant(base: str, expr: str) -> float | None:
    """The value of a one-series expression now, or ``None``."""
    try:
        result = _api(base, "query", query=expr)["result"]
    except HarnessError:
        return None
    return float(result[0]["value"][1]) if result else None


def workload(broker: Broker) -> None:
    """About a minute of work that moves every panel this build can fill:

    - waves: three schedulers at once on the default target (four readers), six rounds of
      three waves of ``time:sleep`` tasks, each round with a task that fails
      (``math:sqrt`` of -1);
    - backlog: 24 tasks of 1.5 s at once to ``ServiceReports`` (two readers): ready
      messages pile up and the oldest one ages while they drain;
    - semaphore: 10 tasks of 2.5 s on the default target holding ``warehouse`` (two permits);
    - held: ``QueueReports`` turned off for 15 s while 6 tasks are sent to it, then on;
    - poison: on a queue of its own (``Inbox``), a handler that fails on one message of
      each of four rounds: a detector with a threshold of 3 routes it (``log``); then five
      rolled-back RECEIVEs in a row turn the queue off (built-in detection) for 10 s.
    """

    def waves(who: int) -> None:
        scheduler = TaskScheduler(broker)
        for round_ in range(6):
            plan = [
                [Task.python("time:sleep", 0.3 + 0.2 * (i % 4)) for i in range(6)],
                [Task.python("time:sleep", 1.0 + 0.5 * who), Task.python("math:sqrt", -1.0)],
                [Task.python("time:sleep", 0.1) for _ in range(3)],
            ]
            scheduler.run_waves(plan, policy="continue")
            say(f"scheduler {who}: round {round_ + 1} of 6 done")

    def backlog() -> None:
        tasks = [Task.python("time:sleep", 1.5, name=f"report {i}") for i in range(24)]
        TaskScheduler(broker).run_waves([tasks], target=REPORTS.service, policy="continue")
        say("backlog on QueueReports drained")

    def semaphore() -> None:
        tasks = [Task.python("time:sleep", 2.5, semaphore=SEMAPHORE) for _ in range(10)]
        TaskScheduler(broker).run_waves([tasks], policy="continue")
        say(f"semaphore {SEMAPHORE!r} tasks done")

    def held() -> None:
        broker.alter_queue(REPORTS.queue, status=False)
        say(f"{REPORTS.queue} off")
        sender = _thread(
            lambda: TaskScheduler(broker).run_waves(
                [[Task.python("time:sleep", 0.5) for _ in range(6)]], target=REPORTS.service
            ),
            failures,
        )
        time.sleep(15)  # what is shown: messages held for that long
        broker.alter_queue(REPORTS.queue, status=True)
        say(f"{REPORTS.queue} on again")
        sender.join()

    def poison() -> None:
        broker.create_message_type("Mail")
        broker.create_contract("MailContract", {"Mail": "INITIATOR"})
        broker.create_queue("Outbox")
        broker.create_queue("Inbox")
        broker.create_service("Sender", "Outbox")
        broker.create_service("Mailbox", "Inbox", ["MailContract"])

        def mail(*bodies: str) -> None:
            for body in bodies:
                handle = broker.begin_dialog("Sender", "Mailbox", "MailContract")
                broker.send(handle, "Mail", body)

        def handler(tx: Transaction, message: Message) -> None:
            if message.text == "bad":
                raise ValueError("cannot parse it")

        broker.alter_queue("Inbox", poison_message_handling=False)
        detector = PoisonDetector(broker, "Inbox", PoisonPolicy(threshold=3))
        for _ in range(4):
            mail("good", "bad", "good")
            while detector.handle_next(handler, timeout=0):
                time.sleep(0.5)
        broker.alter_queue("Inbox", poison_message_handling=True)
        mail("bad")
        for _ in range(5):  # built-in detection: the fifth rollback in a row turns it off
            with contextlib.suppress(ValueError), broker.transaction() as tx:
                for message in tx.receive("Inbox", timeout=0):
                    handler(tx, message)
            time.sleep(1)
        say(f"Inbox off: {broker.queue('Inbox').disabled_reason}")
        time.sleep(10)
        broker.alter_queue("Inbox", status=True, poison_message_handling=False)

    failures: list[BaseException] = []
    phases = [_thread(functools.partial(waves, who), failures) for who in range(3)]
    time.sleep(10)
    phases.append(_thread(backlog, failures))
    time.sleep(10)
    phases.append(_thread(semaphore, failures))
    time.sleep(25)
    phases.append(_thread(held, failures))
    phases.append(_thread(poison, failures))
    for thread in phases:
        thread.join()
    if failures:  # a picture of a broken run is no picture of the product
        raise HarnessError(f"the workload failed: {failures[0]!r}") from failures[0]


def _thread(target: Callable[[], object], failures: list[BaseException]) -> threading.Thread:
    """``target`` in a thread of its own; what it raises is said and kept in ``failures``."""

    def run() -> None:
        try:
            target()
        except Exception as exc:  # said at once; the caller raises once all have ended
            failures.append(exc)
            say(f"workload thread failed: {type(exc).__name__}: {exc}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """The expression as Grafana sends it with these values of the variables."""
    for name in sorted(variables, key=len, reverse=True):  # $instance before $i...
        expr = expr.replace(f"${{{name}}}", variables[name]).replace(f"${name}", variables[name])
    return expr


def legend(fmt: str, labels: Mapping[str, str]) -> str:
    """A legendFormat with ``{{label}}`` filled in (Grafana's rule)."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


Series = tuple[str, list[float], list[float]]  # legend, times, values


def query_panels(
    base: str, dashboard: Mapping[str, Any], start: float, end: float
) -> dict[int, list[list[Series]]]:
    """Every panel's targets through query_range: panel id -> per target, its series."""
    variables = {
        "job": JOB,
        "instance": ".*",
        "queue": ".*",
        "__rate_interval": RATE_INTERVAL,
        "datasource": "prometheus",
    }
    grid = [start + i * STEP for i in range(int((end - start) // STEP) + 1)]
    found: dict[int, list[list[Series]]] = {}
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        found[panel["id"]] = []
        for target in panel["targets"]:
            data = _api(
                base,
                "query_range",
                query=substitute(target["expr"], variables),
                start=str(start),
                end=str(end),
                step=str(STEP),
            )
            found[panel["id"]].append(
                [
                    (legend(target.get("legendFormat", ""), s["metric"]), grid, _on(grid, s))
                    for s in data["result"]
                ]
            )
    return found


def _on(grid: list[float], series: Mapping[str, Any]) -> list[float]:
    """A series' values at every step, NaN where it had none (a gap is drawn as a gap,
    as Grafana does, not as a line from the point before to the point after)."""
    values = {round(float(t), 3): float(v) for t, v in series["values"]}
    return [values.get(round(t, 3), math.nan) for t in grid]


def formatter(unit: str) -> Callable[..., str]:
    """Grafana's units, the ones the dashboard uses."""

    def fmt(value: float, _: object = None) -> str:
        if not math.isfinite(value):
            return ""
        if unit == "s":
            return f"{value * 1000:.0f} ms" if 0 < abs(value) < 1 else f"{value:g} s"
        if unit == "ops":
            return f"{value:g}/s"
        if unit == "percentunit":
            return f"{value * 100:.0f}%"
        if unit == "bytes":
            return f"{value / 2**20:.0f} MiB"
        return f"{value:g}"

    return fmt


def draw(
    dashboard: Mapping[str, Any], data: Mapping[int, list[list[Series]]], title: str, out: Path
) -> None:
    """The panels in the dashboard's grid, as Grafana lays them out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    header = 1.5  # grid units above the panels for the title line
    width, height = GRID_COLUMNS * INCHES_PER_COLUMN, (rows + header) * INCHES_PER_ROW
    fig = plt.figure(figsize=(width, height), facecolor=BACKGROUND)
    fig.text(0.005, 1 - 0.6 / (rows + header), title, color=TEXT, fontsize=11, va="center")

    def box(grid: Mapping[str, int]) -> tuple[float, float, float, float]:
        x, w = grid["x"] / GRID_COLUMNS, grid["w"] / GRID_COLUMNS
        top = (grid["y"] + header) / (rows + header)
        return x, 1 - top - grid["h"] / (rows + header), w, grid["h"] / (rows + header)

    pad_x, pad_y = 0.003, 0.002
    for panel in panels:
        x, y, w, h = box(panel["gridPos"])
        if panel["type"] == "row":
            fig.text(x + pad_x, y + h / 2, panel["title"], color=TEXT, fontsize=10,
                     weight="bold", va="center")  # fmt: skip
            continue
        frame = fig.add_axes((x + pad_x, y + pad_y, w - 2 * pad_x, h - 2 * pad_y))
        frame.set_facecolor(PANEL)
        frame.set_xticks([])
        frame.set_yticks([])
        for spine in frame.spines.values():
            spine.set_color(GRID)
        frame.text(0.01, 0.985, panel["title"], transform=frame.transAxes, color=TEXT,
                   fontsize=8.5, weight="bold", va="top")  # fmt: skip
        series = [s for per_target in data[panel["id"]] for s in per_target]
        defaults = panel["fieldConfig"]["defaults"]
        if not series:
            frame.text(0.5, 0.5, "No data", transform=frame.transAxes, color="#8e8e8e",
                       fontsize=10, ha="center", va="center")  # fmt: skip
            continue
        right = any(  # a right axis needs room for its labels
            prop["value"] == "right"
            for override in panel["fieldConfig"].get("overrides", [])
            for prop in override["properties"]
        )
        inner = (
            x + pad_x + 0.035 * w,
            y + pad_y + 0.3 * h,
            w * (0.86 if right else 0.93),
            h * 0.55,
        )
        if panel["type"] == "stat":
            _stat(fig, (x + pad_x, y + pad_y, w - 2 * pad_x, h * 0.8), series, defaults)
            continue
        ax = fig.add_axes(inner, facecolor=PANEL)
        _timeseries(ax, panel, series, mdates)
        handles, labels = ax.get_legend_handles_labels()
        for twin in ax.get_shared_x_axes().get_siblings(ax):
            if twin is not ax:
                more = twin.get_legend_handles_labels()
                handles, labels = handles + more[0], labels + more[1]
        columns = max(1, min(len(labels), int(panel["gridPos"]["w"] / 2.6)))
        frame.legend(handles, labels, loc="lower left", ncol=columns, fontsize=6.5,
                     frameon=False, labelcolor=TEXT, handlelength=1.2,
                     columnspacing=1.0, borderaxespad=0.2)  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=BACKGROUND)
    plt.close(fig)


def _timeseries(ax: Any, panel: Mapping[str, Any], series: list[Series], mdates: Any) -> None:
    defaults = panel["fieldConfig"]["defaults"]
    custom = defaults.get("custom", {})
    right = {
        o["matcher"]["options"]: {p["id"]: p["value"] for p in o["properties"]}
        for o in panel["fieldConfig"].get("overrides", [])
    }
    stacked = custom.get("stacking", {}).get("mode") == "normal"
    twin = None
    bottom: dict[float, float] = {}
    for i, (name, times, values) in enumerate(series):
        color = PALETTE[i % len(PALETTE)]
        when = [datetime.fromtimestamp(t, timezone.utc) for t in times]
        override = right.get(name, {})
        target = ax
        if override.get("custom.axisPlacement") == "right":
            twin = twin or ax.twinx()
            target = twin
            target.yaxis.set_major_formatter(formatter(override.get("unit", "none")))
        if stacked:
            base = [bottom.get(t, 0.0) for t in times]
            top = [
                b + v for b, v in zip(base, values, strict=True)
            ]  # NaN where the series has none
            target.fill_between(when, base, top, color=color, alpha=0.25, linewidth=0)
            target.plot(when, top, color=color, linewidth=1, label=name)
            bottom.update((t, v) for t, v in zip(times, top, strict=True) if math.isfinite(v))
        else:
            target.plot(when, values, color=color, linewidth=1, label=name)
    if custom.get("scaleDistribution", {}).get("type") == "log":
        ax.set_yscale("log")
    elif "min" in defaults:
        for axis in filter(None, (ax, twin)):  # all zero: 0 to 1, as Grafana draws it
            drawn = [float(v) for line in axis.get_lines() for v in line.get_ydata()]
            highest = max((v for v in drawn if math.isfinite(v)), default=0.0)
            axis.set_ylim(bottom=defaults["min"], top=None if highest > defaults["min"] else 1)
    for axis in filter(None, (ax, twin)):
        axis.set_facecolor(PANEL)
        axis.tick_params(colors=TEXT, labelsize=6.5, length=2)
        for spine in axis.spines.values():
            spine.set_visible(False)
    ax.grid(color=GRID, linewidth=0.5)
    ax.yaxis.set_major_formatter(formatter(defaults.get("unit", "none")))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=timezone.utc))
    ax.xaxis.set_major_locator(mdates.AutoDateLocator(maxticks=5))


def _stat(
    fig: Any, rect: tuple[float, float, float, float], series: list[Series], defaults: Any
) -> None:
    """One tile per series: its last value (mapped, coloured) over its sparkline."""
    texts = {k: v for m in defaults.get("mappings", []) for k, v in m["options"].items()}
    x, y, w, h = rect
    tile_w = w / len(series)
    for i, (name, times, values) in enumerate(series):
        last = next((v for v in reversed(values) if math.isfinite(v)), math.nan)
        mapped = texts.get(f"{last:g}", {})
        color = {"green": "#1a7f37", "red": "#c4162a"}.get(mapped.get("color", ""), "#3d71d9")
        ax = fig.add_axes((x + i * tile_w + 0.002, y + 0.004, tile_w - 0.004, h * 0.85))
        ax.set_facecolor(color)
        ax.plot(times, values, color="white", alpha=0.35, linewidth=1)
        seen = [v for v in values if math.isfinite(v)] or [0.0]
        low, high = min(seen), max(seen)
        ax.set_ylim(low - 0.1 - (high - low), high + 0.1 + (high - low))
        ax.set_xticks([])
        ax.set_yticks([])
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.text(0.5, 0.72, name, transform=ax.transAxes, ha="center", color="white", fontsize=7)
        shown = mapped.get("text", formatter(defaults.get("unit", "none"))(last))
        ax.text(0.5, 0.38, shown, transform=ax.transAxes, ha="center", va="center",
                color="white", fontsize=14, weight="bold")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dashboard", description=__doc__)
    parser.add_argument("--db", help="an empty database's URL (default: SQLite, temporary)")
    parser.add_argument("--out", type=Path, default=PICTURE, help=f"default: {PICTURE}")
    args = parser.parse_args(argv)
    dashboard = json.loads(DASHBOARD.read_text())
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dashboard-") as tmp:
        folder = Path(tmp)
        url = args.db or f"sqlite:///{folder / 'broker.db'}"
        say("scheduler-lib init")
        init(url)
        with Broker(url) as broker, Processes(folder) as processes, ExitStack() as stack:
            init_scheduler(broker, targets=[Target(), REPORTS])
            Semaphores(broker).create(SEMAPHORE, PERMITS)
            serve = processes.start("serve", "serve", "--db", url, "--metrics-port", "0")
            processes.wait_said(serve, "health on /healthz", 60)
            said = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/", processes.stdout(serve))
            if said is None:
                raise HarnessError(f"serve did not say its port:\n{processes.output(serve)}")
            # This process runs the waves: it serves their makespans (and its broker's
            # sends), as an application that embeds the scheduler would.
            here = stack.enter_context(metrics.serving(broker, 0, {}))[1]
            say(f"serve's metrics on port {said.group(1)}, this process's on {here}")
            with prometheus(folder, int(said.group(1)), here) as base:
                version = _api(base, "status/buildinfo")["version"]
                start = time.time() - 5
                say("workload: waves, a backlog, a semaphore, a queue off (about a minute)")
                workload(broker)
                say(f"workload done; {TAIL:g} s more of scrapes")
                time.sleep(TAIL)
                end = time.time()
                data = query_panels(base, dashboard, start, end)
        backend = "PostgreSQL" if url.startswith("postgresql") else "SQLite"
        day = datetime.fromtimestamp(end, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        title = (
            f"{dashboard['title']} — python -m bench.dashboard, {day}: one scheduler-lib serve "
            f"on {backend} and the process sending the waves, Prometheus {version} scraping "
            f"every {SCRAPE_INTERVAL} s, "
            f"$__rate_interval = {RATE_INTERVAL}; job={JOB}, instance=All, queue=All"
        )
        draw(dashboard, data, title, args.out)
    empty = [
        p["title"] for p in dashboard["panels"] if p["type"] != "row" and not any(data[p["id"]])
    ]
    say(f"wrote {args.out} in {time.monotonic() - started:.0f} s")
    if empty:
        say(f"no data (metrics this build does not export yet?): {', '.join(empty)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
