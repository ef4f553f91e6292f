"""Broker throughput benchmark on PostgreSQL.

Run from the repository root::

    .venv/bin/python -m bench.broker_throughput            # full run (~3.5 minutes)
    .venv/bin/python -m bench.broker_throughput --quick    # ~30 s smoke run

Measures, in one run, each in its own freshly created (and afterwards dropped) database:

(a) raw ceiling: --processes (4) client processes, each looping over one INSERT
    transaction and one ``DELETE ... FOR UPDATE SKIP LOCKED`` transaction per message on
    a bare table (psycopg directly, autocommit);
(b) the broker, structurally the same: --processes worker processes, each owning
    --conversations (64) / --processes conversations; one loop iteration = one
    ``broker.send`` (a transaction of its own; round robin over the worker's
    conversations) + one ``broker.receive(top=1, timeout=0)`` (a transaction of its own
    that commits). Receivers take whatever group is free (any worker's conversations);
(b2) the same, receiving with ``with broker.transaction() as tx: tx.receive(...)``, as a
    consumer that works on the message before committing does (reported, no target);
(c) the same as (b) with ``broker.receive(top=100)``: one iteration = one
    ``broker.transaction()`` of 100 sends on one conversation (a target conversation is
    its own conversation group, and RECEIVE returns one group's messages, so a batch must
    sit in one conversation) + one ``broker.receive(top=100)``;
(d) wake-up latency: an idle receiver process blocked in ``receive(timeout=5)`` and a sender
    process; latency = receiver's return minus the instant ``send`` returned in the sender
    (just after its commit), both read from the system-wide CLOCK_MONOTONIC. On a busy
    2-core machine the sender may be scheduled late, so a sample can come out negative;
    the JSON also has the latency from before the send call (an upper bound);
(e) receive(top=1) time with RETAINED ended conversations kept vs none: two databases set
    up alike, send+receive pairs in one process, the receive part timed, alternating
    pair by pair between the two databases. The retained conversations are what the API
    leaves when the target ends a conversation the initiator has not ended: a target
    endpoint in DO and an initiator endpoint in DI on the measured services, their groups,
    and one unreceived EndDialog per conversation on the initiator queue (100,000
    unreceived messages on a queue other than the one received from). The first 1,000 are
    built through the public API in transactions of 500 (begin_dialog, send, receive,
    end_conversation) and timed; the rest are copies of exactly those rows with fresh ids
    (INSERT ... SELECT), because the API rate would not fit the time budget (the JSON
    reports the rate and the extrapolated time). Both databases then get VACUUM ANALYZE
    (what autovacuum would have done) and a CHECKPOINT before the timed receives.

(a), (b), (b2) and (c) run in --rounds rounds that take turns (a b b2 c, b b2 c a, ...),
so that load from elsewhere on the machine drifts into all of them alike; the JSON has
each round's rate and a breakdown of the machine's CPU (this run's processes, their
backends, foreign work). Throughput is messages received per second, summed over the
processes; each worker times its own window after all reached a common start line.
Statements per transaction come from psycopg's Cursor.execute in the worker, round trips
from psycopg's Connection.wait (BEGIN and COMMIT included), both counted on the worker's
main thread only (not the broker's timer and LISTEN threads) during its warm-up.

Prints one JSON object on stdout, progress on stderr, and appends a dated section to
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import math
import multiprocessing as mp
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

from scheduler_lib.broker import Broker

ADMIN_URL = os.environ.get(
    "SCHEDULER_LIB_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "benchmarks.md"
DOCS_HEADER = """# Benchmarks

