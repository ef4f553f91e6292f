"""Activation latency: from the first message on an idle activated queue to its reader's
receive, on PostgreSQL and SQLite.

Run from the repository root::

    .venv/bin/python -m bench.activation_latency            # full run (~70 s)
    .venv/bin/python -m bench.activation_latency --quick    # ~20 s smoke run

Per backend, a fresh database (PostgreSQL: created and afterwards dropped; SQLite: a file
in a temporary directory) with one message type, one contract, an initiator queue and
service, and a target queue with internal activation (``activation_status=True``,
``max_queue_readers=1``, procedure ``bench.activation_procedures.record_receives``) behind
the target service; one dialog between the two.

A child process (spawned, so a process of its own as ``scheduler-lib serve`` would be)
runs a broker and an ``ActivationRuntime`` with its default settings and thread readers.
The procedure receives one message at a time with a 0.2 s timeout and, for each, appends
a line to a file: the instant its receive returned and the message body (the sample
number); it returns after an empty receive, so the reader exits 0.2 s after its last
message. This process is the sender. Per sample it waits until the queue is idle — no
reader in ``activated_tasks()``, no ready message and, on PostgreSQL, the monitor
registered for NOTIFY again (``queues.waiting_receivers`` >= 1; after a reader exits the
monitor re-registers) — then 0.1..0.2 s more, sends one message, takes the time right
after ``send`` returned (just after its commit) and waits for the procedure's line.
Latency = receive returned minus send returned, both ``time.monotonic()`` (system-wide
CLOCK_MONOTONIC on Linux); the JSON also has the latency from before the ``send`` call.
The first --warmup (2) samples per backend are reported apart (the first activation
imports the procedure and opens connections).

Where the time goes: the runtime in the child is ``ActivationRuntime`` with timestamps
added around its methods (no behaviour changed), so every sample also splits into
  - notify: send returned -> the runtime's wake-up thread woke the monitor (PostgreSQL:
    the LISTEN thread got the NOTIFY, which can happen before send has returned in the
    sender, so this stage can be negative; SQLite: the watcher saw ``data_version``
    change);
  - monitor: -> the monitor thread began its check;
  - check: -> the check's transaction (lock the monitor row, read the queue, insert the
    activated task) committed;
  - thread: -> the reader thread ran;
  - procedure: -> the procedure was entered;
  - receive: -> its receive returned with the message.

Prints one JSON object on stdout, progress on stderr, and appends a dated section to
docs/benchmarks.md (unless --no-docs). Machine facts, database handling and the docs
section's helpers come from ``bench.broker_throughput``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from bench import activation_procedures
from bench.broker_throughput import (
    BUSY_WARNING_PCT,
    busy_pct,
    database,
    docs_section,
    finish_run,
    log,
    machine_facts,
    percentile,
)
from scheduler_lib.broker import Broker
from scheduler_lib.broker.activation import ActivationRuntime

MESSAGE_TYPE = "ActivationBenchRequest"
CONTRACT = "ActivationBenchContract"
INITIATOR_QUEUE = "ActivationBenchInitiatorQueue"
TARGET_QUEUE = "ActivationBenchTargetQueue"
INITIATOR_SERVICE = "ActivationBenchInitiator"
TARGET_SERVICE = "ActivationBenchTarget"
PROCEDURE = "bench.activation_procedures.record_receives"
IDLE_GAP = (0.1, 0.2)  # seconds of idle queue before each send, drawn uniformly
IDLE_TIMEOUT = 15.0  # seconds to wait for the queue to go idle before giving up
RECEIVE_WAIT_TIMEOUT = 15.0  # seconds to wait for the procedure's record of a sample
POLL = 0.005  # seconds between the sender's checks of the idle state and the out file
BACKENDS = ("postgresql", "sqlite")
# stage name -> (from stamp, to stamp); "committed" is the sender's, the rest the runtime's
STAGES = {
    "notify": ("committed", "woken"),
    "monitor": ("woken", "check_started"),
    "check": ("check_started", "check_committed"),
    "thread": ("check_committed", "reader_thread_started"),
    "procedure": ("reader_thread_started", "procedure_entered"),
    "receive": ("procedure_entered", "received"),
}
TARGETS = {"postgresql_p50_ms": (50.0, "<=")}


# --- the runtime process ---------------------------------------------------------------


class InstrumentedRuntime(ActivationRuntime):
    """``ActivationRuntime`` that timestamps a reader's way from wake-up to start into
    ``activation_procedures.STAMPS`` (one reader at a time here, max_queue_readers=1)."""

    WAKE_THREADS = ("broker-listen", "broker-sqlite-watch")

    def __init__(self, broker: Broker, **options: Any) -> None:
        super().__init__(broker, **options)
        self.last_woken: float | None = None
        self._check_started: float | None = None
        wakeups = broker.waiting.wakeups
        notify, notify_all = wakeups.notify, wakeups.notify_all

        def stamped_notify(queues: Any) -> None:
            if threading.current_thread().name in self.WAKE_THREADS and TARGET_QUEUE in queues:
                self.last_woken = time.monotonic()
            notify(queues)

        def stamped_notify_all() -> None:
            if threading.current_thread().name in self.WAKE_THREADS:
                self.last_woken = time.monotonic()
            notify_all()

        wakeups.notify = stamped_notify  # type: ignore[method-assign]
        wakeups.notify_all = stamped_notify_all  # type: ignore[method-assign]

    def check(self, queue: str) -> Any:
        self._check_started = time.monotonic()
        return super().check(queue)

    def _start_reader(self, task_id: str, queue: str, procedure: str) -> None:
        stamps = activation_procedures.STAMPS
        stamps.clear()
        stamps.update(
            woken=self.last_woken,
            check_started=self._check_started,
            check_committed=time.monotonic(),
        )
        super()._start_reader(task_id, queue, procedure)

    def _run_reader(self, task_id: str, queue: str, procedure: str) -> None:
        activation_procedures.STAMPS["reader_thread_started"] = time.monotonic()
        super()._run_reader(task_id, queue, procedure)


def runtime_main(url: str, out_path: str, ready: Any, stop: Any) -> None:
    """The child process: a broker and an instrumented activation runtime until ``stop``."""
    activation_procedures.OUT_PATH = out_path
    with Broker(url, migrate=False) as broker:
        runtime = InstrumentedRuntime(broker).start()
        try:
            ready.set()
            stop.wait()
        finally:
            runtime.stop(timeout=5)


@contextmanager
def runtime_process(url: str, out_path: str) -> Iterator[mp.process.BaseProcess]:
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    process = ctx.Process(
        target=runtime_main, args=(url, out_path, ready, stop), name="activation-runtime"
    )
    process.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the activation runtime process did not start")
        yield process
    finally:
        stop.set()
        process.join(15)
        if process.is_alive():
            process.terminate()
            process.join(5)


# --- the sender ------------------------------------------------------------------------


def setup(url: str) -> str:
    """Schema, catalog and one dialog; returns the initiator's handle."""
    with Broker(url, timers=False) as broker:
        broker.create_message_type(MESSAGE_TYPE)
        broker.create_contract(CONTRACT, {MESSAGE_TYPE: "INITIATOR"})
        broker.create_queue(INITIATOR_QUEUE)
        broker.create_queue(
            TARGET_QUEUE,
            activation_status=True,
            activation_procedure=PROCEDURE,
            max_queue_readers=1,
        )
        broker.create_service(INITIATOR_SERVICE, INITIATOR_QUEUE)
        broker.create_service(TARGET_SERVICE, TARGET_QUEUE, [CONTRACT])
        return str(broker.begin_dialog(INITIATOR_SERVICE, TARGET_SERVICE, CONTRACT))


