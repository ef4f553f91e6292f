"""Remote vs. local delivery: the broker-to-broker transport on loopback, PostgreSQL.

Run from the repository root::

    .venv/bin/python -m bench.transport            # full run (~1 min)
    .venv/bin/python -m bench.transport --quick    # ~20 s smoke run

Two fresh PostgreSQL databases, broker A and broker B, each with the same message type and
contract. A hosts the initiator service and a *local* target service; B hosts the
*remote* target service; A routes to B. Each broker's transport endpoint runs as a real
``scheduler-lib serve --listen`` process (the product's way to run it), on loopback,
without TLS; this process is the application: it sends on broker A and receives from
whichever broker hosts the target.

- **Throughput**: ``--messages`` (5,000) messages of 100 bytes on ``--conversations`` (10)
  dialogs, sent with ``send_many`` in batches of 100 per conversation, while a receiver
  thread drains the target queue (``receive(top=500)`` per transaction). Time from the
  first send to the last receive; local and remote alternate, ``--rounds`` (3) each, and
  the median round is reported. Local delivery is one transaction per batch on A; remote
  adds the transmission queue, the endpoints' TCP link, B's batched commits and the
  acknowledgements that let A delete its copies.
- **Latency**: one message at a time onto an idle queue whose receiver waits in
  ``receive(timeout=5)``: from ``send`` returned to ``receive`` returned, p50 / p99 over
  ``--samples`` (100) messages per side, alternating.

Prints one JSON object on stdout, progress on stderr, and appends a dated section to
docs/benchmarks.md (unless --no-docs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import secrets
import shlex
import socket
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

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
from bench.processes import Processes
from scheduler_lib.broker import Broker

BODY = b"x" * 100
BATCH = 100  # messages per send_many
SERVE_UP = 60.0  # seconds for an endpoint to listen


def _catalog(broker: Broker, *services: tuple[str, str, bool]) -> None:
    broker.create_message_type("Request")
    broker.create_contract("Work", {"Request": "INITIATOR"})
    for service, queue, target in services:
        broker.create_queue(queue)
        broker.create_service(service, queue, ["Work"] if target else [])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def throughput(
    sender: Broker, receiver: Broker, queue: str, service: str, messages: int, conversations: int
) -> dict[str, Any]:
    handles = [sender.begin_dialog("Initiator", service, "Work") for _ in range(conversations)]
    got = 0
    done = threading.Event()

    def drain() -> None:
        nonlocal got
        while got < messages:
            with receiver.transaction() as tx:
                got += len(tx.receive(queue, top=500, timeout=1))
        done.set()

    thread = threading.Thread(target=drain)
    started = time.monotonic()
    thread.start()
    per = messages // conversations
    for start in range(0, per, BATCH):
        for handle in handles:
            sender.send_many(handle, "Request", [BODY] * min(BATCH, per - start))
    sent = time.monotonic()
    if not done.wait(300):
        raise RuntimeError(f"only {got} of {messages} messages arrived")
    elapsed = time.monotonic() - started
    thread.join()
    for handle in handles:
        sender.end_conversation(handle, cleanup=True)
    if got != messages:
        raise RuntimeError(f"received {got} messages, sent {messages}")
    return {
        "messages": messages,
        "elapsed_s": round(elapsed, 3),
        "send_s": round(sent - started, 3),
        "msgs_per_s": round(messages / elapsed, 1),
    }


def latency(
    sender: Broker, receiver: Broker, queue: str, service: str, samples: int
) -> list[float]:
    handle = sender.begin_dialog("Initiator", service, "Work")
    ms: list[float] = []

    def wait(box: dict[str, float], ready: threading.Event) -> None:
        ready.set()
        with receiver.transaction() as tx:
            if tx.receive(queue, timeout=5):
                box["at"] = time.monotonic()

    for _ in range(samples):
        box: dict[str, float] = {}
        ready = threading.Event()
        thread = threading.Thread(target=wait, args=(box, ready))
        thread.start()
        ready.wait()
        time.sleep(0.02)  # the receiver is inside its WAITFOR
        sender.send(handle, "Request", BODY)
        sent = time.monotonic()
        thread.join()
        if "at" not in box:
            raise RuntimeError("a latency sample did not arrive within 5 s")
        ms.append(1000 * (box["at"] - sent))
    sender.end_conversation(handle, cleanup=True)
    return ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.transport", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="~20 s smoke run")
    parser.add_argument("--messages", type=int, help="messages per throughput round (5000)")
    parser.add_argument("--conversations", type=int, default=10)
    parser.add_argument("--rounds", type=int, help="throughput rounds per side (3)")
    parser.add_argument("--samples", type=int, help="latency samples per side (100)")
    parser.add_argument("--no-docs", action="store_true", help="do not append to the docs")
    args = parser.parse_args(argv)
    messages = args.messages or (1000 if args.quick else 5000)
    rounds = args.rounds or (1 if args.quick else 3)
    samples = args.samples or (20 if args.quick else 100)
    idle_check = busy_pct(1.0)
    if idle_check > BUSY_WARNING_PCT:
        log(f"warning: the machine is {idle_check}% busy before the start; figures will be noisy")
    started = time.monotonic()
    report: dict[str, Any] = {
        "benchmark": "transport",
        "started_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join([Path(sys.executable).name, "-m", "bench.transport", *sys.argv[1:]]),
        "quick": args.quick,
        "machine": machine_facts(),
        "config": {
            "messages": messages,
            "conversations": args.conversations,
            "rounds": rounds,
            "samples": samples,
            "body_bytes": len(BODY),
            "batch": BATCH,
        },
    }
    report["machine"]["cpu_busy_pct_before_start"] = idle_check
    key = secrets.token_hex(16)
    with ExitStack() as stack:
        url_a = stack.enter_context(database("transport_a"))
        url_b = stack.enter_context(database("transport_b"))
        a, b = Broker(url_a), Broker(url_b)
        stack.callback(a.close)
        stack.callback(b.close)
        _catalog(a, ("Initiator", "InitiatorQueue", False), ("LocalTarget", "LocalQueue", True))
        _catalog(b, ("RemoteTarget", "RemoteQueue", True))
        port_a, port_b = _free_port(), _free_port()
        a.create_route("to B", "RemoteTarget", f"tcp://127.0.0.1:{port_b}")
        b.create_route("to A", "Initiator", f"tcp://127.0.0.1:{port_a}")
        # Each broker's endpoint: `scheduler-lib serve --listen`, until the block ends
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        env = {**os.environ, "SCHEDULER_LIB_TRANSPORT_KEY": key}
        processes = stack.enter_context(Processes(workdir, env))
        for name, url, port in (("serve-a", url_a, port_a), ("serve-b", url_b, port_b)):
            endpoint = processes.start(name, "serve", "--db", url, "--listen", f"127.0.0.1:{port}")
            processes.wait_said(endpoint, "listening at", SERVE_UP)
        sides = {
            "local": (a, "LocalQueue", "LocalTarget"),
            "remote": (b, "RemoteQueue", "RemoteTarget"),
        }
        throughput(a, b, "RemoteQueue", "RemoteTarget", 200, 2)  # warm-up: connection, caches
        throughput(a, a, "LocalQueue", "LocalTarget", 200, 2)
        runs: dict[str, list[dict[str, Any]]] = {"local": [], "remote": []}
        for r in range(rounds):
            for side, (receiver, queue, service) in sides.items():
                result = throughput(a, receiver, queue, service, messages, args.conversations)
                runs[side].append(result)
                log(f"throughput round {r + 1} {side}: {result['msgs_per_s']} msg/s")
        lat: dict[str, list[float]] = {"local": [], "remote": []}
        for _ in range(2):  # alternate halves
            for side, (receiver, queue, service) in sides.items():
                lat[side] += latency(a, receiver, queue, service, samples // 2)
        for side in sides:
            rates = [r["msgs_per_s"] for r in runs[side]]
            report[side] = {
                "throughput_rounds": runs[side],
                "msgs_per_s_median": statistics.median(rates),
                "latency_p50_ms": round(percentile(lat[side], 50), 2),
                "latency_p99_ms": round(percentile(lat[side], 99), 2),
            }
            log(
                f"{side}: {report[side]['msgs_per_s_median']} msg/s, latency p50 "
                f"{report[side]['latency_p50_ms']} ms p99 {report[side]['latency_p99_ms']} ms"
            )
    report["remote_over_local_throughput"] = round(
        report["remote"]["msgs_per_s_median"] / report["local"]["msgs_per_s_median"], 3
    )
    return finish_run(report, started, None if args.no_docs else markdown_section)


def markdown_section(report: dict[str, Any]) -> str:
    local, remote = report["local"], report["remote"]
    c = report["config"]
    design = (
        f"Broker A and broker B are two PostgreSQL databases; each runs `scheduler-lib serve "
        f"--listen` on loopback (no TLS). {c['messages']:,} messages of {c['body_bytes']} bytes "
        f"on {c['conversations']} dialogs, `send_many` batches of {c['batch']}, a receiver "
        f"draining `receive(top=500)`; local = A to a service on A, remote = A to a service on "
        f"B through the transmission queue, the endpoints and B's batched commits; "
        f"{c['rounds']} alternating rounds, median. Latency: one message onto an idle queue "
        f"whose receiver waits, send returned to receive returned, {c['samples']} samples per side."
    )
    rows = [
        ("throughput, local", f"{local['msgs_per_s_median']:,} msg/s", "", ""),
        ("throughput, remote", f"{remote['msgs_per_s_median']:,} msg/s", "", ""),
        ("remote / local throughput", report["remote_over_local_throughput"], "", ""),
        (
            "latency p50 / p99, local",
            f"{local['latency_p50_ms']} / {local['latency_p99_ms']} ms",
            "",
            "",
        ),
        (
            "latency p50 / p99, remote",
            f"{remote['latency_p50_ms']} / {remote['latency_p99_ms']} ms",
            "",
            "",
        ),
    ]
    return docs_section(
        "Broker-to-broker transport: remote vs. local delivery", report, design, rows
    )


if __name__ == "__main__":
    sys.exit(main())
