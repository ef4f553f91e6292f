"""Receive throughput with 10 conversation priority levels in use vs all at the default.

Run from the repository root::

    .venv/bin/python -m bench.priority_throughput            # full run (~2.5 minutes)
    .venv/bin/python -m bench.priority_throughput --quick    # ~30 s smoke run

Two databases, freshly created (and afterwards dropped), set up alike: one message type,
one contract, an initiator queue and service, a target queue with 10 target services on
it, and --conversations (64) dialogs from the initiator service, conversation i going to
target service i % 10 + 1. In the "levels" database 10 priorities
``create_priority(contract=CONTRACT, local_service=<target service L>,
remote_service=<initiator service>, level=L)`` give the target endpoints (the receiving
side, whose level RECEIVE orders by) levels 1..10, 6 or 7 conversations each; the
"default" database has no priorities, so every endpoint is at level 5. Before measuring,
``conversation_endpoints()`` of both is read and checked: every target endpoint at the
level of its service (levels) or at 5 (default), every initiator endpoint at 5.

Both target queues are filled with the same --messages (20,000) messages, spread evenly
over the conversations and interleaved (conversation 0, 1, ... 63, 0, 1, ...). The first
few per conversation are sent through the API (``broker.send`` in a transaction) after a
priming message that created the target endpoint; the rest, and the top-ups between
measurements, are one INSERT ... SELECT that writes what SEND writes (the same row as
the one-statement SEND: the far endpoint's queue, group, level, service and contract; the
initiator's next sequence numbers, its send_sequence advanced to match), because SEND
through the API (~900/s) would not fit the time budget. Before the first measurement the
rows are checked: one row shape per conversation (the API's and the bulk rows alike) and
gap-free sequence numbers up to the initiator's send_sequence.

Measurement: --processes (4) receiver processes, after a common start line, loop over
``broker.receive(TARGET_QUEUE, top=N, timeout=0)`` (a transaction of its own) as fast as
they can for a fixed window (--window, 5 s, for top=1; a fifth of it for top=10, which
empties the queue ~8 times faster), or until the queue is drained. Throughput = messages
received by all / (last stop - first start). Both databases get VACUUM ANALYZE and the
server a CHECKPOINT once after the fill; then an uncounted warm-up window (top=1, then
top=10) on each; then every one of --rounds (8) rounds has a top=1 and a top=10 window on
each database, the two taking turns (top=1 levels then default, top=10 default then
levels; the next round the other way round), so that machine noise hits both. Before
every window the database gets VACUUM ANALYZE (what autovacuum would do), and after it
its queue is topped up to the same per-conversation counts, so that every window starts
from the same queue. No CHECKPOINT before each window: right after one, the first change
to every page writes a full-page image to the WAL, and the levels database, which serves
messages out of arrival order, changes several times as many pages per message as the
default one, which serves them in heap order, so a window right after a checkpoint
measures mostly that (in a trial: 0.76 vs 0.05 full-page images per message). The JSON
has the server's full-page images and WAL bytes per message and any checkpoint during
each window (server-wide counters: other databases' work shows up in them too). The
ratio is levels / default; its headline value is the median over rounds of the
per-round (paired) ratios; the JSON also has the ratio of the median rates.

Order check, on the levels database: every received message's level (``Message.priority``)
with the time its receive returned; the mean level of the first and last 10 % received in
a window (merged over the processes by time), the mean level by tenth, and the messages
received from a level below the highest level that still had ready messages at the end of
the window (no message arrives during a window, so each of those was received while a
higher-level message was ready: a group locked by another receiver, SKIP LOCKED, or a
misordering).

Prints one JSON object on stdout, progress on stderr, and appends a dated section to
docs/benchmarks.md (unless --no-docs). Machine facts, database handling, worker pool and
CPU accounting come from ``bench.broker_throughput``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg

from bench.broker_throughput import (
    ADMIN_URL,
    BODY,
    BUSY_WARNING_PCT,
    CONTRACT,
    FOREIGN_WARNING_PCT,
    INITIATOR_QUEUE,
    INITIATOR_SERVICE,
    MESSAGE_TYPE,
    START_TIMEOUT,
    TARGET_QUEUE,
    TARGET_SERVICE,
    Workers,
    busy_pct,
    cpu_accounts,
    database,
    docs_section,
    finish_run,
    log,
    machine_busy,
    machine_facts,
    our_backends,
    process_cpu,
    settle,
)
from scheduler_lib.broker import Broker

LEVELS = range(1, 11)
DEFAULT_LEVEL = 5
TOPS = (1, 10)
DBS = ("levels", "default")
API_MESSAGES_PER_CONVERSATION = 4  # sent through the API before the bulk fill
TARGETS = {"ratio_top1": (0.9, ">="), "ratio_top10": (0.9, ">=")}

READY_EXISTS = "SELECT EXISTS (SELECT 1 FROM queue_messages WHERE queue_name = %s AND status = 1)"
# Top each conversation up to its wanted number of ready messages, writing the rows the
# one-statement SEND writes (queries_postgresql.sql, send_fast), interleaved by
# conversation: the k-th new message of every conversation before the (k+1)-th.
TOP_UP = """
WITH want AS (
    SELECT * FROM unnest(%(handles)s::text[], %(counts)s::int[]) AS w(handle, want)
), have AS (
    SELECT i.conversation_handle AS handle, count(m.message_id) AS n
    FROM conversation_endpoints i
    JOIN conversation_endpoints t ON t.conversation_id = i.conversation_id AND NOT t.is_initiator
    LEFT JOIN queue_messages m ON m.conversation_handle = t.conversation_handle AND m.status = 1
    WHERE i.is_initiator
    GROUP BY i.conversation_handle
), need AS (
    SELECT w.handle, w.want - h.n AS n FROM want w JOIN have h ON h.handle = w.handle
    WHERE w.want > h.n
), sender AS (
    UPDATE conversation_endpoints s SET send_sequence = s.send_sequence + need.n
    FROM need WHERE s.conversation_handle = need.handle
    RETURNING s.conversation_handle, s.conversation_id, s.send_sequence - need.n AS first, need.n
)
INSERT INTO queue_messages (
    queue_name, conversation_group_id, conversation_handle, message_sequence_number,
    message_type_name, message_body, priority, status, service_name, service_contract_name,
    enqueued_at
)
SELECT f.queue_name, f.conversation_group_id, f.conversation_handle, sender.first + k,
    %(message_type)s, %(body)s, f.priority, 1, f.service_name, f.contract_name, %(now)s