Sections below are appended by the benchmark scripts in `bench/`; each records the exact
command, the machine, the figures and the targets. Do not edit the generated sections.
"""

MESSAGE_TYPE = "BenchRequest"
CONTRACT = "BenchContract"
INITIATOR_QUEUE = "BenchInitiatorQueue"
TARGET_QUEUE = "BenchTargetQueue"
INITIATOR_SERVICE = "BenchInitiator"
TARGET_SERVICE = "BenchTarget"
BODY = b"x" * 100  # the payload of every message, broker and raw alike
BATCH = 100  # (c): sends per send transaction and receive TOP
WARMUP_ITERATIONS = 20  # per worker, before the timed window; statements are counted here
# broker measurements: phase -> (receive TOP, receive inside broker.transaction())
PHASES = {"b": (1, False), "b2": (1, True), "c": (BATCH, False)}
BUSY_WARNING_PCT = 15  # machine CPU busy before the start above which the figures are noisy
FOREIGN_WARNING_PCT = 10  # CPU share of other work during a measurement worth a warning
START_TIMEOUT = 300.0  # seconds a worker waits for the others at the start line

TARGETS = {
    "b_over_a": (0.5, ">="),
    "c_over_b": (3.0, ">="),
    "d_p50_ms": (5.0, "<="),
    "e_ratio": (1.2, "<="),
}


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- databases -------------------------------------------------------------------------


def db_url(name: str) -> str:
    return sa.make_url(ADMIN_URL).set(database=name).render_as_string(hide_password=False)


@contextmanager
def database(tag: str) -> Iterator[str]:
    """A fresh, uniquely named database; dropped afterwards. Yields its URL."""
    name = f"bench_broker_{tag}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield db_url(name)
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def setup_broker(url: str, conversations: int) -> list[str]:
    """Schema, catalog and ``conversations`` dialogs, each with its target endpoint in
    place (one message sent and received), so the timed loops see steady-state
    conversations. Returns the initiator handles."""
    with Broker(url) as broker:
        broker.create_message_type(MESSAGE_TYPE)
        broker.create_contract(CONTRACT, {MESSAGE_TYPE: "INITIATOR"})
        broker.create_queue(INITIATOR_QUEUE)
        broker.create_queue(TARGET_QUEUE)
        broker.create_service(INITIATOR_SERVICE, INITIATOR_QUEUE)
        broker.create_service(TARGET_SERVICE, TARGET_QUEUE, [CONTRACT])
        with broker.transaction() as tx:
            handles = [
                str(tx.begin_dialog(INITIATOR_SERVICE, TARGET_SERVICE, CONTRACT))
                for _ in range(conversations)
            ]
            for handle in handles:
                tx.send(handle, MESSAGE_TYPE, BODY)
        received = 0
        while received < conversations:
            got = broker.receive(TARGET_QUEUE, top=BATCH, timeout=0)
            if not got:
                raise RuntimeError("setup: priming messages did not arrive")
            received += len(got)
    return handles


# --- worker processes ------------------------------------------------------------------


class Workers:
    """A pool of spawned worker processes, reused by every measurement, and a manager for
    the start-line barriers and queues they share."""

    def __init__(self, processes: int) -> None:
        ctx = mp.get_context("spawn")
        self.manager = ctx.Manager()
        self.pool = ctx.Pool(processes)
        self.processes = processes

    def run(
        self, target: Callable[..., Any], args_list: list[tuple[Any, ...]], timeout: float
    ) -> list[Any]:
        """``target(*args)`` in a worker for each args, concurrently; their results."""
        if len(args_list) > self.processes:
            raise ValueError("more tasks than worker processes")
        pending = [self.pool.apply_async(target, args) for args in args_list]
        deadline = time.monotonic() + timeout
        while not all(p.ready() for p in pending):
            for p in pending:
                if p.ready() and not p.successful():
                    p.get()  # raises the worker's exception (the others wait at the start)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target.__name__} workers did not finish in {timeout} s")
            time.sleep(0.1)
        return [p.get() for p in pending]

    def barrier(self, parties: int) -> Any:
        return self.manager.Barrier(parties)

    def queue(self) -> Any:
        return self.manager.Queue()

    def close(self) -> None:
        self.pool.close()
        self.pool.join()
        self.manager.shutdown()

    def terminate(self) -> None:
        self.pool.terminate()
        self.pool.join()
        self.manager.shutdown()


class StatementCounter:
    """Counts, for the calling thread only (not the broker's timer and LISTEN threads):
    SQL statements sent through psycopg cursors (whether SQLAlchemy or the broker's
    driver-level fast path runs them; BEGIN and COMMIT are not statements here), pool
    checkouts on the engines given, and round trips to the server (psycopg
    ``Connection.wait`` calls that had to wait for the network, plus the BEGIN psycopg
    sends ahead of the first statement outside autocommit). It patches psycopg's classes
    while the counter is open."""

    def __init__(self, *engines: sa.Engine | None) -> None:
        self.engines = [e for e in engines if e is not None]
        self.thread = threading.get_ident()
        self.statements: list[str] = []
        self.checkouts = 0
        self.round_trips = 0
        self._wait = psycopg.Connection.wait
        self._execute = psycopg.Cursor.execute

    def _on_checkout(self, *_args: Any) -> None:
        if threading.get_ident() == self.thread:
            self.checkouts += 1

    def _counted(self, gen: Any, begins: bool) -> Any:
        """``gen``, counting one round trip if it ever waits for the socket, and one more
        when it ``begins`` (psycopg sends BEGIN first, inside the same generator)."""
        try:
            state = next(gen)
        except StopIteration as stop:
            return stop.value
        self.round_trips += 2 if begins else 1
        while True:
            ready = yield state
            try:
                state = gen.send(ready)
            except StopIteration as stop:
                return stop.value

    def __enter__(self) -> StatementCounter:
        for engine in self.engines:
            sa.event.listen(engine.pool, "checkout", self._on_checkout)
        counter, wait, execute = self, self._wait, self._execute

        def counting_execute(cursor: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == counter.thread:
                counter.statements.append(" ".join(str(query).split()))
            return execute(cursor, query, *args, **kwargs)

        psycopg.Cursor.execute = counting_execute  # type: ignore[method-assign]

        def counting_wait(conn: Any, gen: Any, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == counter.thread:
                idle = conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
                gen = counter._counted(gen, idle and not conn.autocommit)
            return wait(conn, gen, *args, **kwargs)

        psycopg.Connection.wait = counting_wait  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        psycopg.Connection.wait = self._wait  # type: ignore[method-assign]
        psycopg.Cursor.execute = self._execute  # type: ignore[method-assign]
        for engine in self.engines:
            sa.event.remove(engine.pool, "checkout", self._on_checkout)

    def take(self) -> tuple[list[str], int, int]:
        taken = self.statements, self.checkouts, self.round_trips
        self.statements, self.checkouts, self.round_trips = [], 0, 0
        return taken


def machine_busy() -> tuple[float, float, float]:
    """(busy, total, steal) CPU seconds of the whole machine so far, from /proc/stat."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:9]]
    except OSError:
        return (0.0, 0.0, 0.0)
    tick = os.sysconf("SC_CLK_TCK")
    total = sum(fields)
    idle = fields[3] + fields[4]  # idle and iowait
    return ((total - idle) / tick, total / tick, fields[7] / tick)


def our_backends(url: str) -> set[int]:
    """The pids of the PostgreSQL backends connected to ``url``'s database."""
    with psycopg.connect(url, autocommit=True) as conn:
        return {
            r[0]
            for r in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid()"
            )
        }