class Idle:
    """The sender's view of whether the target queue is idle."""

    def __init__(self, broker: Broker, url: str) -> None:
        self.broker = broker
        self.pg = psycopg.connect(url, autocommit=True) if broker.dialect == "postgresql" else None

    def ready_messages(self) -> int:
        monitors = [m for m in self.broker.queue_monitors() if m["queue_name"] == TARGET_QUEUE]
        return int(monitors[0]["messages_ready"]) if monitors else 0

    def listening(self) -> bool:
        if self.pg is None:
            return True  # SQLite: the watcher thread needs no registration
        row = self.pg.execute(
            "SELECT waiting_receivers FROM queues WHERE queue_name = %s", (TARGET_QUEUE,)
        ).fetchone()
        return bool(row and row[0] >= 1)

    def wait(self, runtime: mp.process.BaseProcess) -> float:
        """Block until no reader runs, nothing is ready and (PostgreSQL) the monitor is
        registered for NOTIFY; returns how long that took."""
        t0 = time.monotonic()
        while True:
            if not runtime.is_alive():
                raise RuntimeError(f"the runtime process died (exit code {runtime.exitcode})")
            if (
                not self.broker.activated_tasks()
                and self.listening()
                and self.ready_messages() == 0
            ):
                return time.monotonic() - t0
            if time.monotonic() - t0 > IDLE_TIMEOUT:
                raise TimeoutError(f"the queue did not go idle in {IDLE_TIMEOUT} s")
            time.sleep(POLL)

    def close(self) -> None:
        if self.pg is not None:
            self.pg.close()