FROM sender
JOIN conversation_endpoints f ON f.conversation_id = sender.conversation_id AND NOT f.is_initiator
CROSS JOIN LATERAL generate_series(0, sender.n - 1) AS k
ORDER BY k, sender.conversation_handle
"""


def target_service(level: int) -> str:
    return f"{TARGET_SERVICE}{level}"


def service_level(conversation: int) -> int:
    """The level (1..10) of conversation ``conversation``'s target service."""
    return conversation % len(LEVELS) + 1


# --- setup -----------------------------------------------------------------------------


def setup(url: str, conversations: int, levels: bool) -> tuple[list[str], dict[str, Any]]:
    """Catalog, (with ``levels``) the 10 priorities, the dialogs with their target
    endpoints in place, and a few messages each through the API. Returns the initiator
    handles and the endpoints' levels as read back (checked)."""
    with Broker(url) as broker:
        broker.create_message_type(MESSAGE_TYPE)
        broker.create_contract(CONTRACT, {MESSAGE_TYPE: "INITIATOR"})
        broker.create_queue(INITIATOR_QUEUE)
        broker.create_queue(TARGET_QUEUE)
        broker.create_service(INITIATOR_SERVICE, INITIATOR_QUEUE)
        for level in LEVELS:
            broker.create_service(target_service(level), TARGET_QUEUE, [CONTRACT])
        if levels:
            for level in LEVELS:
                broker.create_priority(
                    f"BenchLevel{level}",
                    contract=CONTRACT,
                    local_service=target_service(level),
                    remote_service=INITIATOR_SERVICE,
                    level=level,
                )
        with broker.transaction() as tx:
            handles = [
                str(tx.begin_dialog(INITIATOR_SERVICE, target_service(service_level(i)), CONTRACT))
                for i in range(conversations)
            ]
            for handle in handles:  # creates the target endpoint
                tx.send(handle, MESSAGE_TYPE, BODY)
        received = 0
        while received < conversations:
            got = broker.receive(TARGET_QUEUE, top=100, timeout=0)
            if not got:
                raise RuntimeError("setup: priming messages did not arrive")
            received += len(got)
        with broker.transaction() as tx:
            for _ in range(API_MESSAGES_PER_CONVERSATION):
                for handle in handles:
                    tx.send(handle, MESSAGE_TYPE, BODY)
        endpoints = broker.conversation_endpoints()
    return handles, check_endpoints(endpoints, handles, levels)


