"""What ``scheduler-lib serve`` and ``scheduler-lib worker`` show an operator without SQL:
Prometheus metrics at ``/metrics`` and a health check at ``/healthz`` (``--metrics-port``).

The gauges are read from the database at each scrape (one read-only snapshot, mostly
index ranges, as a Prometheus exporter for a database does), so every process serving them
shows the same broker — the queues, leases, readers and open tasks of all processes, not
only its own — and a scrape costs nothing between scrapes. The tasks a process ran
(:data:`LOCAL`) and its CPU, memory and file descriptors (``prometheus_client``'s process
collector) are its own.

Why ``prometheus_client``: ``/metrics`` is a pull endpoint in Prometheus's exposition
format, which is what that client library exists to serve (the OpenTelemetry SDK serves
it only through an exporter built on this same library). OpenTelemetry users reach these
metrics through the OpenTelemetry Collector's ``prometheus`` receiver scraping this
endpoint (docs/operations.md, "Metrics and health").
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    make_wsgi_app,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from scheduler_lib.broker import Broker, counters, exceptions
from scheduler_lib.scheduler import catalog

log = logging.getLogger(__name__)

PREFIX = "scheduler_lib"
MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode
DEFAULT_HOST = "127.0.0.1"
# A check that names what is wrong: (healthy, what it saw)
Check = Callable[[], tuple[bool, str]]


# What this process's executors did: each process serving /metrics shows its own, and
# Prometheus adds them up across processes (these are counts of events, which the
# database does not keep: a finished task leaves only its row).
LOCAL = CollectorRegistry()
TASKS_FINISHED = Counter(
    f"{PREFIX}_tasks_finished",
    "tasks this process ran to an end, by how they ended",
    ["queue", "kind", "status"],
    registry=LOCAL,
)
TASK_DURATION = Histogram(
    f"{PREFIX}_task_duration_seconds",
    "how long this process's tasks ran (start to end, before the answer's commit)",
    ["queue", "kind"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600),
    registry=LOCAL,
)
DISPATCH_LATENCY = Histogram(
    f"{PREFIX}_task_dispatch_latency_seconds",
    "from the task's arrival on its queue to its start in this process",
    ["queue", "kind"],
    buckets=(0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
    registry=LOCAL,
)


WAVE_MAKESPAN = Histogram(
    f"{PREFIX}_wave_makespan_seconds",
    "waves run by this process (TaskScheduler.run_waves, `scheduler-lib run`): from the "
    "wave's first send to its last answer",
    ["target"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600),
    registry=LOCAL,
)


def wave_finished(target: str, makespan: float) -> None:
    """Count a wave this process ran to its end."""
    WAVE_MAKESPAN.labels(target).observe(max(0.0, makespan))


def task_finished(
    queue: str, kind: str, status: str, duration: float, dispatch_latency: float
) -> None:
    """Count a task this process ran to an end (its outcome committed)."""
    finished, took, waited = _task_series(queue, kind, status)
    finished.inc()
    took.observe(max(0.0, duration))
    waited.observe(max(0.0, dispatch_latency))


@functools.lru_cache(maxsize=4096)
def _task_series(queue: str, kind: str, status: str) -> tuple[Any, Any, Any]:
    # A task's end is on the executor's path: the labelled series are looked up once
    # (``labels()`` validates and locks, a few microseconds each time).
    return (
        TASKS_FINISHED.labels(queue, kind, status),
        TASK_DURATION.labels(queue, kind),
        DISPATCH_LATENCY.labels(queue, kind),
    )


class _Local(Collector):
    """The process's own counters (:data:`LOCAL`, and its broker's
    :data:`~scheduler_lib.broker.counters.REGISTRY`) in a served registry, with those of
    its reader processes added (``processes``: their directory, :func:`reader_processes`).
    """

    def __init__(self, processes: str | None = None) -> None:
        self._processes = processes

    def collect(self) -> Iterable[Metric]:
        own = [*counters.REGISTRY.collect(), *LOCAL.collect()]
        if self._processes is None:
            return own
        theirs = {m.name: m for m in MultiProcessCollector(None, self._processes).collect()}
        added = [_added(m, theirs.pop(m.name)) if m.name in theirs else m for m in own]
        return added + list(theirs.values())


def _added(own: Metric, theirs: Metric) -> Metric:
    """One family: the same series' values added (counts and buckets are sums; the
    ``_created`` stamps are this process's)."""
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for sample in [*own.samples, *theirs.samples]:
        key = (sample.name, tuple(sorted(sample.labels.items())))
        if sample.name.endswith("_created"):
            values.setdefault(key, sample.value)
        else:
            values[key] = values.get(key, 0.0) + sample.value
    merged = Metric(own.name, own.documentation, own.type, own.unit)
    for (name, labels), value in values.items():
        merged.add_sample(name, dict(labels), value)
    return merged