class Records:
    """Reads the procedure's out file as it grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.buffer = ""

    def next(self, runtime: mp.process.BaseProcess, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            if "\n" in self.buffer:
                line, self.buffer = self.buffer.split("\n", 1)
                return dict(json.loads(line))
            if self.path.exists():
                with self.path.open() as fh:
                    fh.seek(self.offset)
                    chunk = fh.read()
                    self.offset = fh.tell()
                self.buffer += chunk
                if chunk:
                    continue
            if not runtime.is_alive():
                raise RuntimeError(f"the runtime process died (exit code {runtime.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no receive recorded within {timeout} s")
            time.sleep(POLL / 5)


def run_samples(
    url: str, handle: str, out_path: Path, runtime: mp.process.BaseProcess, count: int, seed: int
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    records = Records(out_path)
    samples: list[dict[str, Any]] = []
    with Broker(url, migrate=False, timers=False) as broker:
        idle = Idle(broker, url)
        try:
            for i in range(count):
                waited = idle.wait(runtime)
                time.sleep(rng.uniform(*IDLE_GAP))
                called = time.monotonic()
                broker.send(handle, MESSAGE_TYPE, str(i).encode())
                committed = time.monotonic()
                record = records.next(runtime, RECEIVE_WAIT_TIMEOUT)
                if record["body"] != str(i):
                    raise RuntimeError(f"sample {i}: received {record['body']!r}")
                if record["pid"] == os.getpid():
                    raise RuntimeError("the reader ran in the sender's process")
                stamps = {
                    "called": called,
                    "committed": committed,
                    **record["stamps"],
                    "procedure_entered": record["procedure_entered"],
                    "received": record["received"],
                }
                samples.append(
                    {
                        "latency_ms": 1000 * (record["received"] - committed),
                        "latency_ms_from_send_call": 1000 * (record["received"] - called),
                        "send_ms": 1000 * (committed - called),
                        "waited_for_idle_s": waited,
                        "stages_ms": stages(stamps),
                    }
                )
        finally:
            idle.close()
    return samples


def stages(stamps: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, (start, end) in STAGES.items():
        a, b = stamps.get(start), stamps.get(end)
        out[name] = None if a is None or b is None else 1000 * (b - a)
    # The NOTIFY can reach the runtime before send returns in the sender, so "notify" may
    # be negative. A wake-up from before the send call (or none) did not come from this
    # message: the monitor found it some other way.
    woken = stamps.get("woken")
    if woken is None or woken < stamps["called"]:
        out["notify"] = out["monitor"] = None
    return out


def stats(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(percentile(values, 50), 2),
        "p90_ms": round(percentile(values, 90), 2),
        "p99_ms": round(percentile(values, 99), 2),
        "min_ms": round(min(values), 2),
        "max_ms": round(max(values), 2),
        "mean_ms": round(statistics.mean(values), 2),
    }


def summarize(samples: list[dict[str, Any]], warmup: list[dict[str, Any]]) -> dict[str, Any]:
    latencies = [s["latency_ms"] for s in samples]
    breakdown: dict[str, Any] = {}
    for name in STAGES:
        values = [s["stages_ms"][name] for s in samples if s["stages_ms"][name] is not None]
        breakdown[name] = (
            {
                "p50_ms": round(percentile(values, 50), 2),
                "p99_ms": round(percentile(values, 99), 2),
                "max_ms": round(max(values), 2),
            }
            if values
            else None
        )
    missed = sum(1 for s in samples if s["stages_ms"]["notify"] is None)
    return {
        "samples": len(samples),
        **stats(latencies),
        "from_send_call": {
            k: v
            for k, v in stats([s["latency_ms_from_send_call"] for s in samples]).items()
            if k in ("p50_ms", "p99_ms")
        },
        "send_ms_p50": round(percentile([s["send_ms"] for s in samples], 50), 2),
        "breakdown": breakdown,
        "samples_without_a_wakeup": missed,
        "latencies_ms": [round(x, 2) for x in latencies],
        "warmup_latencies_ms": [round(s["latency_ms"], 2) for s in warmup],
        "warmup_breakdown_ms": [
            {k: None if v is None else round(v, 2) for k, v in s["stages_ms"].items()}
            for s in warmup
        ],
    }


@contextmanager
def backend_database(backend: str) -> Iterator[str]:
    if backend == "postgresql":
        with database("activation") as url:
            yield url
    else:
        with tempfile.TemporaryDirectory(prefix="bench_activation_") as tmp:
            yield f"sqlite:///{tmp}/broker.db"


def measure(backend: str, samples: int, warmup: int) -> dict[str, Any]:
    with (
        backend_database(backend) as url,
        tempfile.TemporaryDirectory(prefix="bench_activation_out_") as tmp,
    ):
        handle = setup(url)
        out_path = Path(tmp) / "receives.jsonl"
        with runtime_process(url, str(out_path)) as runtime:
            results = run_samples(url, handle, out_path, runtime, warmup + samples, seed=1)
    summary = summarize(results[warmup:], results[:warmup])
    return summary


# --- report ----------------------------------------------------------------------------


def check_targets(report: dict[str, Any]) -> dict[str, Any]:
    values = {"postgresql_p50_ms": report["postgresql"]["p50_ms"]}
    out = {}
    for name, (target, op) in TARGETS.items():
        value = values[name]
        met = value >= target if op == ">=" else value <= target
        out[name] = {"value": value, "target": f"{op} {target} ms", "met": met}
    return out


def markdown_section(report: dict[str, Any]) -> str:
    c, t = report["config"], report["targets"]
    pg, lite = report["postgresql"], report["sqlite"]
    target = t["postgresql_p50_ms"]

    def breakdown(x: dict[str, Any]) -> str:
        return " / ".join(
            "-" if x["breakdown"][name] is None else str(x["breakdown"][name]["p50_ms"])
            for name in STAGES
        )

    rows: list[tuple[str, Any, str, str]] = [
        (
            "PostgreSQL: send committed -> reader's receive, p50 ms",
            pg["p50_ms"],
            target["target"],
            "met" if target["met"] else "**missed**",
        ),
        (
            "PostgreSQL: p90 / p99 / max ms",
            f"{pg['p90_ms']} / {pg['p99_ms']} / {pg['max_ms']}",
            "",
            "",
        ),
        ("SQLite: send committed -> reader's receive, p50 ms", lite["p50_ms"], "", ""),
        (
            "SQLite: p90 / p99 / max ms",
            f"{lite['p90_ms']} / {lite['p99_ms']} / {lite['max_ms']}",
            "",
            "",
        ),
        (
            "p50 from before the send call, ms, PostgreSQL / SQLite",
            f"{pg['from_send_call']['p50_ms']} / {lite['from_send_call']['p50_ms']}",
            "",
            "",
        ),
        (
            "stage p50 ms, " + " / ".join(STAGES) + ", PostgreSQL",
            breakdown(pg),
            "",
            "",
        ),
        ("the same, SQLite", breakdown(lite), "", ""),
        (
            "first activation after the runtime started (cold), ms, PostgreSQL / SQLite",
            f"{pg['warmup_latencies_ms'][0] if pg['warmup_latencies_ms'] else '-'} / "
            f"{lite['warmup_latencies_ms'][0] if lite['warmup_latencies_ms'] else '-'}",
            "",
            "",
        ),
    ]
    return docs_section(
        "activation_latency",
        report,
        f"{c['samples']['postgresql']} samples on PostgreSQL, {c['samples']['sqlite']} on "
        f"SQLite (after {c['warmup']} warm-up samples each): an idle queue with internal "
        "activation (max_queue_readers=1), an ActivationRuntime in another process, one "
        "message sent; latency from the sender's commit to the activated reader's receive. "
        "Design and stages in `bench/activation_latency.py`'s docstring.",
        rows,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.activation_latency", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="~30 s smoke run")
    parser.add_argument("--samples", type=int, help="PostgreSQL samples (default 100; quick 20)")
    parser.add_argument("--sqlite-samples", type=int, help="SQLite samples (default 60; quick 12)")
    parser.add_argument("--warmup", type=int, default=2, help="uncounted samples per backend")
    parser.add_argument(
        "--backend", choices=[*BACKENDS, "both"], default="both", help="what to measure"
    )
    parser.add_argument(
        "--wait-idle",
        type=float,
        metavar="SECONDS",
        help=f"first wait up to this long for the machine to be under {BUSY_WARNING_PCT}%% busy",
    )
    parser.add_argument("--no-docs", action="store_true", help="do not append to the docs")
    args = parser.parse_args(argv)
    quick = args.quick
    counts = {
        "postgresql": args.samples or (20 if quick else 100),
        "sqlite": args.sqlite_samples or (12 if quick else 60),
    }
    backends = BACKENDS if args.backend == "both" else (args.backend,)

    waiting = time.monotonic()
    idle_check = busy_pct(1.0)
    waited_until = time.monotonic() + (args.wait_idle or 0)
    while idle_check > BUSY_WARNING_PCT and time.monotonic() < waited_until:
        log(f"the machine is {idle_check}% busy; waiting for it to go quiet")
        idle_check = busy_pct(5.0)
    if idle_check > BUSY_WARNING_PCT:
        log(f"warning: the machine is {idle_check}% busy before the start; figures will be noisy")
    started = time.monotonic()
    report: dict[str, Any] = {
        "benchmark": "activation_latency",
        "started_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(
            [Path(sys.executable).name, "-m", "bench.activation_latency", *sys.argv[1:]]
        ),
        "quick": quick,
        "machine": machine_facts(),
        "config": {
            "samples": {b: counts[b] for b in backends},
            "warmup": args.warmup,
            "receive_timeout_s": activation_procedures.RECEIVE_TIMEOUT,
            "idle_gap_s": list(IDLE_GAP),
            "max_queue_readers": 1,
            "reader_mode": "thread",
        },
    }
    report["machine"]["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    report["machine"]["cpu_busy_pct_before_start"] = idle_check
    report["waited_for_quiet_s"] = round(started - waiting, 1)
    for backend in backends:
        log(f"{backend}: {args.warmup} warm-up + {counts[backend]} samples")
        result = measure(backend, counts[backend], args.warmup)
        report[backend] = result
        log(
            f"{backend}: p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms, "
            f"max {result['max_ms']} ms; stage p50s "
            + ", ".join(f"{k} {v['p50_ms'] if v else '-'}" for k, v in result["breakdown"].items())
        )
    if "postgresql" in backends:
        report["targets"] = check_targets(report)
    both = set(backends) == set(BACKENDS)
    if not args.no_docs and not both:
        log("one backend only: not appended to the docs")
    return finish_run(report, started, markdown_section if both and not args.no_docs else None)


if __name__ == "__main__":
    sys.exit(main())