def check_endpoints(endpoints: list[Any], handles: list[str], levels: bool) -> dict[str, Any]:
    """Every target endpoint at its service's level (or 5 without priorities), every
    initiator endpoint at 5; the levels counted per side."""
    initiators = {str(e.conversation_handle): e for e in endpoints if e.is_initiator}
    targets = {e.conversation_id: e for e in endpoints if not e.is_initiator}
    wrong = []
    for i, handle in enumerate(handles):
        initiator = initiators[handle]
        target = targets[initiator.conversation_id]
        expected = service_level(i) if levels else DEFAULT_LEVEL
        if target.priority != expected or initiator.priority != DEFAULT_LEVEL:
            wrong.append((handle, target.service_name, target.priority, initiator.priority))
    out = {
        side: dict(sorted(Counter(e.priority for e in endpoints if e.is_initiator == ini).items()))
        for side, ini in (
            ("target_endpoints_by_level", False),
            ("initiator_endpoints_by_level", True),
        )
    }
    if wrong or len(targets) != len(handles):
        raise RuntimeError(f"endpoint levels not as set up: {wrong[:5]} {out}")
    return out


def wanted_counts(messages: int, conversations: int) -> list[int]:
    return [
        messages // conversations + (i < messages % conversations) for i in range(conversations)
    ]


def top_up(url: str, handles: list[str], counts: list[int]) -> int:
    """Ready messages of every conversation back to ``counts``; the rows inserted."""
    with psycopg.connect(url) as conn:
        cursor = conn.execute(
            TOP_UP,
            {
                "handles": handles,
                "counts": counts,
                "message_type": MESSAGE_TYPE,
                "body": BODY,
                "now": time.time(),
            },
        )
        inserted = cursor.rowcount
        conn.commit()
    return inserted


