"""What the database's busy backends wait on during ``bench.peers``' waves workload, per
system: on the CPU, on the WAL flush, on a row lock another transaction holds.

    .venv-bench/bin/python -m bench.wait_events                 # ~2 min, prints a table
    .venv-bench/bin/python -m bench.wait_events --write-docs    # and appends it

Each system in ``--systems`` runs the waves workload (5 waves x 50 no-op tasks, 4-way
concurrency) exactly as ``python -m bench.peers --only waves --systems <system>`` runs it,
in a process of its own, while a thread here reads ``pg_stat_activity`` as often as it can
(a sleep of half a millisecond between looks): every client backend of the system's
databases that is running a statement is one sample of what its statement waits on. A
backend with no wait event is on the CPU (or about to report its wait). "Busy per look":
the busy backends a look found on average (the runs of the systems differ in length, and
the looks also cover each run's start-up, when nothing is busy: a rough figure, the counts
not compared at all). The shares say
where a statement's time inside the server goes: ``IO WALSync`` / ``LWLock WALWrite`` is a
commit waiting for the WAL to reach the disk (or for another backend's flush of it),
``Lock transactionid`` / ``Lock tuple`` a statement queued behind a row that another
transaction has locked until it commits. Our statements are named after the ``-- name:``
of our SQL files (``bench.statements_per_task``'s matching; ``+``: another statement rides
in it), the peers' by their text. The server keeps the first ``track_activity_query_size``
bytes of a statement's text (1024 by default): a longer one is named by the statements
whose text begins so, ``… (cut)`` — with ``or`` where several do (take_fast and
receive_fast share their first 1,600 bytes). The looks cost the server's CPU too (one core
of two is shared with them), so the shares, not the counts, are the figure.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import psycopg

from bench.broker_throughput import ADMIN_URL, log, publish
from bench.statements_per_task import _normal, label, statement_names

REPO = Path(__file__).resolve().parent.parent
LOOK = """
SELECT coalesce(wait_event_type || ' ' || wait_event, 'CPU'), query
FROM pg_stat_activity
WHERE datname LIKE 'bench_peers_%' AND datname NOT LIKE 'bench_peers_tmpl_%'
AND backend_type = 'client backend' AND state = 'active' AND pid <> pg_backend_pid()
"""
TOP = 10  # (statement, wait) rows shown per system


def sample(system: str, rounds: int) -> tuple[collections.Counter[tuple[str, str]], int]:
    """(statement text, wait) -> samples, and the number of looks, while ``system`` runs
    the waves workload."""
    seen: collections.Counter[tuple[str, str]] = collections.Counter()
    looks = 0
    done = threading.Event()
    failed: list[BaseException] = []

    def watch() -> None:
        nonlocal looks
        try:
            with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
                while not done.is_set():
                    for wait, query in conn.execute(LOOK, prepare=True).fetchall():
                        seen[(query or "", wait)] += 1
                    looks += 1
                    time.sleep(0.0005)
        except BaseException as exc:  # said after the run: no table of nothing
            failed.append(exc)

    watcher = threading.Thread(target=watch, name="wait-events")
    watcher.start()
    try:
        command = [sys.executable, "-m", "bench.peers", "--only", "waves", "--systems", system]
        command += ["--rounds", str(rounds), "--no-docs"]
        subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    finally:
        done.set()
        watcher.join()
    if failed:
        raise RuntimeError(f"looking at pg_stat_activity failed: {failed[0]}") from failed[0]
    return seen, looks


def named(query: str, names: dict[str, str], cut_at: int) -> str:
    """Our statement's name; for a text the server cut, every statement it may be."""
    if not query:
        return "(no text)"
    # (the server cuts at a character's boundary: up to 3 bytes short of its size)
    if len(query.encode()) < cut_at - 4:
        return label(query, names)
    text = _normal(query).rsplit(" ", 1)[0]  # the last word may be cut short
    begins = sorted({name for known, name in names.items() if known.startswith(text)})
    return (" or ".join(begins) or label(query, names)) + " … (cut)"


def cut_size() -> int:
    """The bytes of a statement's text the server keeps (``track_activity_query_size``)."""
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        row = conn.execute(
            "SELECT setting::int FROM pg_settings WHERE name = %s", ("track_activity_query_size",)
        ).fetchone()
    return int(row[0]) if row else 1024


def kind(wait: str) -> str:
    """The wait's class, as the table's columns say it."""
    if wait == "CPU":
        return "CPU"
    if wait in ("IO WALSync", "LWLock WALWrite", "IO WALWrite"):
        return "WAL flush"
    if wait in ("Lock transactionid", "Lock tuple"):
        return "row lock"
    return "other"


KINDS = ("CPU", "WAL flush", "row lock", "other")


def markdown(results: dict[str, tuple[collections.Counter[tuple[str, str]], int]]) -> str:
    names = statement_names(REPO)
    cut_at = cut_size()
    at = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    systems = ",".join(results)
    lines = [
        "",  # a section of its own, whatever the last one ended with
        f"## What the database waits on in the waves — {at}",
        "",
        f"Command: `python -m bench.wait_events --systems {systems}` (design in "
        "`bench/wait_events.py`'s docstring). The waves workload of the peers benchmark "
        "(5 waves x 50 no-op tasks, 4-way concurrency); samples of the busy client "
        "backends, shares of them:",
        "",
        "| system | looks | busy samples | busy per look | " + " | ".join(KINDS) + " |",
        "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in KINDS) + " |",
    ]
    for system, (seen, looks) in results.items():
        total = sum(seen.values())
        by_kind = collections.Counter()
        for (_, wait), n in seen.items():
            by_kind[kind(wait)] += n
        shares = " | ".join(f"{100 * by_kind[k] / max(total, 1):.0f}%" for k in KINDS)
        per_look = total / max(looks, 1)
        lines.append(f"| {system} | {looks:,} | {total:,} | {per_look:.2f} | {shares} |")
    for system, (seen, _) in results.items():
        total = sum(seen.values()) or 1
        by_name: collections.Counter[tuple[str, str]] = collections.Counter()
        for (query, wait), n in seen.items():
            ours = system.startswith("ours")
            text = named(query, names, cut_at) if ours else _normal(query)[:60] or "(no text)"
            by_name[(text, wait)] += n
        lines += [
            "",
            f"{system}, the first {TOP} (statement, wait) by share of its busy samples:",
            "",
            "| statement | wait | share |",
            "| --- | --- | ---: |",
        ]
        for (text, wait), n in by_name.most_common(TOP):
            lines.append(f"| {text.replace('|', '/')} | {wait} | {100 * n / total:.1f}% |")
    return "\n".join(lines) + "\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.wait_events", description=__doc__)
    parser.add_argument("--systems", default="ours,procrastinate")
    parser.add_argument("--rounds", type=int, default=2, help="bench.peers rounds per system")
    parser.add_argument("--write-docs", action="store_true", help="append to benchmarks.md")
    args = parser.parse_args()
    results = {}
    for system in args.systems.split(","):
        log(f"waves of {system}, sampling pg_stat_activity")
        results[system] = sample(system, args.rounds)
    publish(markdown(results), args.write_docs)


if __name__ == "__main__":
    main()
