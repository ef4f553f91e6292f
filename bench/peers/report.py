"""The peers section of docs/benchmarks.md and its charts, from one run's JSON.

Pure functions (no peer imports, matplotlib only inside :func:`charts`), so the unit test
runs in the main virtualenv.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

BEGIN = "<!-- peers:begin -->"
END = "<!-- peers:end -->"
NAMES = {
    "ours": "scheduler_lib (ours)",
    "ours_lazy": "scheduler_lib (ours), lazy start (`durable_start=False`)",
    "raw": "raw INSERT / DELETE … SKIP LOCKED (ceiling)",
    "procrastinate": "procrastinate",
    "procrastinate_4p": "procrastinate, 4 worker processes",
    "pgqueuer": "pgqueuer",
    "pgqueuer_4p": "pgqueuer, 4 worker processes",
    "celery": "Celery (Redis), prefetch 1",
    "celery_p4": "Celery (Redis), prefetch 4",
    "raw_redis": "raw Redis LPUSH / BRPOP (floor)",
}
# Workload 3's raw system is a floor, not workload 1's ceiling: the least a dispatch does.
FLOORS = {
    "raw": "raw PostgreSQL INSERT + NOTIFY / DELETE … SKIP LOCKED (floor)",
    "raw_redis": NAMES["raw_redis"],
}
WORKLOADS = ("queue", "waves", "dispatch", "scale")

# Why ours stands where it does and what would close a gap: by mechanism, so it stays
# true from run to run; the numbers next to it are generated.
WHY = {
    "queue": (
        "Each of our SENDs and RECEIVEs is one statement on PostgreSQL (the SEND checks the "
        "contract and endpoint state and takes the conversation's next sequence number; the "
        "RECEIVE locks one conversation group and takes its messages in order). Our consumer "
        "keeps RECEIVE and its handler's commit in one transaction (a consumer that dies "
        "gives the message back): BEGIN, RECEIVE and COMMIT, three round trips, as psycopg "
        "sends the BEGIN alone and waits for its reply (strace of `tx.receive`), against "
        "the ceiling's one autocommit `DELETE … SKIP LOCKED` (a consumer that dies after "
        "it loses the message);"
        " with 100 per SEND and RECEIVE that cost is spread over the batch. In the concurrent"
        " shape at batch 1 one producer makes one durable commit per enqueue while 4 consumers"
        " share the two cores with it (the results JSON gives each run's enqueue time beside "
        "its length). Since 2026-11-30 each thread keeps its connection between its "
        "transactions and statements (`connections.Kept`) instead of a pool's checkout and "
        "checkin each (Python work on every operation): `python -m "
        "bench.before_after --before 305d523` at 70a8ba6 (2026-11-30 08:13, its table "
        "further down, medians of 3 rounds) measured batch 1 at 0.44 of the ceiling before "
        "and 0.69 after, the drain at 0.47 and 0.54 — on a machine whose figures moved by a "
        "quarter between runs that hour, so compare within a run. Since later that day a "
        "transaction of the driver's statements alone ends on the driver (no SQLAlchemy "
        "begin and commit around it), and a RECEIVE of one message runs a lighter statement "
        "(`receive_fast_one`: what the general one's grouping and sort come to for one row). "
        "`python -m bench.drain_cost` splits the drain (at 73cd89d, 2026-11-30 11:51, its "
        "table further down, medians of 3 rounds): ours drained at 0.70 of the raw ceiling, "
        "the same RECEIVE statement sent straight from psycopg at 0.84 in a transaction and "
        "1.09 in autocommit — the statement costs no more than the ceiling's DELETE; what is "
        "left is our Python around it (0.204 ms of client CPU per message against 0.131) "
        "and the transaction's two more round trips. "
        "procrastinate cannot dequeue in batches (one `procrastinate_fetch_job` per job) and "
        "writes each job's status twice; pgqueuer dequeues in batches but logs every "
        "completion. What would close the rest: less Python per transaction; a caller that "
        "accepts the ceiling's at-most-once has its shape already in `broker.receive()` "
        "outside a transaction (one autocommit statement)."
    ),
    "waves": (
        "A wave is one transaction of 50 `AsyncSent` (their `execution_log` rows pipelined "
        "with the SEND). An executor takes up to 4 tasks at once while the queue's tasks run "
        'short (prefetch, since 2026-11-29; docs/scheduler.md, "Prefetch") and records the '
        "first one's start in the take's round trip (`Broker.take_recorded`: the take commits "
        "without waiting for the WAL flush, so the wave's one conversation group is free for "
        "the next reader at once, then the start commits durably in a transaction of its "
        "own, which flushes both); the others wait, QUEUED in their rows, for the next free "
        "reader of the process. Each task's row end, lease end and `AsyncDone` are one "
        "autocommit statement (the statement locks the lease first and writes nothing when "
        "it is gone), and since 2026-11-30 the start of the held task its reader runs next "
        "rides at the end of that statement (`Store.riding`'s `after`; before, a `log_start` "
        "round trip and durable commit of its own): about one round trip and one durable "
        "commit per task, and one take per few tasks. `python -m bench.statements_per_task` "
        "(at 455e429, 2026-11-30 22:21, its table further down) counted 2.39 statements per "
        "task (`log_start` 0.05) against 3.19 (`log_start` 0.74) on 2026-11-29. Since the same "
        "day statements are prepared at their second execution on a connection, not "
        "psycopg's sixth (each reader has its own connection, and psycopg forgets them at "
        "a ROLLBACK): the first run of a round was 8-15% slower than the second before, "
        "3-6% after, in `bench.peers --only waves --systems ours` runs taking turns with "
        "the code before it. The caller's "
        "`synchronization` gathers the answers arriving within 10 ms of the first (counting "
        "NOTIFYs, no statement) so a wave costs a handful of RECEIVEs. Between two waves "
        "the caller receives the last answer and sends the next wave: "
        "`python -m bench.wave_boundaries` splits it (at a44d963, 2026-11-30 05:04, its "
        "table further down, medians of 8 runs): the send of waves 2-5 took 3.2-3.6 ms and "
        "the first wave's 4.3 ms, against 7.9-9.2 ms for the first at 158f269 in three runs "
        "of the same command that morning, taking turns with the new code (until 2026-11-30 "
        "a new scheduler's first message made its target's endpoint on the checked path, 16 "
        "round trips; now one statement ahead of the SEND, in its round trip; and since "
        "2026-11-30 a wave's lists go as binary arrays, which psycopg's text form escaped "
        "element by element in Python, and its log ids are taken while the wave before it "
        "runs); the previous wave's last end to the send 2.3-3.0 ms, the send's commit to "
        "its first task's start 1.3-1.5 ms (3.3 ms for the first wave), a wave itself 53-57 "
        "ms. "
        "Celery's caller waits "
        "on Redis (its `get()` re-polls every 5 ms here, not its default 0.5 s); pgqueuer's "
        "CompletionWatcher re-reads job status after LISTEN/NOTIFY (debounce 5 ms); "
        "procrastinate's caller polls job status every 10 ms. The machine's two cores are the"
        " limit for everyone, so what decides is the CPU a task costs in the workers, the "
        "caller and the database server together: `python -m bench.cpu_per_task` splits it "
        "per system (at fd39489, 2026-12-01 01:30, its table further down): ours cost 5.08 ms "
        "of CPU per task, 2.84 of them in the PostgreSQL server, procrastinate 4.96 (1.71 in "
        "the server) and procrastinate with 4 processes 6.51 (1.94) — our workers and caller "
        "spend the least, the server the most: the server's share is where a task costs us "
        "more. Inside the server the answers also wait on "
        "each other: every reader's `AsyncDone` takes the scheduler's conversation's next "
        "sequence number on its endpoint row, which stays locked until its commit has "
        "reached the disk, so the answers of one wave queue behind each other's WAL flush; "
        "`python -m bench.wait_events` (at fd39489, 2026-12-01 01:31, its table further "
        "down) found 26% of our busy backends' samples waiting on a row lock, all of them "
        "the answer's (`send_fast`), and none of procrastinate's, whose jobs end on rows of "
        "their own; 37% of ours were on the CPU and 29% waiting for the WAL flush. "
        "Since 2026-12-01 a target of lazy start (`ours_lazy`, for tasks whose effects are "
        "idempotent) also ends its tasks without waiting for the flush "
        "(`Broker.send(..., durable=False)`): its answers unlock the endpoint at once; "
        "the durable target's still hold it through their flush. "
        "Not built: a NOTIFY channel per queue, so that "
        "the answers stop waking "
        "the worker's listener (PostgreSQL 15 still signals every listening backend of the "
        "database whatever the channel: `src/backend/commands/async.c` before v19 keeps no "
        "map of who listens on which channel; only the client-side wake would go)."
    ),
    "dispatch": (
        "Measured from the `exec_async` call to the first line of the task's handler "
        "(`bench.peers.handlers.noop`, as each peer's handler is timed): the caller's "
        "SEND (since 2026-11-29 its row rides inside the SEND's own statement: one "
        "autocommit round trip, whose durable commit sends the NOTIFY; before, a "
        "transaction: the row and the SEND in one round trip, then the COMMIT), the "
        "worker's listener woken, one reader woken (not all four), its"
        " take and the task's durable start in one round trip, and the call of the task. "
        "`python -m bench.dispatch_breakdown` splits it (run at aedcdf0, 2026-12-01 22:22, "
        "its table further down, medians of 200; its worker is instrumented, 4.46 ms in "
        "all): `exec_async` took 2.62 ms after a 20-40 ms pause against 0.68 ms back to "
        "back, and 1.93 ms after a pause without the WAL flush (which gives up the send's "
        "durability); in the whole path the NOTIFY reached the worker 2.10 ms after the "
        "call, the take was issued 0.18 ms later, the take and start took 1.74 ms against "
        "0.41 ms for a take alone back to back, and the handler began 0.37 ms after the "
        "take returned — waking idle processes is most of it. The same run measured the "
        "floor of this machine, no scheduler_lib code: one round trip to an idle server "
        "after the pause costs 0.58 ms on PostgreSQL and 0.59 ms on Redis (0.06 and 0.07 "
        "back to back), so each wake-up of an idle process is about half a millisecond "
        "here, for every system; the least dispatch on PostgreSQL (one autocommit INSERT + "
        "NOTIFY, the consumer's LISTEN woken, one `DELETE ... SKIP LOCKED` take) took 1.50 "
        "ms, 1.69 ms with the take's commit flushed (a durable start), and 1.46 ms with "
        "the take on the LISTEN connection (the lever the issue named: no gain, not "
        "built); the least on Redis (LPUSH to a BRPOP) 0.69 ms. Since 2026-12-01 22:30 "
        "this table has both floors itself, same run as the systems (the PostgreSQL one "
        "fires its NOTIFY from a trigger, so it reads a little higher than the "
        "breakdown's). In the 23:55 run, PostgreSQL's floor was 2.31 ms p50 and Redis's "
        "0.79: Celery sat 3.9 ms above its floor, ours 2.93 ms above ours (lazy start "
        "2.50), procrastinate 4.1 and pgqueuer 3.9 — of every system, ours does the least "
        "above its server's floor, and what keeps it behind Celery's p50 is the 1.52 ms "
        "between the floors: Redis hands the item to the waiting BRPOP in the push's own "
        "round trip, where PostgreSQL's durable commit wakes the listening backend, then "
        "the consumer, which must take in a second round trip. In the 19:16 run of an "
        "earlier session (no floors in it) Celery's p50 was 1.81 ms, about the "
        "breakdown's durable "
        "PostgreSQL floor: at that machine state, beating Celery would have needed a "
        "PostgreSQL dispatch with no work above the floor. Our remaining work above it: "
        "the client and server work of the enqueue, the take and the start, which a "
        "pause makes dearer too (the breakdown: our `exec_async` costs 1.9 ms more after "
        "the pause than back to back, a bare round trip 0.5 ms more). "
        "Celery's path is one Redis"
        ' LPUSH to a server that writes nothing to disk here (`--save "" --appendonly no`) '
        "and a BRPOP already waiting; the PostgreSQL peers pay a durable commit and a NOTIFY "
        "as we do, and one statement for their dequeue. `ours_lazy` is the same worker with "
        "the target's `durable_start=False` (for tasks whose effects are idempotent; "
        'docs/scheduler.md, "Durable or lazy start"): the start commits without waiting '
        "for the WAL flush, so the gap between our two rows is that flush on the task's "
        "path; the send before it stays durable (its answer after it, since 2026-12-01, "
        "does not wait for the flush either). What could close the "
        "rest: less client and server work per enqueue and take (not built); the "
        "floors' wake-ups stay."
    ),
    "scale": (
        "Our finished tasks leave only their `execution_log` row (conversations, groups, "
        "messages and leases are deleted when both sides end), and every statement on the hot"
        " path uses a primary key or a partial index over open rows; procrastinate keeps "
        "succeeded jobs and their events in the tables it dequeues from (partial indexes keep"
        " its fetch flat); pgqueuer moves finished jobs to its log table; Redis keys do not "
        "affect a list pop."
    ),
}


def fmt(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "n/a"
    return f"{x:,.{digits}f}"


def spread(s: dict[str, Any], digits: int = 1) -> str:
    return f"{fmt(s['median'], digits)} ({fmt(s['min'], digits)}..{fmt(s['max'], digits)})"


def versus(ours: float, best: float, higher_is_better: bool) -> tuple[str, float]:
    """'ahead by 23%' / 'behind by 1.8x' and the factor (>1: ours better)."""
    factor = ours / best if higher_is_better else best / ours
    if factor >= 1:
        return (f"ahead by {100 * (factor - 1):.0f}%", factor)
    return (f"behind by {1 / factor:.2f}x (the peer is {1 / factor:.2f}x better)", factor)


# Workload 1's columns: (key, heading); the drain shape's are absent from older runs.
QUEUE_COLUMNS = (
    ("batch_1", "batch 1"),
    ("batch_100", "batch 100"),
    ("drain_batch_1", "drain, batch 1"),
    ("drain_batch_100", "drain, batch 100"),
)


def queue_table(w: dict[str, Any]) -> list[str]:
    columns = [c for c in QUEUE_COLUMNS if all(c[0] in r for r in w["systems"].values())]
    lines = [
        "| system | " + " | ".join(f"{h}: msg/s median (min..max)" for _, h in columns) + " |",
        "| --- |" + " ---: |" * len(columns),
    ]
    for system, r in w["systems"].items():
        cells = " | ".join(spread(r[key], 0) for key, _ in columns)
        lines.append(f"| {NAMES[system]} | {cells} |")
    lines.append("")
    for batch, heading in columns:
        peers = {
            s: r[batch]["median"]
            for s, r in w["systems"].items()
            if s not in ("ours", "raw") and r[batch]["median"]
        }
        if "ours" in w["systems"] and peers:
            best = max(peers, key=lambda s: peers[s])
            text, _ = versus(w["systems"]["ours"][batch]["median"], peers[best], True)
            line = f"- {heading}: ours {text} vs the best peer ({NAMES[best]})"
            if "raw" in w["systems"]:
                raw = w["systems"]["raw"][batch]["median"]
                line += f"; ours is {share_text(w['systems']['ours'][batch]['median'] / raw)}"
                line += " of the ceiling"
            lines.append(line + ".")
            if batch in ("batch_1", "drain_batch_1") and "raw" in w["systems"]:
                share = w["systems"]["ours"][batch]["median"] / w["systems"]["raw"][batch]["median"]
                met = share >= QUEUE_GOAL and w["systems"]["ours"][batch]["median"] > peers[best]
                lines.append(
                    f"  - goal (issue 24): at least {QUEUE_GOAL} of the ceiling and ahead of "
                    f"every peer: {_verdict(met)}."
                )
    return lines


def share_text(share: float) -> str:
    """A share of the ceiling, with a third digit where two would round it onto the
    goal (0.599 is no "0.60" beside a missed goal)."""
    text = f"{share:.2f}"
    if float(text) == QUEUE_GOAL and share < QUEUE_GOAL:
        text = f"{share:.3f}"
    return text


# Issue 24's goals, each against the best peer configuration of the same run.
QUEUE_GOAL = 0.6  # ours / the raw ceiling at batch 1, both shapes
WAVES_GOAL = 0.8  # ours' makespan / the best peer's
SUITE_GOAL_S = 900  # the whole suite


def _verdict(met: bool) -> str:
    return "**met**" if met else "**missed**"


def waves_table(w: dict[str, Any]) -> list[str]:
    lines = [
        "| system | 5 waves x 50: makespan s, median (min..max) "
        "| sync overhead per wave, ms, median (min..max) |",
        "| --- | ---: | ---: |",
    ]
    for system, r in w["systems"].items():
        lines.append(
            f"| {NAMES[system]} | {spread(r['makespan_s'], 3)} "
            f"| {spread(r['sync_overhead_ms'], 1)} |"
        )
    lines.append("")
    peers = {s: r["makespan_s"]["median"] for s, r in w["systems"].items() if not _is_ours(s)}
    for variant in _ours(w):
        lines.extend(best_line(w, "makespan_s", "makespan", variant))
        if peers:
            ratio = w["systems"][variant]["makespan_s"]["median"] / min(peers.values())
            lines.append(
                f"  - goal (issue 24): at most {WAVES_GOAL} x the best peer's makespan; "
                f"{_who(variant)} is {ratio:.2f} x: {_verdict(ratio <= WAVES_GOAL)}."
            )
    return lines


def _is_ours(system: str) -> bool:
    return system == "ours" or system.startswith("ours_")


def _ours(w: dict[str, Any]) -> list[str]:
    """Our configurations in this workload's results: each is compared with the peers,
    never with the other."""
    return [s for s in w["systems"] if _is_ours(s)]


def _who(variant: str) -> str:
    return "ours" if variant == "ours" else "ours with lazy start"


def dispatch_table(w: dict[str, Any]) -> list[str]:
    lines = [
        "| system | samples | p50 ms | p90 ms | p99 ms | max ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for system, r in w["systems"].items():
        lines.append(
            f"| {FLOORS.get(system, NAMES[system])} | {r['samples']} | {fmt(r['p50_ms'], 2)} "
            f"| {fmt(r['p90_ms'], 2)} | {fmt(r['p99_ms'], 2)} | {fmt(r['max_ms'], 2)} |"
        )
    lines.append("")
    peers = {s: r for s, r in w["systems"].items() if not _is_ours(s) and s not in FLOORS}
    lines += _above_floors(w["systems"])
    for variant in _ours(w) if peers else []:
        ours = w["systems"][variant]
        for key in ("p50_ms", "p99_ms"):
            best = min(peers, key=lambda s: peers[s][key])
            text, _ = versus(ours[key], peers[best][key], False)
            lines.append(f"- {key[:3]}: {_who(variant)} {text} vs the best peer ({NAMES[best]}).")
        redis = [r for s, r in peers.items() if s.startswith("celery")]
        postgres = [r for s, r in peers.items() if not s.startswith("celery")]
        met = all(
            (not redis or ours[key] <= min(r[key] for r in redis))
            and (not postgres or ours[key] < min(r[key] for r in postgres))
            for key in ("p50_ms", "p99_ms")
        )
        lines.append(
            "  - goal (issue 24): p50 and p99 at most Celery's and below every PostgreSQL "
            f"peer's: {_verdict(met)}."
        )
    return lines


def _above_floors(systems: dict[str, Any]) -> list[str]:
    """How far above its server's floor each system's p50 is (the floors: the least a
    dispatch does on PostgreSQL and on Redis, no system's code)."""
    lines = []
    for floor, on in (("raw", "PostgreSQL"), ("raw_redis", "Redis")):
        if floor not in systems:
            continue
        base = systems[floor]["p50_ms"]
        above = [
            f"{NAMES[s]} +{r['p50_ms'] - base:.2f}"
            for s, r in systems.items()
            if s not in FLOORS and s.startswith("celery") == (on == "Redis")
        ]
        if above:
            lines.append(f"- p50 above the {on} floor ({base:.2f} ms), ms: {', '.join(above)}.")
    return lines


def scale_table(w: dict[str, Any]) -> list[str]:
    lines = [
        "| system | retained | dequeue + complete, ms median: none | retained "
        "| ratio retained / none |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for system, r in w["systems"].items():
        lines.append(
            f"| {NAMES[system]} | {r['retained']:,} | {fmt(r['ms_none'], 3)} "
            f"| {fmt(r['ms_retained'], 3)} | {fmt(r['ratio'], 3)} |"
        )
    lines.append("")
    if "ours" in w["systems"]:
        ratio = w["systems"]["ours"]["ratio"]
        verdict = "flat (within 10%)" if ratio <= 1.1 else f"**not flat**: {ratio:.2f}x"
        lines.append(f"- ours: {verdict}.")
    return lines


def best_line(w: dict[str, Any], key: str, label: str, variant: str = "ours") -> list[str]:
    peers = {s: r[key]["median"] for s, r in w["systems"].items() if not _is_ours(s)}
    if variant not in w["systems"] or not peers:
        return []
    best = min(peers, key=lambda s: peers[s])
    text, _ = versus(w["systems"][variant][key]["median"], peers[best], False)
    return [f"- {label}: {_who(variant)} {text} vs the best peer ({NAMES[best]})."]


TABLES = {
    "queue": queue_table,
    "waves": waves_table,
    "dispatch": dispatch_table,
    "scale": scale_table,
}
TITLES = {
    "queue": "1. Queue throughput (enqueue → dequeue → complete, trivial handler)",
    "waves": "2. Waves: 5 waves x 50 no-op tasks, 4 workers, next wave after the previous",
    "dispatch": "3. Dispatch latency: idle workers, one task at a time, enqueue → handler start",
    "scale": "4. Scale: dequeue + complete with completed items retained vs none",
}


def section(report: dict[str, Any], img_prefix: str = "img") -> str:
    """The generated block (markers included)."""
    m = report["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["packages"].items() if v)
    lines = [
        BEGIN,
        "",
        f"## Side by side with the peers — {report['started_at']}"
        + (" (quick)" if report["quick"] else ""),
        "",
        f"Command: `{report['command']}` (the suite took {report['elapsed_s']:.0f} s, goal "
        f"{SUITE_GOAL_S} s: {_verdict(report['elapsed_s'] <= SUITE_GOAL_S)}; "
        "`make bench` creates `.venv-bench` first). Generated by `bench/peers/`; do not edit "
        "between the markers. Raw figures: "
        f"`bench/results/{report['results_file']}`.",
        "",
        f"Machine: {m['cores']} cores, {m['postgresql'].split(' on ')[0]}, Redis "
        f"{m.get('redis', '?')}, Python {m['python']}; {versions}; git "
        f"{(m['git'].get('commit') or '?')[:10]}"
        + (" + uncommitted scheduler_lib changes" if m["git"].get("scheduler_lib_dirty") else "")
        + ".",
        "",
        report["settings_text"],
        "",
        *(f"Warning: {w}" for w in report["warnings"]),
        *([""] if report["warnings"] else []),
    ]
    for name in WORKLOADS:
        w = report["workloads"].get(name)
        if not w:
            continue
        lines += [
            f"### {TITLES[name]}",
            "",
            w["design"],
            "",
            *TABLES[name](w),
            "",
            f"![{name}]({img_prefix}/peers-{name}.png)",
            "",
            f"Why: {WHY[name]}",
            "",
        ]
    lines.append(END)
    return "\n".join(lines) + "\n"


def replace_block(text: str, block: str) -> str:
    """``text`` with the generated block replaced; on first use the block goes after the
    title and intro (before the first ``## `` section), or at the end."""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        return head + block.rstrip("\n") + tail
    if BEGIN in text or END in text:
        raise ValueError("docs/benchmarks.md has one peers marker without the other")
    at = text.find("\n## ")
    if at == -1:
        return text.rstrip("\n") + "\n\n" + block
    return text[: at + 1] + block + "\n" + text[at + 1 :]


def charts(report: dict[str, Any], directory: Path) -> list[Path]:
    """One PNG per workload: ``peers-<workload>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    colors = {
        "ours": "#1f77b4",
        "ours_lazy": "#17becf",
        "raw": "#7f7f7f",
        "procrastinate": "#2ca02c",
        "pgqueuer": "#ff7f0e",
        "celery": "#d62728",
        "celery_p4": "#9467bd",
        "procrastinate_4p": "#98df8a",
        "pgqueuer_4p": "#ffbb78",
        "raw_redis": "#c7c7c7",
    }
    for name in WORKLOADS:
        w = report["workloads"].get(name)
        if not w:
            continue
        systems = list(w["systems"])
        columns = [c for c in QUEUE_COLUMNS if all(c[0] in r for r in w["systems"].values())]
        wide = name == "queue" and len(columns) > 2
        fig, axes = plt.subplots(1, len(columns) if wide else 2, figsize=(20 if wide else 10, 3.6))
        if name == "queue":
            panels = [
                (key, f"{heading}: msg/s, log scale (higher is better)") for key, heading in columns
            ]
            for ax, (key, title) in zip(axes, panels, strict=True):
                # 57 to 72,000 msg/s: on a linear axis the slower half is invisible, and on
                # a log axis a bar's length means nothing: points, whiskers min..max.
                _spread_points(ax, w, systems, key, [colors[s] for s in systems])
                ax.set_yscale("log")
                ax.set_title(title, fontsize=10)
        elif name == "waves":
            panels = [
                ("makespan_s", "makespan, s (lower is better)"),
                ("sync_overhead_ms", "sync overhead per wave, ms"),
            ]
            for ax, (key, title) in zip(axes, panels, strict=True):
                _spread_bars(ax, w, systems, key, [colors[s] for s in systems])
                ax.set_title(title, fontsize=10)
        elif name == "dispatch":
            # Bars: the percentile; whiskers: the samples' spread around it.
            for ax, (key, low, high, title) in zip(
                axes,
                (
                    ("p50_ms", "min_ms", "p90_ms", "p50, whiskers min..p90"),
                    ("p99_ms", "p90_ms", "max_ms", "p99, whiskers p90..max"),
                ),
                strict=True,
            ):
                got = [w["systems"][s] for s in systems]
                ax.bar(
                    systems,
                    [g[key] for g in got],
                    yerr=[[g[key] - g[low] for g in got], [g[high] - g[key] for g in got]],
                    color=[colors[s] for s in systems],
                )
                ax.set_title(f"{title}: ms (lower is better)", fontsize=10)
        else:
            x = range(len(systems))
            axes[0].bar(
                [i - 0.2 for i in x],
                [w["systems"][s]["ms_none"] for s in systems],
                width=0.4,
                label="none retained",
                color="#aaaaaa",
            )
            axes[0].bar(
                [i + 0.2 for i in x],
                [w["systems"][s]["ms_retained"] for s in systems],
                width=0.4,
                label="retained",
                color=[colors[s] for s in systems],
            )
            axes[0].set_xticks(list(x), systems)
            axes[0].legend(fontsize=8)
            axes[0].set_title("dequeue + complete, ms median", fontsize=10)
            axes[1].bar(
                systems,
                [w["systems"][s]["ratio"] for s in systems],
                color=[colors[s] for s in systems],
            )
            axes[1].axhline(1.0, color="black", linewidth=0.8)
            axes[1].set_title("ratio retained / none (1.0 = flat)", fontsize=10)
        for ax in axes:
            ax.tick_params(axis="x", labelsize=8, labelrotation=30)
        fig.suptitle(TITLES[name], fontsize=10)
        fig.tight_layout()
        path = directory / f"peers-{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def _spread_points(
    ax: Any, w: dict[str, Any], systems: list[str], key: str, colors: list[str]
) -> None:
    """A point at the median, whiskers from the min to the max."""
    for i, (system, color) in enumerate(zip(systems, colors, strict=True)):
        got = w["systems"][system][key]
        yerr = [[got["median"] - got["min"]], [got["max"] - got["median"]]]
        ax.errorbar([i], [got["median"]], yerr=yerr, fmt="o", color=color, capsize=3)
    ax.set_xticks(range(len(systems)), systems)
    ax.grid(axis="y", which="both", linewidth=0.3)


def _spread_bars(
    ax: Any, w: dict[str, Any], systems: list[str], key: str, colors: list[str]
) -> None:
    """Bars of the median, whiskers from the min to the max."""
    med = [w["systems"][s][key]["median"] for s in systems]
    lo = [m - w["systems"][s][key]["min"] for s, m in zip(systems, med, strict=True)]
    hi = [w["systems"][s][key]["max"] - m for s, m in zip(systems, med, strict=True)]
    ax.bar(systems, med, yerr=[lo, hi], color=colors)