def queue_levels(url: str) -> dict[int, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        return dict(
            conn.execute(
                "SELECT priority, count(*) FROM queue_messages WHERE queue_name = %s "
                "AND status = 1 GROUP BY priority ORDER BY priority",
                (TARGET_QUEUE,),
            ).fetchall()
        )


def vacuum(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


def wal_counters() -> tuple[int, int, int]:
    """The server's (full-page images, WAL bytes, checkpoints) so far: all databases."""
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        fpi, wal_bytes = conn.execute("SELECT wal_fpi, wal_bytes FROM pg_stat_wal").fetchone()
        checkpoints = conn.execute(
            "SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter"
        ).fetchone()[0]
    return int(fpi), int(wal_bytes), int(checkpoints)


def check_fill(url: str, conversations: int) -> dict[str, Any]:
    """The API's rows and the bulk rows alike: one row shape per conversation, sequence
    numbers without gaps or duplicates, ending just below the initiator's send_sequence."""
    with psycopg.connect(url, autocommit=True) as conn:
        shapes = conn.execute(
            "SELECT count(*) FROM (SELECT DISTINCT queue_name, conversation_group_id, "
            "conversation_handle, message_type_name, message_body, priority, status, "
            "service_name, service_contract_name FROM queue_messages) x"
        ).fetchone()[0]
        bad_sequences = conn.execute(
            "SELECT count(*) FROM (SELECT m.conversation_handle FROM queue_messages m "
            "JOIN conversation_endpoints t ON t.conversation_handle = m.conversation_handle "
            "JOIN conversation_endpoints i ON i.conversation_id = t.conversation_id "
            "AND i.is_initiator GROUP BY m.conversation_handle, i.send_sequence "
            "HAVING count(*) <> count(DISTINCT m.message_sequence_number) "
            "OR max(m.message_sequence_number) - min(m.message_sequence_number) + 1 <> count(*) "
            "OR max(m.message_sequence_number) + 1 <> i.send_sequence) x"
        ).fetchone()[0]
        rows = conn.execute("SELECT count(*) FROM queue_messages").fetchone()[0]
    out = {"rows": rows, "row_shapes": shapes, "conversations_with_bad_sequences": bad_sequences}
    if shapes != conversations or bad_sequences:
        raise RuntimeError(f"fill check failed: {out}")
    return out


# --- receivers -------------------------------------------------------------------------


def receiver(url: str, index: int, top: int, window: float, start: Any) -> dict[str, Any]:
    """Receive(top) transactions for ``window`` seconds after the common start, or until
    the queue has no ready message left. The first receiver also accounts for the
    machine's CPU over its window."""
    first = index == 0
    broker = Broker(url, migrate=False)
    try:
        with psycopg.connect(url, autocommit=True) as check:
            for _ in range(5):  # warm the pool and the statements on the empty queue
                broker.receive(INITIATOR_QUEUE, top=top, timeout=0)
            start.wait(START_TIMEOUT)
            busy0, total0, _ = machine_busy() if first else (0.0, 0.0, 0.0)
            processes0 = process_cpu() if first else {}
            cpu0 = time.process_time()
            events: list[tuple[float, list[int]]] = []
            receives = empty = 0
            drained = False
            t0 = time.monotonic()
            end = t0 + window
            now = t0
            while now < end:
                got = broker.receive(TARGET_QUEUE, top=top, timeout=0)
                now = time.monotonic()
                receives += 1
                if got:
                    events.append((now, [m.priority for m in got]))
                    continue
                empty += 1
                if not check.execute(READY_EXISTS, (TARGET_QUEUE,)).fetchone()[0]:
                    drained = True
                    break
            t1 = time.monotonic()
            out: dict[str, Any] = {
                "start": t0,
                "stop": t1,
                "events": events,
                "receives": receives,
                "empty": empty,
                "drained": drained,
                "cpu": time.process_time() - cpu0,
            }
            if first:
                out["accounts"] = cpu_accounts(processes0, process_cpu(), our_backends(url))
                busy1, total1, _ = machine_busy()
                out["machine_busy"] = (busy1 - busy0) / max(1e-9, total1 - total0)
                out["machine_cpu_s"] = total1 - total0
    finally:
        broker.close()
    return out


def window_figures(
    results: list[dict[str, Any]], before: dict[int, int], after: dict[int, int]
) -> dict[str, Any]:
    """One window's figures from its receivers' results and the queue's ready messages
    by level before and after it."""
    timeline = [
        level for _, levels in sorted(e for r in results for e in r["events"]) for level in levels
    ]
    received = len(timeline)
    if not received:
        raise RuntimeError("a window received nothing")
    elapsed = max(r["stop"] for r in results) - min(r["start"] for r in results)
    receives = sum(r["receives"] for r in results)
    first = next(r for r in results if "accounts" in r)
    machine = first["machine_cpu_s"]
    tenth = max(1, received // 10)
    consumed = Counter(timeline)
    highest_left = max((lvl for lvl, n in after.items() if n), default=0)
    return {
        "received": received,
        "elapsed_s": round(elapsed, 3),
        "messages_per_s": round(received / elapsed, 1),
        "receives": receives,
        "empty_receives": sum(r["empty"] for r in results),
        "drained": any(r["drained"] for r in results),
        "ms_per_receive_txn": round(
            1000 * sum(r["stop"] - r["start"] for r in results) / max(1, receives), 3
        ),
        "client_cpu_ms_per_message": round(1000 * sum(r["cpu"] for r in results) / received, 3),
        "server_cpu_ms_per_message": round(1000 * first["accounts"]["backends"] / received, 3),
        "machine_cpu_busy_pct": round(100 * first["machine_busy"], 1),
        "foreign_cpu_pct": round(100 * first["accounts"]["foreign"] / machine, 1),
        "mean_level_first_10pct": round(statistics.mean(timeline[:tenth]), 2),
        "mean_level_last_10pct": round(statistics.mean(timeline[-tenth:]), 2),
        "mean_level_by_tenth": [
            round(statistics.mean(timeline[i * received // 10 : (i + 1) * received // 10]), 2)
            for i in range(10)
            if received >= 10
        ],
        "received_by_level": dict(sorted(consumed.items())),
        "ready_before_by_level": before,
        "ready_after_by_level": after,
        "received_below_highest_level_left": sum(
            n for lvl, n in consumed.items() if lvl < highest_left
        ),
        "queue_consistent": all(
            before.get(lvl, 0) - n == after.get(lvl, 0) for lvl, n in consumed.items()
        ),
    }


# --- measurement -----------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, Any]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "by_round": [round(v, 3) for v in values],
    }


def summarize(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """One database's windows at one TOP, over the rounds."""
    received = sum(w["received"] for w in windows)
    rates = [w["messages_per_s"] for w in windows]

    def weighted(key: str) -> float:
        return round(sum(w[key] * w["received"] for w in windows) / received, 3)

    return {
        "messages_per_s": spread(rates),
        "messages_received": received,
        "avg_messages_per_receive": round(received / sum(w["receives"] for w in windows), 2),
        "empty_receives": sum(w["empty_receives"] for w in windows),
        "windows_drained": sum(w["drained"] for w in windows),
        "ms_per_receive_txn": weighted("ms_per_receive_txn"),
        "client_cpu_ms_per_message": weighted("client_cpu_ms_per_message"),
        "server_cpu_ms_per_message": weighted("server_cpu_ms_per_message"),
        "machine_cpu_busy_pct": spread([w["machine_cpu_busy_pct"] for w in windows]),
        "foreign_cpu_pct_max": max(w["foreign_cpu_pct"] for w in windows),
        "server_wal_fpi_per_message": weighted("server_wal_fpi_per_message"),
        "server_wal_bytes_per_message": round(weighted("server_wal_bytes_per_message")),
        "windows_with_a_checkpoint": sum(w["server_checkpoints"] > 0 for w in windows),
        "windows": windows,
    }


def order_summary(windows: list[dict[str, Any]]) -> dict[str, Any]:
    received = sum(w["received"] for w in windows)
    below = sum(w["received_below_highest_level_left"] for w in windows)
    return {
        "mean_level_first_10pct": spread([w["mean_level_first_10pct"] for w in windows]),
        "mean_level_last_10pct": spread([w["mean_level_last_10pct"] for w in windows]),
        "received_below_highest_level_left": below,
        "received_below_highest_level_left_pct": round(100 * below / received, 3),
        "queue_consistent": all(w["queue_consistent"] for w in windows),
    }


def measure(
    workers: Workers,
    dbs: dict[str, dict[str, Any]],
    windows: dict[int, float],
    rounds: int,
) -> dict[str, Any]:
    """After a warm-up window on each, every round: for each TOP, a window on each
    database, in turns (top=1 levels default, top=10 default levels; the next round the
    other way round)."""
    n = workers.processes
    results: dict[int, dict[str, list[dict[str, Any]]]] = {
        top: {name: [] for name in dbs} for top in TOPS
    }
    names = list(dbs)

    def window(name: str, top: int, seconds: float) -> dict[str, Any]:
        db = dbs[name]
        vacuum(db["url"])
        before = queue_levels(db["url"])
        start = workers.barrier(n)
        args = [(db["url"], i, top, seconds, start) for i in range(n)]
        wal0 = wal_counters()
        out = workers.run(receiver, args, timeout=seconds + 120)
        wal1 = wal_counters()
        figures = window_figures(out, before, queue_levels(db["url"]))
        figures["server_wal_fpi_per_message"] = round((wal1[0] - wal0[0]) / figures["received"], 3)
        figures["server_wal_bytes_per_message"] = round((wal1[1] - wal0[1]) / figures["received"])
        figures["server_checkpoints"] = wal1[2] - wal0[2]
        top_up(db["url"], db["handles"], db["counts"])
        return figures

    settle(*(db["url"] for db in dbs.values()))  # VACUUM ANALYZE, CHECKPOINT
    for name in names:  # warm-up, not counted: colder caches, first page writes
        window(name, 1, 1.0)
        window(name, 10, 0.5)
    for r in range(rounds):
        for t, top in enumerate(TOPS):
            for name in names if (r + t) % 2 == 0 else reversed(names):
                figures = window(name, top, windows[top])
                results[top][name].append(figures)
                log(
                    f"round {r + 1}/{rounds}: top={top} {name}: {figures['messages_per_s']} msg/s"
                    f" ({figures['received']} in {figures['elapsed_s']} s"
                    + (", drained" if figures["drained"] else "")
                    + f"); mean level first/last 10% {figures['mean_level_first_10pct']}"
                    f"/{figures['mean_level_last_10pct']}"
                )
    out: dict[str, Any] = {}
    for top in TOPS:
        levels, default = results[top]["levels"], results[top]["default"]
        paired = [
            a["messages_per_s"] / b["messages_per_s"] for a, b in zip(levels, default, strict=True)
        ]
        s_levels, s_default = summarize(levels), summarize(default)
        out[f"top{top}"] = {
            "window_s": windows[top],
            "levels": s_levels,
            "default": s_default,
            "ratio": round(statistics.median(paired), 3),
            "ratio_by_round": spread(paired),
            "ratio_of_median_rates": round(
                s_levels["messages_per_s"]["median"] / s_default["messages_per_s"]["median"], 3
            ),
            "order_levels_db": order_summary(levels),
        }
    return out


# --- report ----------------------------------------------------------------------------


def check_targets(report: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, (target, op) in TARGETS.items():
        value = report[name.removeprefix("ratio_")]["ratio"]
        met = value >= target if op == ">=" else value <= target
        out[name] = {"value": value, "target": f"{op} {target}", "met": met}
    return out


def markdown_section(report: dict[str, Any]) -> str:
    c, t = report["config"], report["targets"]
    rows: list[tuple[str, Any, str, str]] = []
    foreign = 0.0
    for top in TOPS:
        x = report[f"top{top}"]
        lv, df, order = x["levels"], x["default"], x["order_levels_db"]
        foreign = max(foreign, lv["foreign_cpu_pct_max"], df["foreign_cpu_pct_max"])
        target = t[f"ratio_top{top}"]

        def rate(s: dict[str, Any]) -> str:
            r = s["messages_per_s"]
            return f"{r['median']} ({r['min']}..{r['max']})"

        rows += [
            (f"receive(top={top}), 10 levels, msg/s median (min..max)", rate(lv), "", ""),
            (f"receive(top={top}), all at level 5, msg/s median (min..max)", rate(df), "", ""),
            (
                f"top={top} ratio 10 levels / level 5, median of rounds (min..max)",
                f"{x['ratio']} ({x['ratio_by_round']['min']}..{x['ratio_by_round']['max']})",
                target["target"],
                "met" if target["met"] else "**missed**",
            ),
            (
                f"top={top} order, 10 levels: mean level of first / last 10 % received (median)",
                f"{order['mean_level_first_10pct']['median']} / "
                f"{order['mean_level_last_10pct']['median']}",
                "",
                "",
            ),
            (
                f"top={top} received below the highest level left, of all received",
                f"{order['received_below_highest_level_left']} of {lv['messages_received']} "
                f"({order['received_below_highest_level_left_pct']} %)",
                "",
                "",
            ),
            (
                f"top={top} ms per receive txn per process, 10 levels / level 5",
                f"{lv['ms_per_receive_txn']} / {df['ms_per_receive_txn']}",
                "",
                "",
            ),
            (
                f"top={top} WAL full-page images / bytes per message (server-wide), "
                "10 levels ; level 5",
                f"{lv['server_wal_fpi_per_message']} / {lv['server_wal_bytes_per_message']} ; "
                f"{df['server_wal_fpi_per_message']} / {df['server_wal_bytes_per_message']}",
                "",
                "",
            ),
            (
                f"top={top} client / backend CPU ms per message, 10 levels ; level 5",
                f"{lv['client_cpu_ms_per_message']} / {lv['server_cpu_ms_per_message']} ; "
                f"{df['client_cpu_ms_per_message']} / {df['server_cpu_ms_per_message']}",
                "",
                "",
            ),
        ]
    by_level = ", ".join(
        f"{level}: {n}"
        for level, n in report["setup"]["levels"]["endpoints"]["target_endpoints_by_level"].items()
    )
    checkpoints = sum(
        report[f"top{top}"][db]["windows_with_a_checkpoint"] for top in TOPS for db in DBS
    )
    notes = []
    if checkpoints:
        notes.append(f"Note: a checkpoint ran during {checkpoints} of the windows.")
    if foreign > FOREIGN_WARNING_PCT:
        notes.append(
            f"Warning: foreign work took up to {foreign}% of the machine's CPU during a "
            "window; the figures are noisy."
        )
    return docs_section(
        "priority_throughput",
        report,
        f"{c['processes']} receiver processes, {c['conversations']} conversations, "
        f"{c['messages']:,} ready messages at the start of every window, windows of "
        f"{c['window_s'][1]} s (top=1) and {c['window_s'][10]} s (top=10) in {c['rounds']} "
        f"rounds alternating the two databases; target endpoints by level in the 10-level "
        f"database: {by_level}; design in "
        "`bench/priority_throughput.py`'s docstring.",
        rows,
        notes,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.priority_throughput", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="~30 s smoke run")
    parser.add_argument(
        "--window",
        type=float,
        help="seconds per top=1 window (default 5; quick 2.5); top=10 windows: a fifth",
    )
    parser.add_argument("--rounds", type=int, help="rounds (default 8; quick 2)")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument(
        "--messages",
        type=int,
        help="ready messages at every window start (default 20000; quick 10000)",
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
    window = args.window or (2.5 if quick else 5.0)
    windows = {1: window, 10: round(window / 5, 2)}
    rounds = args.rounds or (2 if quick else 8)
    messages = args.messages or (10_000 if quick else 20_000)
    if args.conversations < len(LEVELS):
        parser.error(f"--conversations must be at least {len(LEVELS)}")
    if messages < args.conversations * (API_MESSAGES_PER_CONVERSATION + 1):
        parser.error("--messages too small for the conversations")

    waiting = time.monotonic()
    idle_check = busy_pct(1.0)
    waited_until = time.monotonic() + (args.wait_idle or 0)
    while idle_check > BUSY_WARNING_PCT and time.monotonic() < waited_until:
        log(f"the machine is {idle_check}% busy; waiting for it to go quiet")
        idle_check = busy_pct(5.0)
    if idle_check > BUSY_WARNING_PCT:
        log(f"warning: the machine is {idle_check}% busy before the start; figures will be noisy")
    started = time.monotonic()
    workers = Workers(args.processes)
    report: dict[str, Any] = {
        "benchmark": "priority_throughput",
        "started_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(
            [Path(sys.executable).name, "-m", "bench.priority_throughput", *sys.argv[1:]]
        ),
        "quick": quick,
        "machine": machine_facts(),
        "config": {
            "window_s": windows,
            "rounds": rounds,
            "processes": args.processes,
            "conversations": args.conversations,
            "messages": messages,
            "api_messages_per_conversation": API_MESSAGES_PER_CONVERSATION,
            "body_bytes": len(BODY),
        },
    }
    report["machine"]["loadavg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    report["machine"]["cpu_busy_pct_before_start"] = idle_check
    report["waited_for_quiet_s"] = round(started - waiting, 1)
    try:
        with database("prio_levels") as url_levels, database("prio_default") as url_default:
            dbs: dict[str, dict[str, Any]] = {}
            report["setup"] = {}
            counts = wanted_counts(messages, args.conversations)
            for name, url in (("levels", url_levels), ("default", url_default)):
                handles, endpoints = setup(url, args.conversations, levels=name == "levels")
                t0 = time.perf_counter()
                top_up(url, handles, counts)
                fill_s = time.perf_counter() - t0
                report["setup"][name] = {
                    "endpoints": endpoints,
                    "fill": check_fill(url, args.conversations),
                    "fill_s": round(fill_s, 2),
                    "ready_by_level": queue_levels(url),
                }
                dbs[name] = {"url": url, "handles": handles, "counts": counts}
                log(
                    f"{name}: target endpoints by level {endpoints['target_endpoints_by_level']}"
                    f", initiators {endpoints['initiator_endpoints_by_level']}; "
                    f"{messages} messages ready"
                )
            log(
                f"{args.processes} receivers, windows {windows[1]} s (top=1) and {windows[10]} s"
                f" (top=10), {rounds} rounds"
            )
            report.update(measure(workers, dbs, windows, rounds))
    except BaseException:
        workers.terminate()
        raise
    workers.close()
    report["targets"] = check_targets(report)
    for top in TOPS:
        x = report[f"top{top}"]
        log(
            f"top={top}: {x['levels']['messages_per_s']['median']} msg/s with 10 levels, "
            f"{x['default']['messages_per_s']['median']} at level 5; ratio {x['ratio']}"
        )
    return finish_run(report, started, None if args.no_docs else markdown_section)


if __name__ == "__main__":
    sys.exit(main())
