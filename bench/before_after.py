"""The broker before and after a change, side by side in one run.

    .venv/bin/python -m bench.before_after --before 2c4200e                 # ~9 min
    .venv/bin/python -m bench.before_after --before 2c4200e --write-docs    # and appends

Both trees are checked out (``git worktree``) under one temporary directory — the commit
``--before`` and ``--after`` (default ``HEAD``) — so that nothing but the code differs: a
tree's location alone moved the dispatch p50 by ~0.4 ms in an earlier comparison. Each
round runs three benchmarks from each tree in turn (which tree goes first alternates), as
subprocesses of this interpreter whose working directory is the tree (its
``scheduler_lib`` is imported, checked before the first round):

- ``bench.broker_throughput --quick --no-docs``: SEND + RECEIVE throughput of the broker
  alone, one message per transaction (b) and 100 (c), against the raw table (a); the
  wake-up latency (d);
- ``bench.dispatch_breakdown --samples 150``: the caller's ``exec_async`` after a pause,
  the take with the durable start, the whole path from the call to the handler;
- ``bench.peers --only queue,waves,dispatch --systems ours,raw --rounds 1 --no-docs``:
  the peers benchmark's queue (batch 1, both shapes, against the raw ceiling of the same
  run), waves (5 x 50) and dispatch workloads, ours only.

The table gives each figure's median over the rounds, before and after, and their ratio.
The machine must be quiet: on 2 cores another process moves these figures more than the
changes they are meant to judge.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.broker_throughput import REPO, append_docs, log

SIDES = ("before", "after")
BENCHES = {
    "throughput": ["bench.broker_throughput", "--quick", "--no-docs"],
    "breakdown": ["bench.dispatch_breakdown", "--samples", "150"],
    "peers": [
        *("bench.peers", "--only", "queue,waves,dispatch", "--systems", "ours,raw"),
        *("--rounds", "1", "--no-docs"),
    ],
}


def _report(text: str) -> dict[str, Any]:
    """The JSON report a benchmark prints last."""
    start = re.search(r"(?m)^\{$", text)
    end = text.rindex("\n}")
    if start is None:
        raise ValueError("no JSON report in the output")
    return json.loads(text[start.start() : end + 2])


def _p50(label: str) -> Callable[[str], float]:
    def read(text: str) -> float:
        found = re.search(re.escape(label) + r": p50 ([0-9.]+) ms", text)
        if found is None:
            raise ValueError(f"no '{label}' in the output")
        return float(found.group(1))

    return read


def _queue(text: str, *, who: str, shape: str) -> float:
    """Workload 1 of the peers benchmark at one shape: ours, the raw ceiling, or their
    ratio (the figure issue 24's goal is set on)."""
    systems = _report(text)["workloads"]["queue"]["systems"]
    ours, raw = (systems[s][shape]["median"] for s in ("ours", "raw"))
    return {"ours": ours, "raw ceiling": raw, "ours / raw": round(ours / raw, 3)}[who]


# (figure, unit, which benchmark's output, how to read it)
FIGURES: list[tuple[str, str, str, Callable[[str], float]]] = [
    (
        "raw table, 1 per transaction (a)",
        "msg/s",
        "throughput",
        lambda t: _report(t)["a_raw"]["messages_per_s"],
    ),
    (
        "broker SEND + RECEIVE, 1 per transaction (b)",
        "msg/s",
        "throughput",
        lambda t: _report(t)["b_broker_top1"]["messages_per_s"],
    ),
    ("b / a", "", "throughput", lambda t: _report(t)["ratios"]["b_over_a"]),
    (
        "broker, 100 per transaction (c)",
        "msg/s",
        "throughput",
        lambda t: _report(t)["c_broker_top100"]["messages_per_s"],
    ),
    (
        "wake-up latency p50 (d)",
        "ms",
        "throughput",
        lambda t: _report(t)["d_wakeup_latency"]["p50_ms"],
    ),
    (
        "exec_async after a pause, p50",
        "ms",
        "breakdown",
        _p50("caller alone, exec_async after a 20-40 ms pause"),
    ),
    (
        "take + durable start, p50",
        "ms",
        "breakdown",
        _p50("whole path, take + durable start (one round trip)"),
    ),
    (
        "call -> handler start, p50",
        "ms",
        "breakdown",
        _p50("whole path, total: call -> handler start"),
    ),
    *(
        (
            f"queue {shape}, {who}",
            unit,
            "peers",
            functools.partial(_queue, who=who, shape=key),
        )
        for shape, key in (("batch 1", "batch_1"), ("drain batch 1", "drain_batch_1"))
        for who, unit in (("ours", "msg/s"), ("raw ceiling", "msg/s"), ("ours / raw", ""))
    ),
    (
        "waves 5 x 50 makespan",
        "s",
        "peers",
        lambda t: _report(t)["workloads"]["waves"]["systems"]["ours"]["makespan_s"]["median"],
    ),
    (
        "dispatch p50",
        "ms",
        "peers",
        lambda t: _report(t)["workloads"]["dispatch"]["systems"]["ours"]["p50_ms"],
    ),
    (
        "dispatch p99",
        "ms",
        "peers",
        lambda t: _report(t)["workloads"]["dispatch"]["systems"]["ours"]["p99_ms"],
    ),
]


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def _run(tree: Path, module: list[str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", *module],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(module)} in {tree} failed:\n{done.stderr[-2000:]}")
    return done.stderr + "\n" + done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the commit before the change")
    parser.add_argument("--after", default="HEAD", help="the commit after it (HEAD)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write-docs", action="store_true", help="append to benchmarks.md")
    args = parser.parse_args(argv)
    commits = {side: _git("rev-parse", "--short=10", getattr(args, side)) for side in SIDES}
    started = time.monotonic()
    figures: dict[str, dict[str, list[float]]] = {s: {f[0]: [] for f in FIGURES} for s in SIDES}
    with tempfile.TemporaryDirectory(prefix="bench-before-after-") as scratch:
        trees = {side: Path(scratch) / side for side in SIDES}
        try:
            for side in SIDES:
                _git("worktree", "add", "--detach", str(trees[side]), commits[side])
                probe = subprocess.run(
                    [sys.executable, "-c", "import scheduler_lib; print(scheduler_lib.__file__)"],
                    cwd=trees[side],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                if not probe.strip().startswith(str(trees[side])):
                    raise RuntimeError(f"the {side} tree imports scheduler_lib from {probe}")
            for r in range(args.rounds):
                for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                    out = {name: _run(trees[side], module) for name, module in BENCHES.items()}
                    for label, _, bench, read in FIGURES:
                        figures[side][label].append(read(out[bench]))
                    log(f"round {r + 1}: {side} done")
        finally:
            for side in SIDES:
                subprocess.run(
                    ["git", "worktree", "remove", "--force", str(trees[side])],
                    cwd=REPO,
                    capture_output=True,
                )
    rows = [
        f"| figure | before ({commits['before']}) | after ({commits['after']}) | after / before |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label, unit, _, _ in FIGURES:
        before = statistics.median(figures["before"][label])
        after = statistics.median(figures["after"][label])
        rows.append(
            f"| {label}{f' ({unit})' if unit else ''} | {before:.4g} | {after:.4g} "
            f"| {after / before:.2f} |"
        )
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    section = (
        f"\n## before_after — {stamp}\n\n"
        f"Command: `python -m bench.before_after --before {commits['before']} --after "
        f"{commits['after']} --rounds {args.rounds}` (took {time.monotonic() - started:.0f} s; "
        "design in `bench/before_after.py`'s docstring). Medians of the rounds; each round "
        "ran both trees, alternating which went first. The runs, per side and figure: "
        + "; ".join(
            f"{side} {label}: {', '.join(f'{v:.3g}' for v in figures[side][label])}"
            for side in SIDES
            for label in ("b / a", "waves 5 x 50 makespan", "dispatch p50")
        )
        + ".\n\n"
        + "\n".join(rows)
        + "\n"
    )
    print(section)
    if args.write_docs:
        append_docs(section)
        log("appended to docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
