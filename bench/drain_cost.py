"""Where our drain falls behind the raw ceiling (workload 1 of ``bench.peers``, drain shape,
batch 1): our consumer against the same statement without our Python around it.

    .venv-bench/bin/python -m bench.drain_cost                # ~1 min, prints a table
    .venv-bench/bin/python -m bench.drain_cost --write-docs   # and appends it

Four ways of draining the same ``--messages`` 100-byte messages, enqueued first as
``bench.peers`` enqueues them (its producers, its databases cloned from its templates), by
4 threads in this process, one message per look, until the queue is empty:

- **ours**: ``with broker.transaction() as tx: tx.receive(queue, top=1)``, the consumer
  of ``bench.peers.worker.ours_worker`` (BEGIN, the one-statement RECEIVE, COMMIT);
- **our RECEIVE on psycopg, in a transaction**: the same statement (``receive_fast_one``,
  the RECEIVE of one message; the text our store sends, read from it: an internal name, so
  this script may need updating when it changes), with the same binds, straight on a
  psycopg connection per thread, then ``commit()``: the same round trips and server work,
  none of our Python;
- **our RECEIVE on psycopg, autocommit**: the same, one round trip per message;
- **raw**: the ceiling's ``DELETE … FOR UPDATE SKIP LOCKED`` (``bench.peers.worker.RAW_DELETE``)
  in autocommit.

So ours against the second row is the client work of our layers (the transaction, the
session, the kept connection, the message objects, the counters and wakeups); the second
against the third the transaction's two extra round trips; the third against raw what the
RECEIVE's own statement costs (a conversation group locked, messages taken in order).
Figures: messages per second from the threads' start to the last message, and this
process's CPU per message (``time.process_time``: every thread of it, our broker's timer
threads too); medians over ``--rounds`` rounds, the ways taking turns in a rotating order.
The machine's two cores are shared with the server, so only the ratios within one run mean
anything.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg

from bench.broker_throughput import log, publish
from bench.peers import systems
from bench.peers.worker import RAW_DELETE, TARGET_QUEUE
from bench.peers.workloads import produce_ours, produce_raw

CONSUMERS = 4  # as bench.peers' workload 1
WAYS = {
    "ours": "ours: `broker.transaction()` + `tx.receive(top=1)`",
    "statement_tx": "our RECEIVE's statement on psycopg, in a transaction",
    "statement_auto": "our RECEIVE's statement on psycopg, autocommit",
    "raw": "raw: the ceiling's `DELETE … SKIP LOCKED`, autocommit",
}


def drain(way: str, messages: int) -> tuple[float, float]:
    """(messages/s, client CPU ms per message) of one drain the way ``way``."""
    system = "raw" if way == "raw" else "ours"
    tags = [str(i) for i in range(messages)]
    with systems.fresh_db(system) as url:
        (produce_raw if way == "raw" else produce_ours)(url, tags, 1)
        from scheduler_lib.broker import Broker

        with Broker(url, migrate=False, timers=True) as broker:
            look, connect = consumer(way, url, broker)
            counts: list[int] = []
            ends: list[float] = []
            gate = threading.Barrier(CONSUMERS + 1)

            def consume() -> None:
                conn = connect()
                try:
                    look(conn)  # a first look before the clock: connections made, prepared
                    gate.wait()
                    n = 0
                    while look(conn):
                        n += 1
                    counts.append(n)
                    ends.append(time.perf_counter())
                finally:
                    if conn is not None:
                        conn.close()

            threads = [threading.Thread(target=consume) for _ in range(CONSUMERS)]
            for thread in threads:
                thread.start()
            gate.wait()
            started, cpu = time.perf_counter(), time.process_time()
            for thread in threads:
                thread.join()
            cpu = time.process_time() - cpu
    done = sum(counts)
    if done < messages - CONSUMERS:  # each thread's first look may take one
        raise RuntimeError(f"{way}: drained {done} of {messages}")
    return done / (max(ends) - started), 1000 * cpu / done


def consumer(
    way: str, url: str, broker: Any
) -> tuple[Callable[[Any], list[Any]], Callable[[], Any]]:
    """(one look on a thread's connection, that connection's maker) of ``way``."""
    if way == "ours":

        def look_ours(_: Any) -> list[Any]:
            with broker.transaction() as tx:
                return tx.receive(TARGET_QUEUE, top=1, timeout=0)

        return look_ours, lambda: None
    if way == "raw":
        return (
            lambda conn: conn.execute(RAW_DELETE, (1,), prepare=True).fetchall(),
            lambda: psycopg.connect(url, autocommit=True),
        )
    statement = broker._shared.store._driver_text("receive_fast_one")
    binds = {"queue": TARGET_QUEUE}
    autocommit = way == "statement_auto"

    def look(conn: psycopg.Connection[Any]) -> list[Any]:
        rows = conn.execute(statement, binds, prepare=True).fetchall()
        if not autocommit:
            conn.commit()
        return rows

    return look, lambda: psycopg.connect(url, autocommit=autocommit)


def measure(
    messages: int, rounds: int, ways: list[str] | None = None
) -> dict[str, list[tuple[float, float]]]:
    order = ways or list(WAYS)
    results: dict[str, list[tuple[float, float]]] = {way: [] for way in order}
    for r in range(rounds):
        for way in order[r % len(order) :] + order[: r % len(order)]:
            rate, cpu = drain(way, messages)
            results[way].append((rate, cpu))
            log(f"round {r + 1}: {way}: {rate:,.0f} msg/s, {cpu:.3f} ms CPU per message")
    return results


def markdown(results: dict[str, list[tuple[float, float]]], messages: int, rounds: int) -> str:
    med = statistics.median
    rate = {way: med(r for r, _ in runs) for way, runs in results.items()}
    lines = [
        "",
        f"## Where the drain's gap to the ceiling goes — {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "",
        f"Command: `python -m bench.drain_cost --messages {messages} --rounds {rounds}` "
        "(design in its docstring). Workload 1's drain shape at batch 1: "
        f"{messages} messages enqueued first, then {CONSUMERS} threads of this process drain "
        f"them one per look; medians over {rounds} rounds.",
        "",
        "| way | msg/s, median (min..max) | / raw | client CPU ms per message |",
        "| --- | ---: | ---: | ---: |",
    ]
    for way, runs in results.items():
        rates = [r for r, _ in runs]
        share = f"{rate[way] / rate['raw']:.2f}" if "raw" in rate else "-"
        lines.append(
            f"| {WAYS[way]} | {rate[way]:,.0f} ({min(rates):,.0f}..{max(rates):,.0f}) "
            f"| {share} | {med(c for _, c in runs):.3f} |"
        )
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--ways",
        help=f"comma-separated, of {', '.join(WAYS)} (default: all; raw is the ratios' base)",
    )
    parser.add_argument("--write-docs", action="store_true", help="append to benchmarks.md")
    args = parser.parse_args()
    try:
        ways = args.ways.split(",") if args.ways else None
        unknown = sorted(set(ways or ()) - set(WAYS))
        if unknown:
            parser.error(f"--ways: unknown {', '.join(unknown)}; choose from {', '.join(WAYS)}")
        results = measure(args.messages, args.rounds, ways)
    finally:
        systems.drop_templates()  # the template databases fresh_db cloned from
    publish(markdown(results, args.messages, args.rounds), args.write_docs)


if __name__ == "__main__":
    main()