@contextlib.contextmanager
def reader_processes() -> Iterator[str]:
    """While the block runs, processes this one spawns keep their counters in files of a
    temporary directory (prometheus_client's multiprocess mode, ``PROMETHEUS_MULTIPROC_DIR``
    — read when they import it), which :func:`serving` adds to this process's own:
    ``serve --readers process`` counts the tasks its reader processes ran. The counts of
    a reader that exited stay (they are counts)."""
    with tempfile.TemporaryDirectory(prefix="scheduler-lib-metrics-") as path:
        previous = os.environ.get(MULTIPROCESS_ENV)
        os.environ[MULTIPROCESS_ENV] = path
        try:
            yield path
        finally:
            if previous is None:
                os.environ.pop(MULTIPROCESS_ENV, None)
            else:
                os.environ[MULTIPROCESS_ENV] = previous


class BrokerCollector(Collector):
    """The broker's and the scheduler's state, read from the database at each scrape.

    :param broker: the broker whose database is read
    :param clock: seconds since the epoch (the ages are measured against it)
    """

    def __init__(self, broker: Broker, clock: Callable[[], float] = time.time) -> None:
        self._broker = broker
        self._clock = clock
        broker.use_queries(catalog.QUERIES)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        started = time.monotonic()
        now = self._clock()
        up = _gauge("database_up", "1 when this scrape could read the database, else 0")
        try:
            # One snapshot: the figures of one scrape are of one moment (a task leased is
            # a task running). No retry: a scrape during an outage says so at once
            # (database_up 0) instead of waiting for the database.
            with self._broker.snapshot() as tx:
                queues = tx.fetch("metrics_queues", now=now)
                held = tx.fetch("metrics_held")
                transmission = tx.fetch_one("metrics_transmission") or {}
                transport = tx.fetch("metrics_transport")
                # A broker made by `init --no-scheduler` has no tasks to show.
                scheduler = (
                    (tx.fetch("metrics_tasks_open"), tx.fetch("semaphore_list", now=now))
                    if tx.fetch_value("metrics_table_exists", name="execution_log")
                    else None
                )
        except Exception as exc:  # whatever it was, the scrape answers and says so
            if isinstance(exc, exceptions.ConnectionLost | exceptions.DatabaseUnavailable):
                log.debug("metrics: the database did not answer: %s", exc)
            else:
                log.warning("metrics: reading the database failed: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from _queue_metrics(queues, held, now)
        yield from _transport_metrics(transmission, transport, now)
        if scheduler is not None:
            yield from _scheduler_metrics(*scheduler)
        took = _gauge("scrape_duration_seconds", "how long reading the database took")
        took.add_metric([], time.monotonic() - started)
        yield took


def _scheduler_metrics(
    tasks: list[Mapping[str, Any]], semaphores: list[Mapping[str, Any]]
) -> Iterator[GaugeMetricFamily]:
    open_tasks = _gauge("tasks", "tasks queued or running now", ["status", "kind", "target"])
    for row in tasks:
        open_tasks.add_metric(
            [row["status"], row["task_kind"], row["target_service"]], row["tasks"]
        )
    yield open_tasks
    permits = _gauge("semaphore_permits", "how many may hold the semaphore", ["semaphore"])
    held = _gauge("semaphore_held", "how many hold the semaphore now", ["semaphore"])
    for row in semaphores:
        permits.add_metric([row["semaphore_name"]], row["permits"])
        held.add_metric([row["semaphore_name"]], row["held"])
    yield permits
    yield held


def _queue_metrics(
    rows: list[Mapping[str, Any]], held: list[Mapping[str, Any]], now: float
) -> Iterator[GaugeMetricFamily]:
    messages = _gauge(
        "queue_messages",
        "messages for the queue: ready to be received, leased to a worker running them, "
        "or held while the queue is off",
        ["queue", "state"],
    )
    held_by_queue = {row["to_queue_name"]: row["held"] for row in held}
    oldest = _gauge(
        "queue_oldest_message_age_seconds",
        "age of the oldest ready message (0 when none is ready)",
        ["queue"],
    )
    expired = _gauge(
        "queue_leases_expired",
        "leases past their expiry (their worker stopped renewing them)",
        ["queue"],
    )
    readers = _gauge("queue_readers", "activated readers running on the queue", ["queue"])
    max_readers = _gauge("queue_max_readers", "the queue's MAX_QUEUE_READERS", ["queue"])
    enabled = _gauge(
        "queue_enabled",
        "1 while the queue receives, 0 when it is off (poison message handling turns a queue off)",
        ["queue"],
    )
    for row in rows:
        queue = row["queue_name"]
        messages.add_metric([queue, "ready"], row["ready"])
        messages.add_metric([queue, "leased"], row["leased"])
        messages.add_metric([queue, "held"], held_by_queue.get(queue, 0))
        first = row["oldest_ready_at"]
        oldest.add_metric([queue], 0.0 if first is None else max(0.0, now - first))
        expired.add_metric([queue], row["leases_expired"])
        readers.add_metric([queue], row["readers"])
        max_readers.add_metric([queue], row["max_readers"])
        enabled.add_metric([queue], 1 if row["is_receive_enabled"] else 0)
    yield from (messages, oldest, expired, readers, max_readers, enabled)


def _transport_metrics(
    transmission: Mapping[str, Any], transport: list[Mapping[str, Any]], now: float
) -> Iterator[GaugeMetricFamily]:
    waiting = _gauge(
        "transmission_queue_messages", "messages waiting to be delivered to a remote broker"
    )
    waiting.add_metric([], transmission.get("waiting") or 0)
    oldest = _gauge(
        "transmission_queue_oldest_message_age_seconds",
        "age of the oldest message waiting for a remote broker (0 when none waits)",
    )
    first = transmission.get("oldest_at")
    oldest.add_metric([], 0.0 if first is None else max(0.0, now - first))
    connections = _gauge(
        "transport_connections", "live broker-to-broker connections", ["direction"]
    )
    corrupted = _gauge(
        "transport_corrupted_frames",
        "frames that failed their signature on the live connections",
        ["direction"],
    )
    for row in transport:
        connections.add_metric([row["direction"]], row["connections"])
        corrupted.add_metric([row["direction"]], row["corrupted"])
    yield from (waiting, oldest, connections, corrupted)


def _gauge(name: str, documentation: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", documentation, labels=list(labels))


def database_check(broker: Broker) -> Check:
    """Healthy while the database answers a query now (no retry)."""

    def check() -> tuple[bool, str]:
        try:
            with broker.snapshot() as tx:  # a long write elsewhere is no ill health
                tx.fetch("health_ping")
        except exceptions.BrokerError as exc:
            return False, str(exc).splitlines()[0]
        return True, "answers"

    return check


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds the process at exit


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds are not news."""


def wsgi_app(
    registry: CollectorRegistry, checks: Mapping[str, Check]
) -> Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]:
    """``/metrics`` (prometheus_client's own app: formats, compression) and ``/healthz``
    (200 when every check holds, else 503; JSON naming each check's finding)."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics(environ, start_response)
        if path == "/healthz":
            results = {}
            for name, check in checks.items():
                try:
                    ok, detail = check()
                except Exception as exc:  # a broken check is an unhealthy one, said
                    ok, detail = False, f"{type(exc).__name__}: {exc}"
                results[name] = {"ok": ok, "detail": detail}
            healthy = all(r["ok"] for r in results.values())
            body = json.dumps({"healthy": healthy, "checks": results}).encode()
            status = "200 OK" if healthy else "503 Service Unavailable"
            start_response(status, [("Content-Type", "application/json")])
            return [body]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"/metrics or /healthz\n"]

    return app


@contextlib.contextmanager
def serving(
    broker: Broker,
    port: int,
    checks: Mapping[str, Check],
    host: str = DEFAULT_HOST,
    processes: str | None = None,
) -> Iterator[tuple[str, int]]:
    """Serve ``/metrics`` and ``/healthz`` on ``host:port`` (port 0: any free one) in a
    daemon thread until the block ends; yields the address it listens on. ``processes``:
    the directory of :func:`reader_processes`, whose counts are added to this process's.

    :raises exceptions.InvalidArgument: when the address cannot be listened on
    """
    registry = CollectorRegistry()
    registry.register(BrokerCollector(broker))
    registry.register(_Local(processes))
    ProcessCollector(registry=registry)
    try:
        server = make_server(
            host, port, wsgi_app(registry, checks), _Server, handler_class=_QuietHandler
        )
    except OSError as exc:
        raise exceptions.InvalidArgument(
            f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}",
            hint="pick another --metrics-port (or stop what listens there)",
        ) from exc
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    try:
        yield str(server.server_address[0]), int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