def process_cpu() -> dict[int, tuple[float, int, int, str]]:
    """Every process's (CPU seconds so far, parent pid, process group, kind), where kind
    is "postgres-backend", "postgres-server" (postmaster and its helpers), or "other"."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[float, int, int, str]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                head, tail = fh.read().rsplit(")", 1)
            fields = tail.split()
            kind = "other"
            if head.endswith("(postgres"):
                with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                    title = fh.read().decode(errors="replace")
                client = "(" in title or "[local]" in title
                kind = "postgres-backend" if client else "postgres-server"
        except (OSError, ValueError):
            continue
        cpu = (int(fields[11]) + int(fields[12])) / tick
        out[int(entry.name)] = (cpu, int(fields[1]), int(fields[2]), kind)
    return out


def cpu_accounts(
    before: dict[int, tuple[float, int, int, str]],
    after: dict[int, tuple[float, int, int, str]],
    backends: set[int],
) -> dict[str, float]:
    """CPU seconds between two :func:`process_cpu` snapshots, by whose it was: this run's
    processes (its process group), its database's backends, the PostgreSQL server's own
    processes, kernel threads, and foreign work (anything else: other programs and other
    databases' backends). Processes that ended in between are missed."""
    ours = os.getpgid(0)
    accounts = dict.fromkeys(("clients", "backends", "server", "kernel", "foreign"), 0.0)
    for pid, (cpu, ppid, pgrp, kind) in after.items():
        used = cpu - before[pid][0] if pid in before else cpu
        if pgrp == ours:
            accounts["clients"] += used
        elif pid in backends:
            accounts["backends"] += used
        elif kind == "postgres-server":
            accounts["server"] += used
        elif pid == 2 or ppid == 2:
            accounts["kernel"] += used
        else:
            accounts["foreign"] += used
    return accounts


def busy_pct(seconds: float) -> float:
    """The machine's CPU busy percentage over the next ``seconds``."""
    busy0, total0, _ = machine_busy()
    time.sleep(seconds)
    busy1, total1, _ = machine_busy()
    return round(100 * (busy1 - busy0) / max(1e-9, total1 - total0), 1)


def timed_loop(
    url: str,
    send_txn: Callable[[], None],
    receive_txn: Callable[[], int],
    per_send: int,
    duration: float,
    start: Any,
    first: bool,
) -> dict[str, Any]:
    """The loop shared by (a), (b) and (c): after every worker reached the start line,
    one send transaction then one receive transaction per iteration, for ``duration``.
    The ``first`` worker also accounts for the machine's CPU over its window."""
    start.wait(START_TIMEOUT)
    busy0, total0, steal0 = machine_busy() if first else (0.0, 0.0, 0.0)
    processes0 = process_cpu() if first else {}
    cpu0 = time.process_time()
    sent = received = empty = receives = 0
    send_time = receive_time = 0.0
    t0 = time.perf_counter()
    end = t0 + duration
    now = t0
    while now < end:
        send_txn()
        t1 = time.perf_counter()
        got = receive_txn()
        t2 = time.perf_counter()
        send_time += t1 - now
        receive_time += t2 - t1
        now = t2
        sent += per_send
        receives += 1
        received += got
        empty += got == 0
    elapsed = time.perf_counter() - t0
    out = {
        "sent": sent,
        "received": received,
        "receives": receives,
        "empty": empty,
        "elapsed": elapsed,
        "send_time": send_time,
        "receive_time": receive_time,
        "cpu": time.process_time() - cpu0,
    }
    if first:
        out["accounts"] = cpu_accounts(processes0, process_cpu(), our_backends(url))
        busy1, total1, steal1 = machine_busy()
        out["machine_busy"] = (busy1 - busy0) / max(1e-9, total1 - total0)
        out["steal"] = (steal1 - steal0) / max(1e-9, total1 - total0)
        out["machine_cpu_s"] = total1 - total0
    return out


def raw_worker(url: str, index: int, duration: float, start: Any) -> dict[str, Any]:
    """(a): one INSERT transaction + one DELETE ... SKIP LOCKED transaction per message."""
    insert = "INSERT INTO bench_raw (conversation, body) VALUES (%s, %s)"
    delete = (
        "DELETE FROM bench_raw WHERE id = (SELECT id FROM bench_raw ORDER BY id LIMIT 1 "
        "FOR UPDATE SKIP LOCKED) RETURNING id, conversation, body"
    )
    with psycopg.connect(url, autocommit=True) as conn:
        counter = iter(range(10**12))

        def send_txn() -> None:
            conn.execute(insert, (index * 1000 + next(counter) % 16, BODY))

        def receive_txn() -> int:
            return int(conn.execute(delete).fetchone() is not None)

        for _ in range(WARMUP_ITERATIONS):
            send_txn()
            receive_txn()
        return timed_loop(url, send_txn, receive_txn, 1, duration, start, index == 0)


def broker_worker(
    url: str,
    index: int,
    handles: list[str],
    top: int,
    in_transaction: bool,
    duration: float,
    start: Any,
) -> dict[str, Any]:
    """(b) and (c): send transactions and receive(top) transactions, alternating. Single
    sends are ``broker.send``; a batch of sends is one ``broker.transaction()``. Receives
    are ``broker.receive`` (a transaction of its own), or with ``in_transaction``
    ``tx.receive`` in a ``broker.transaction()``, as a consumer that works on the
    message before committing would do."""
    per_send = 1 if top == 1 else BATCH
    broker = Broker(url, migrate=False)
    try:
        turn = iter(range(10**12))

        def send_txn() -> None:
            handle = handles[next(turn) % len(handles)]
            if per_send == 1:
                broker.send(handle, MESSAGE_TYPE, BODY)
            else:
                with broker.transaction() as tx:
                    for _ in range(per_send):
                        tx.send(handle, MESSAGE_TYPE, BODY)

        def receive_txn() -> int:
            if not in_transaction:
                return len(broker.receive(TARGET_QUEUE, top=top, timeout=0))
            with broker.transaction() as tx:
                return len(tx.receive(TARGET_QUEUE, top=top, timeout=0))

        # Warm-up, counting per transaction on this (the main) thread.
        counts: dict[str, list[int]] = {
            k: [] for k in ("send", "receive", "send_rt", "receive_rt", "checkouts")
        }
        send_samples: dict[int, list[str]] = {}
        receive_samples: dict[int, list[str]] = {}
        with StatementCounter(broker._engine, broker._autocommit_engine) as counter:
            for _ in range(WARMUP_ITERATIONS if per_send == 1 else 3):
                send_txn()
                statements, used, trips = counter.take()
                counts["send"].append(len(statements))
                counts["send_rt"].append(trips)
                counts["checkouts"].append(used)
                send_samples[len(statements)] = statements
                got = receive_txn()
                statements, used, trips = counter.take()
                if got:
                    counts["receive"].append(len(statements))
                    counts["receive_rt"].append(trips)
                    counts["checkouts"].append(used)
                    receive_samples[len(statements)] = statements
        out = timed_loop(url, send_txn, receive_txn, per_send, duration, start, index == 0)
    finally:
        broker.close()
    out["counts"] = counts
    # the statements of a transaction of the most common length
    out["send_sample"] = send_samples[statistics.mode(counts["send"])]
    out["receive_sample"] = (
        receive_samples[statistics.mode(counts["receive"])] if counts["receive"] else []
    )
    return out


def latency_receiver(url: str, to_sender: Any, to_receiver: Any, samples: int) -> int:
    """(d): tell the sender it is about to wait, then block in receive(timeout=5)."""
    broker = Broker(url, migrate=False)
    try:
        broker.receive(TARGET_QUEUE, top=1, timeout=0)  # warm the pool
        for _ in range(samples):
            to_sender.put("ready")
            got = broker.receive(TARGET_QUEUE, top=1, timeout=5)
            to_sender.put((time.monotonic(), len(got)))
            if to_receiver.get(timeout=60) != "next":
                break
    finally:
        broker.close()
    return samples


def latency_sender(
    url: str, handle: str, to_sender: Any, to_receiver: Any, samples: int
) -> list[tuple[float, float]]:
    """(d): once the receiver waits, send one message; the latencies in seconds, from
    send's return (just after its commit) and from its call."""
    broker = Broker(url, migrate=False)
    rng = random.Random(1)
    latencies: list[tuple[float, float]] = []
    try:
        for i in range(samples):
            if to_sender.get(timeout=60) != "ready":
                raise RuntimeError("latency receiver out of step")
            time.sleep(rng.uniform(0.03, 0.06))  # let it register as a waiter and block
            sending = time.monotonic()
            broker.send(handle, MESSAGE_TYPE, BODY)
            committed = time.monotonic()
            returned, got = to_sender.get(timeout=60)
            if got != 1:
                to_receiver.put("stop")
                raise RuntimeError(f"sample {i}: the receiver timed out without the message")
            latencies.append((returned - committed, returned - sending))
            to_receiver.put("next")
    finally:
        broker.close()
    return latencies


# --- measurements ----------------------------------------------------------------------


def summarize_throughput(rounds: list[list[dict[str, Any]]], per_send: int) -> dict[str, Any]:
    """One measurement's figures from its rounds (each: the workers' results)."""
    results = [r for workers in rounds for r in workers]
    received = sum(r["received"] for r in results)
    sent = sum(r["sent"] for r in results)
    receives = sum(r["receives"] for r in results)
    rates = [sum(r["received"] / r["elapsed"] for r in workers) for workers in rounds]
    firsts = [next(r for r in workers if "machine_busy" in r) for workers in rounds]
    machine = sum(f["machine_cpu_s"] for f in firsts)  # CPU seconds of all cores
    acc = {k: sum(f["accounts"][k] for f in firsts) for k in firsts[0]["accounts"]}
    busy = sum(f["machine_busy"] * f["machine_cpu_s"] for f in firsts) / machine
    steal = sum(f["steal"] * f["machine_cpu_s"] for f in firsts) / machine

    def pct(seconds: float) -> float:
        return round(100 * seconds / machine, 1)

    return {
        # rounds are equally long: the mean of their rates
        "messages_per_s": round(statistics.mean(rates), 1),
        "messages_per_s_by_round": [round(x, 1) for x in rates],
        "messages_received": received,
        "messages_sent": sent,
        "elapsed_s": round(sum(max(r["elapsed"] for r in workers) for workers in rounds), 2),
        "empty_receives": sum(r["empty"] for r in results),
        "ms_per_send_txn": round(1000 * sum(r["send_time"] for r in results) * per_send / sent, 3),
        "ms_per_receive_txn": round(1000 * sum(r["receive_time"] for r in results) / receives, 3),
        "client_cpu_ms_per_message": round(1000 * sum(r["cpu"] for r in results) / received, 3),
        "server_cpu_ms_per_message": round(1000 * acc["backends"] / received, 3),
        "machine_cpu_busy_pct": round(100 * busy, 1),
        # shares of the machine's CPU over the timed windows (2 cores = 100 %)
        "cpu_pct": {
            "clients": pct(acc["clients"]),
            "backends": pct(acc["backends"]),
            "postgres_server_processes": pct(acc["server"]),
            "kernel_threads": pct(acc["kernel"]),
            "steal": round(100 * steal, 1),
            "foreign": pct(acc["foreign"]),
            # interrupts, and processes that ended during a window (short-lived foreign
            # work among them)
            "unattributed": round(100 * (busy - steal) - pct(sum(acc.values())), 1),
        },
    }


def summarize_raw(rounds: list[list[dict[str, Any]]], processes: int) -> dict[str, Any]:
    out = summarize_throughput(rounds, 1)
    out["processes"] = processes
    out["ms_per_insert_txn"] = out.pop("ms_per_send_txn")
    out["ms_per_delete_txn"] = out.pop("ms_per_receive_txn")
    out["empty_deletes"] = out.pop("empty_receives")
    return out


def summarize_broker(
    rounds: list[list[dict[str, Any]]],
    processes: int,
    conversations: int,
    top: int,
    in_transaction: bool,
) -> dict[str, Any]:
    per_send = 1 if top == 1 else BATCH
    out = summarize_throughput(rounds, per_send)
    results = [r for workers in rounds for r in workers]

    def mean(key: str, skip: int = 0) -> float | None:
        # A worker's first sends still find a few cold caches: skip them.
        values = [v for r in results for v in r["counts"][key][skip:] or r["counts"][key]]
        return round(statistics.mean(values), 2) if values else None

    out.update(
        processes=processes,
        conversations=conversations,
        receive_top=top,
        sends_per_send_txn=per_send,
        receive_form=(
            "with broker.transaction() as tx: tx.receive(...)"
            if in_transaction
            else "broker.receive(...)"
        ),
        avg_messages_per_receive=round(
            out["messages_received"] / sum(r["receives"] for r in results), 2
        ),
        statements_per_send_txn=mean("send", 2),
        statements_per_receive_txn=mean("receive"),
        round_trips_per_send_txn=mean("send_rt", 2),
        round_trips_per_receive_txn=mean("receive_rt"),
        pool_checkouts_per_txn=mean("checkouts"),
    )
    per_receive = max(1.0, out["avg_messages_per_receive"])
    for kind in ("statements", "round_trips"):
        out[f"{kind}_per_message"] = round(
            (out[f"{kind}_per_send_txn"] or 0) / per_send
            + (out[f"{kind}_per_receive_txn"] or 0) / per_receive,
            3,
        )
    if top == 1:
        sample = results[0]
        out["send_txn_statements"] = [s[:80] for s in sample["send_sample"]]
        out["receive_txn_statements"] = [s[:80] for s in sample["receive_sample"]]
    return out


def measure_throughput(
    workers: Workers, conversations: int, duration: float, rounds: int
) -> dict[str, dict[str, Any]]:
    """(a), (b), (b2) and (c), each for ``duration`` seconds in all, in ``rounds`` rounds
    that take turns (a b b2 c, b b2 c a, ...) so that load from elsewhere hits all alike."""
    n = workers.processes
    per = conversations // n
    window = duration / rounds
    with database("raw") as raw_url, database("top1") as top1_url, database("top100") as top100_url:
        with psycopg.connect(raw_url, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE bench_raw (id bigserial PRIMARY KEY, conversation integer NOT NULL,"
                " body bytea)"
            )
        handles = {
            1: setup_broker(top1_url, conversations),
            BATCH: setup_broker(top100_url, conversations),
        }
        urls = {1: top1_url, BATCH: top100_url}

        def run(phase: str) -> list[dict[str, Any]]:
            start = workers.barrier(n)
            if phase == "a":
                args = [(raw_url, i, window, start) for i in range(n)]
                return workers.run(raw_worker, args, timeout=window + 120)
            top, in_transaction = PHASES[phase]
            args = [
                (
                    urls[top],
                    i,
                    handles[top][i * per : (i + 1) * per],
                    top,
                    in_transaction,
                    window,
                    start,
                )
                for i in range(n)
            ]
            return workers.run(broker_worker, args, timeout=window + 240)

        phases = ["a", *PHASES]
        results: dict[str, list[list[dict[str, Any]]]] = {p: [] for p in phases}
        for r in range(rounds):
            for phase in phases[r % len(phases) :] + phases[: r % len(phases)]:
                results[phase].append(run(phase))
                rate = sum(x["received"] / x["elapsed"] for x in results[phase][-1])
                log(f"round {r + 1}/{rounds}: ({phase}) {rate:.1f} msg/s")
    out = {"a": summarize_raw(results["a"], n)}
    for phase, (top, in_transaction) in PHASES.items():
        out[phase] = summarize_broker(results[phase], n, conversations, top, in_transaction)
    return out


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def measure_latency(workers: Workers, samples: int) -> dict[str, Any]:
    with database("latency") as url:
        handles = setup_broker(url, 1)
        to_sender, to_receiver = workers.queue(), workers.queue()
        receiver = workers.pool.apply_async(
            latency_receiver, (url, to_sender, to_receiver, samples)
        )
        [latencies] = workers.run(
            latency_sender,
            [(url, handles[0], to_sender, to_receiver, samples)],
            timeout=samples * 6 + 60,
        )
        receiver.get(timeout=30)
    ms = [1000 * x for x, _ in latencies]
    from_call = [1000 * y for _, y in latencies]
    return {
        "samples": len(ms),
        "p50_ms": round(percentile(ms, 50), 3),
        "p90_ms": round(percentile(ms, 90), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "min_ms": round(min(ms), 3),
        "max_ms": round(max(ms), 3),
        "mean_ms": round(statistics.mean(ms), 3),
        # from before the send() call instead: an upper bound, send's own time included
        "p50_ms_from_send_call": round(percentile(from_call, 50), 3),
        "p99_ms_from_send_call": round(percentile(from_call, 99), 3),
    }


def time_receive(broker: Broker, handle: str) -> float:
    """One send+receive pair; the receive(top=1) part's duration in ms."""
    broker.send(handle, MESSAGE_TYPE, BODY)
    t0 = time.perf_counter()
    got = broker.receive(TARGET_QUEUE, top=1, timeout=0)
    elapsed = 1000 * (time.perf_counter() - t0)
    if len(got) != 1:
        raise RuntimeError("(e): receive did not return the message just sent")
    return elapsed


CLONED_TABLES = (
    "conversation_groups",
    "conversation_endpoints",
    "queue_messages",
    "transmission_queue",
)
ID_COLUMNS = ("conversation_handle", "conversation_id", "conversation_group_id")


def clone_conversations(url: str, template_ids: list[str], count: int) -> None:
    """Copy the rows the API left for ``template_ids`` (ended conversations) until there are
    ``count`` more, every handle, conversation id and group id replaced by a fresh uuid
    (md5 of the old id and the copy number); serial ids are assigned anew."""
    with psycopg.connect(url) as conn:
        conn.execute("CREATE TEMP TABLE clone_map (cid text, i integer) ON COMMIT DROP")
        copies = math.ceil(count / len(template_ids))
        conn.execute(
            "INSERT INTO clone_map SELECT t.cid, s.i FROM unnest(%s::text[]) t(cid) "
            "CROSS JOIN generate_series(1, %s) s(i) ORDER BY s.i, t.cid LIMIT %s",
            (template_ids, copies, count),
        )
        for table in CLONED_TABLES:
            columns = [
                name
                for name, default, identity in conn.execute(
                    "SELECT column_name, column_default, is_identity FROM "
                    "information_schema.columns WHERE table_schema = 'public' AND "
                    "table_name = %s ORDER BY ordinal_position",
                    (table,),
                )
                if not (identity == "YES" or (default or "").startswith("nextval("))
            ]
            select = ", ".join(
                f"md5(x.{c} || '/' || m.i)::uuid::text" if c in ID_COLUMNS else f"x.{c}"
                for c in columns
            )
            if table == "conversation_endpoints":
                source = "conversation_endpoints x JOIN clone_map m ON m.cid = x.conversation_id"
            elif table == "conversation_groups":
                source = (
                    "conversation_groups x JOIN (SELECT DISTINCT e.conversation_group_id AS g, "
                    "m.i FROM conversation_endpoints e JOIN clone_map m "
                    "ON m.cid = e.conversation_id) m ON m.g = x.conversation_group_id"
                )
            else:
                source = (
                    f"{table} x JOIN conversation_endpoints e "
                    "ON e.conversation_handle = x.conversation_handle "
                    "JOIN clone_map m ON m.cid = e.conversation_id"
                )
            order = (
                "m.i, x.message_id" if table in ("queue_messages", "transmission_queue") else "m.i"
            )
            conn.execute(
                f"INSERT INTO {table} ({', '.join(columns)}) SELECT {select} FROM {source} "
                f"ORDER BY {order}"
            )
        conn.commit()


def count_rows(url: str) -> dict[str, Any]:
    with psycopg.connect(url, autocommit=True) as conn:
        states = dict(
            conn.execute(
                "SELECT state, count(*) FROM conversation_endpoints GROUP BY state"
            ).fetchall()
        )
        queues = dict(
            conn.execute(
                "SELECT queue_name || ':' || message_type_name, count(*) FROM queue_messages "
                "WHERE status = 1 GROUP BY 1"
            ).fetchall()
        )
        groups = conn.execute("SELECT count(*) FROM conversation_groups").fetchone()
    return {"endpoints_by_state": states, "ready_messages": queues, "groups": groups[0]}


def build_retained(
    url: str, retained: int, api_conversations: int, api_txn_size: int
) -> dict[str, Any]:
    """Leave ``retained`` ended conversations in the database: the target received the
    first message and ended, the initiator did not (target endpoint DO, initiator endpoint
    DI, an unreceived EndDialog on the initiator queue). The first ``api_conversations``
    through the public API, the rest copied from those."""
    api_n = min(api_conversations, retained)
    with Broker(url, migrate=False) as broker:
        t0 = time.perf_counter()
        done = 0
        while done < api_n:
            with broker.transaction() as tx:
                for _ in range(min(api_txn_size, api_n - done)):
                    handle = tx.begin_dialog(INITIATOR_SERVICE, TARGET_SERVICE, CONTRACT)
                    tag = str(handle).encode()
                    tx.send(handle, MESSAGE_TYPE, tag)
                    [message] = tx.receive(TARGET_QUEUE, top=1, timeout=0)
                    if message.body != tag:
                        raise RuntimeError("(e) build: received another conversation's message")
                    tx.end_conversation(message.conversation_handle)
                    done += 1
        api_seconds = time.perf_counter() - t0
    api_rate = api_n / api_seconds
    log(
        f"(e) built {api_n} ended conversations through the API in {api_seconds:.1f} s "
        f"({api_rate:.0f}/s; all {retained} would take {retained / api_rate:.0f} s)"
    )
    with psycopg.connect(url, autocommit=True) as conn:
        template = [
            r[0]
            for r in conn.execute(
                "SELECT conversation_id FROM conversation_endpoints WHERE state = 'DO'"
            )
        ]
    if len(template) != api_n:
        raise RuntimeError(f"(e) build: expected {api_n} DO endpoints, found {len(template)}")
    t0 = time.perf_counter()
    if retained > api_n:
        clone_conversations(url, template, retained - api_n)
    copy_seconds = time.perf_counter() - t0
    log(f"(e) copied {retained - api_n} more in {copy_seconds:.1f} s")
    rows = count_rows(url)
    states = rows["endpoints_by_state"]
    enddialogs = rows["ready_messages"].get(f"{INITIATOR_QUEUE}:EndDialog", 0)
    if states.get("DO") != retained or states.get("DI") != retained or enddialogs != retained:
        raise RuntimeError(f"(e) build: unexpected rows {rows}")
    return {
        "api_conversations": api_n,
        "api_txn_size": api_txn_size,
        "api_seconds": round(api_seconds, 2),
        "api_conversations_per_s": round(api_rate, 1),
        "api_estimate_all_s": round(retained / api_rate, 1),
        "copied_conversations": retained - api_n,
        "copy_seconds": round(copy_seconds, 2),
        "rows": rows,
    }


def settle(*urls: str) -> None:
    """VACUUM ANALYZE (what autovacuum would have done by now) and a CHECKPOINT, so that
    neither shows up inside the timed receives."""
    for url in urls:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute("CHECKPOINT")


def measure_retained(retained: int, api_conversations: int, pairs: int) -> dict[str, Any]:
    """Two databases set up alike, one with the retained conversations; the timed pairs
    alternate between them so that drift hits both equally."""
    with database("e_none") as url_none, database("e_retained") as url_with:
        handles_none = setup_broker(url_none, 16)
        handles_with = setup_broker(url_with, 16)
        build = build_retained(url_with, retained, api_conversations, api_txn_size=500)
        settle(url_none, url_with)
        without: list[float] = []
        with_retained: list[float] = []
        with Broker(url_none, migrate=False) as b_none, Broker(url_with, migrate=False) as b_with:
            sides = [(b_none, handles_none, without), (b_with, handles_with, with_retained)]
            for i in range(50):  # warm-up
                for broker, handles, _ in sides:
                    time_receive(broker, handles[i % len(handles)])
            # Alternate pair by pair (A B B A ...) so that passing load hits both alike.
            for i in range(pairs):
                for broker, handles, times in sides if i % 2 == 0 else reversed(sides):
                    times.append(time_receive(broker, handles[i % len(handles)]))
    med_without = statistics.median(without)
    med_with = statistics.median(with_retained)
    log(f"(e) receive median {med_without:.3f} ms without, {med_with:.3f} ms with")
    return {
        "retained_conversations": retained,
        "pairs_each": len(without),
        "receive_median_ms_without": round(med_without, 3),
        "receive_median_ms_with": round(med_with, 3),
        "receive_p90_ms_without": round(percentile(without, 90), 3),
        "receive_p90_ms_with": round(percentile(with_retained, 90), 3),
        "ratio": round(med_with / med_without, 3),
        "build": build,
    }


# --- facts, report ---------------------------------------------------------------------


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def machine_facts() -> dict[str, Any]:
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        version = conn.execute("SELECT version()").fetchone()[0]
        settings = dict(
            conn.execute(
                "SELECT name, setting || coalesce(unit, '') FROM pg_settings WHERE name IN "
                "('synchronous_commit', 'fsync', 'shared_buffers', 'max_connections', "
                "'wal_sync_method')"
            ).fetchall()
        )
    packages = {}
    for name in ("scheduler_lib", "sqlalchemy", "psycopg", "psycopg-binary", "alembic"):
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = None
    git: dict[str, Any] = {"commit": git_commit()}
    try:
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", "scheduler_lib"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        git["scheduler_lib_dirty"] = bool(status.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return {
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "postgresql": version,
        "postgresql_settings": settings,
        "packages": packages,
        "git": git,
    }


def check_targets(report: dict[str, Any]) -> dict[str, Any]:
    values = {
        "b_over_a": report["ratios"]["b_over_a"],
        "c_over_b": report["ratios"]["c_over_b"],
        "d_p50_ms": report["d_wakeup_latency"]["p50_ms"],
        "e_ratio": report["e_retained"]["ratio"],
    }
    out = {}
    for name, (target, op) in TARGETS.items():
        value = values[name]
        met = value >= target if op == ">=" else value <= target
        out[name] = {"value": value, "target": f"{op} {target}", "met": met}
    return out


def markdown_section(report: dict[str, Any]) -> str:
    a, b, c = report["a_raw"], report["b_broker_top1"], report["c_broker_top100"]
    b2 = report["b2_broker_top1_receive_in_transaction"]
    d, e, t = report["d_wakeup_latency"], report["e_retained"], report["targets"]
    foreign = max(x["cpu_pct"]["foreign"] for x in (a, b, b2, c))

    def mark(name: str) -> str:
        return "met" if t[name]["met"] else "**missed**"

    def each(key: str, runs: tuple[dict[str, Any], ...] = (a, b, b2, c)) -> str:
        return " / ".join(str(x[key]) for x in runs)

    rows = [
        ("(a) raw INSERT + DELETE SKIP LOCKED, msg/s", a["messages_per_s"], "", ""),
        ("(b) broker.send + broker.receive(top=1), msg/s", b["messages_per_s"], "", ""),
        ("(b)/(a)", report["ratios"]["b_over_a"], t["b_over_a"]["target"], mark("b_over_a")),
        (
            "(b2) as (b), receiving in `with broker.transaction()`, msg/s",
            b2["messages_per_s"],
            "",
            "",
        ),
        ("(c) 100 sends per txn + broker.receive(top=100), msg/s", c["messages_per_s"], "", ""),
        ("(c)/(b)", report["ratios"]["c_over_b"], t["c_over_b"]["target"], mark("c_over_b")),
        ("(d) wake-up latency p50, ms", d["p50_ms"], t["d_p50_ms"]["target"], mark("d_p50_ms")),
        ("(d) wake-up latency p99, ms", d["p99_ms"], "", ""),
        (
            f"(e) receive median, none retained / {e['retained_conversations']:,} retained, ms",
            f"{e['receive_median_ms_without']} / {e['receive_median_ms_with']}",
            "",
            "",
        ),
        ("(e) ratio with/without", e["ratio"], t["e_ratio"]["target"], mark("e_ratio")),
        (
            "SQL statements per send txn / per receive txn (b) ; (b2)",
            f"{b['statements_per_send_txn']} / {b['statements_per_receive_txn']} ; "
            f"{b2['statements_per_send_txn']} / {b2['statements_per_receive_txn']}",
            "",
            "",
        ),
        (
            "round trips per message (a) / (b) / (b2) / (c)",
            f"2 / {each('round_trips_per_message', (b, b2, c))}",
            "",
            "",
        ),
        (
            "ms per send txn / per receive txn, per process (a) ; (b) ; (b2)",
            f"{a['ms_per_insert_txn']} / {a['ms_per_delete_txn']} ; "
            f"{b['ms_per_send_txn']} / {b['ms_per_receive_txn']} ; "
            f"{b2['ms_per_send_txn']} / {b2['ms_per_receive_txn']}",
            "",
            "",
        ),
        (
            "client CPU ms per message (a) / (b) / (b2) / (c)",
            each("client_cpu_ms_per_message"),
            "",
            "",
        ),
        (
            "backend CPU ms per message (a) / (b) / (b2) / (c)",
            each("server_cpu_ms_per_message"),
            "",
            "",
        ),
        ("machine CPU busy % (a) / (b) / (b2) / (c)", each("machine_cpu_busy_pct"), "", ""),
        (
            "of which foreign work, % (a) / (b) / (b2) / (c)",
            " / ".join(str(x["cpu_pct"]["foreign"]) for x in (a, b, b2, c)),
            "",
            "",
        ),
    ]
    notes = []
    if foreign > FOREIGN_WARNING_PCT:
        notes.append(
            f"Warning: foreign work (other programs, other databases' backends) took up to "
            f"{foreign}% of the machine's CPU during a throughput measurement; the figures "
            "are noisy."
        )
    return docs_section(
        "broker_throughput",
        report,
        f"{report['config']['processes']} processes, {report['config']['conversations']} "
        f"conversations, {report['config']['duration_s']} s per throughput measurement "
        f"(in {report['config']['rounds']} rounds taking turns), "
        f"{len(BODY)}-byte bodies; design in `bench/broker_throughput.py`'s docstring.",
        rows,
        notes,
    )


def docs_section(
    name: str,
    report: dict[str, Any],
    design: str,
    rows: list[tuple[str, Any, str, str]],
    notes: Sequence[str] = (),
) -> str:
    """A benchmark's dated section of docs/benchmarks.md: title, command, machine, what
    was measured, warnings about a busy machine and other notes, then the figures."""
    m = report["machine"]
    if m["cpu_busy_pct_before_start"] > BUSY_WARNING_PCT:
        notes = [
            f"Warning: the machine was {m['cpu_busy_pct_before_start']}% busy before the "
            "start (other work); the figures are noisy.",
            *notes,
        ]
    lines = [
        "",
        f"## {name} — {report['started_at']}" + (" (quick)" if report["quick"] else ""),
        "",
        f"Command: `{report['command']}` (took {report['elapsed_s']:.0f} s)",
        "",
        f"Machine: {m['cores']} cores, {m['postgresql'].split(' on ')[0]}, Python {m['python']}, "
        + ", ".join(f"{k} {v}" for k, v in m["packages"].items() if v)
        + f"; git {(m['git'].get('commit') or '?')[:10]}"
        + (" + uncommitted scheduler_lib changes" if m["git"].get("scheduler_lib_dirty") else ""),
        "",
        design,
        "",
        *(line for note in notes for line in (note, "")),
        "| measurement | figure | target | |",
        "| --- | ---: | --- | --- |",
        *(f"| {label} | {value} | {target} | {met} |" for label, value, target, met in rows),
        "",
    ]
    return "\n".join(lines)


def append_docs(section: str) -> None:
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    if not DOCS.exists():
        DOCS.write_text(DOCS_HEADER)
    with DOCS.open("a") as fh:
        fh.write(section)


def publish(section: str, write_docs: bool) -> None:
    """Print a diagnostic's markdown section, and append it to the docs when asked."""
    print(section)
    if write_docs:
        append_docs(section)
        log("appended to docs/benchmarks.md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.broker_throughput", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--duration", type=float, help="seconds per throughput measurement")
    parser.add_argument("--quick", action="store_true", help="~30 s smoke run")
    parser.add_argument(
        "--rounds", type=int, help="rounds that (a), (b), (c) take turns in (default 3; quick 1)"
    )
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--samples", type=int, help="wake-up latency samples (default 200)")
    parser.add_argument("--retained", type=int, help="ended conversations for (e) (100000)")
    parser.add_argument(
        "--api-conversations", type=int, help="of those, built through the API (default 1000)"
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
    duration = args.duration or (3.0 if quick else 30.0)
    rounds = args.rounds or (1 if quick else 3)
    samples = args.samples or (30 if quick else 200)
    retained = args.retained or (10_000 if quick else 100_000)
    api_conversations = args.api_conversations or (100 if quick else 1000)
    pairs = 200 if quick else 1000
    if args.conversations % args.processes:
        parser.error("--conversations must be a multiple of --processes")

    waiting = time.monotonic()
    idle_check = busy_pct(1.0)
    waited_until = time.monotonic() + (args.wait_idle or 0)
    while idle_check > BUSY_WARNING_PCT and time.monotonic() < waited_until:
        log(f"the machine is {idle_check}% busy; waiting for it to go quiet")
        idle_check = busy_pct(5.0)
    if idle_check > BUSY_WARNING_PCT:
        log(f"warning: the machine is {idle_check}% busy before the start; figures will be noisy")
    started = time.monotonic()
    workers = Workers(args.processes)  # spawning while we look around
    report: dict[str, Any] = {
        "benchmark": "broker_throughput",
        "started_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(
            [Path(sys.executable).name, "-m", "bench.broker_throughput", *sys.argv[1:]]
        ),
        "quick": quick,
        "machine": machine_facts(),
        "config": {
            "duration_s": duration,
            "rounds": rounds,
            "processes": args.processes,
            "conversations": args.conversations,
            "body_bytes": len(BODY),
            "latency_samples": samples,
            "retained_conversations": retained,
            "retained_pairs": pairs,
        },
    }
    report["machine"]["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    report["machine"]["cpu_busy_pct_before_start"] = idle_check
    report["waited_for_quiet_s"] = round(started - waiting, 1)
    try:
        log(
            f"(a), (b), (b2), (c): {args.processes} processes, {args.conversations} conversations, "
            f"{duration} s each in {rounds} rounds"
        )
        m = measure_throughput(workers, args.conversations, duration, rounds)
        report["a_raw"] = m["a"]
        report["b_broker_top1"] = m["b"]
        report["b2_broker_top1_receive_in_transaction"] = m["b2"]
        report["c_broker_top100"] = m["c"]
        log(
            "(a) {} msg/s, (b) {} msg/s, (b2) {} msg/s, (c) {} msg/s".format(
                *(m[p]["messages_per_s"] for p in ("a", "b", "b2", "c"))
            )
        )
        log(f"(d) wake-up latency, {samples} samples")
        report["d_wakeup_latency"] = measure_latency(workers, samples)
        log(
            f"(d) p50 {report['d_wakeup_latency']['p50_ms']} ms, "
            f"p99 {report['d_wakeup_latency']['p99_ms']} ms"
        )
    except BaseException:
        workers.terminate()
        raise
    workers.close()
    log(f"(e) {retained} retained ended conversations, {pairs} timed receives each way")
    report["e_retained"] = measure_retained(retained, api_conversations, pairs)
    a_rate = report["a_raw"]["messages_per_s"]
    b_rate = report["b_broker_top1"]["messages_per_s"]
    report["ratios"] = {
        "b_over_a": round(b_rate / a_rate, 3),
        "c_over_b": round(report["c_broker_top100"]["messages_per_s"] / b_rate, 3),
    }
    report["targets"] = check_targets(report)
    return finish_run(report, started, None if args.no_docs else markdown_section)


def start_report(benchmark: str, quick: bool, **fields: Any) -> tuple[dict[str, Any], float]:
    """The start of a benchmark: a busy machine is warned about, and the report begins
    with when, the command, the machine and ``fields``; (report, monotonic start)."""
    idle_check = busy_pct(1.0)
    if idle_check > BUSY_WARNING_PCT:
        log(f"warning: the machine is {idle_check}% busy before the start; figures will be noisy")
    report: dict[str, Any] = {
        "benchmark": benchmark,
        "started_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(
            [Path(sys.executable).name, "-m", f"bench.{benchmark}", *sys.argv[1:]]
        ),
        "quick": quick,
        **fields,
        "machine": machine_facts(),
    }
    report["machine"]["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    report["machine"]["cpu_busy_pct_before_start"] = idle_check
    return report, time.monotonic()


def finish_run(
    report: dict[str, Any],
    started: float,
    docs_section: Callable[[dict[str, Any]], str] | None,
) -> int:
    """The end of every benchmark: machine facts at the end, a warning if HEAD moved,
    its docs section appended (unless ``None``), the JSON printed."""
    report["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    commit_at_end = git_commit()
    if commit_at_end != report["machine"]["git"].get("commit"):
        report["machine"]["git"]["commit_at_end"] = commit_at_end
        log("warning: HEAD moved during the run")
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    if docs_section is not None:
        append_docs(docs_section(report))
        log(f"appended to {DOCS.relative_to(REPO)}")
    print(json.dumps(report, indent=2))
    log(f"done in {report['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
